"""Streaming DiLoCo (core.fragments, simulate.streaming): assignment, schedule, rounds per fragment."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.config import OuterConfig, TrainConfig
from p2p_diloco.core.fragments import FragmentSchedule, StreamingRounds, assign_fragments
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.core.round_driver import Collected
from p2p_diloco.core.rounds import Observation, Outcome, RoundPolicy, RoundResult
from p2p_diloco.simulate.engine import SimConfig
from p2p_diloco.simulate.modes import run
from p2p_diloco.simulate.streaming import peak_rate

TINY_NAMES = ["model.embed_tokens.weight"] + [
    f"model.layers.{i}.{part}" for i in range(4)
    for part in ("self_attn.q_proj.weight", "mlp.up_proj.weight", "input_layernorm.weight")
] + ["model.norm.weight"]
TINY_NUMELS = [33152] + [16384, 45056, 128] * 4 + [128]


def test_layers_are_dealt_strided_and_the_loose_tensors_go_to_the_lightest_fragment() -> None:
    groups = assign_fragments(TINY_NAMES, TINY_NUMELS, 2)
    layer_of = {i: int(n.split(".")[2]) for i, n in enumerate(TINY_NAMES) if ".layers." in n}
    assert {layer_of[i] for i in groups[0] if i in layer_of} == {0, 2}
    assert {layer_of[i] for i in groups[1] if i in layer_of} == {1, 3}
    four = assign_fragments(TINY_NAMES, TINY_NUMELS, 4)
    sizes = [sum(TINY_NUMELS[i] for i in g) for g in four]
    # The embedding joins one layer, the final norm another: the largest fragment is one layer plus the embedding.
    assert 0 in four[0] and len(TINY_NAMES) - 1 in four[1]
    assert max(sizes) == 16384 + 45056 + 128 + 33152
    assert sorted(i for g in four for i in g) == list(range(len(TINY_NAMES)))


def test_more_fragments_than_layers_is_refused_and_a_model_without_layers_is_dealt_by_tensor() -> None:
    with pytest.raises(ValueError, match="4 layers, fewer than --fragments 5"):
        assign_fragments(TINY_NAMES, TINY_NUMELS, 5)
    assert assign_fragments(["a", "b", "c"], [1, 2, 3], 2) == [[0, 2], [1]]


def test_fragments_sync_at_their_offsets_and_merge_tau_steps_later() -> None:
    schedule = FragmentSchedule(local_steps=8, fragments=4, delay=2)
    assert [schedule.offset(f) for f in range(4)] == [0, 2, 4, 6]
    syncs = {s: schedule.syncs(s) for s in range(1, 25) if schedule.syncs(s)}
    assert syncs == {2: [1], 4: [2], 6: [3], 8: [0], 10: [1], 12: [2], 14: [3], 16: [0], 18: [1], 20: [2],
                     22: [3], 24: [0]}
    assert schedule.merges(10) == [0] and schedule.merges(4) == [1] and schedule.merges(2) == []
    events = [0]
    while events[-1] < 12:
        events.append(schedule.next_event(events[-1]))
    assert events == [0, 2, 4, 6, 8, 10, 12]
    assert FragmentSchedule(local_steps=6, fragments=2, delay=1).next_event(3) == 4  # merge of fragment 1
    with pytest.raises(ValueError, match="delay"):
        FragmentSchedule(local_steps=8, fragments=4, delay=3)


class ScriptedPort:
    """A fragment's port whose all-reduce answers from a script; nobody is ever ahead."""

    def __init__(self, state: OuterState) -> None:
        self.state = state
        self.results: list[str] = []
        self.sent: list[tuple[list[torch.Tensor], float]] = []
        self.factor = 2.0
        """The group's mean is our work times this (the other member did more or less)."""

    def observe(self, epoch: int) -> Observation:
        return Observation(epoch, epoch, 3, unseen_s=0.0)

    def in_minority(self, epoch: int) -> bool:
        return False

    def swarm_epoch(self) -> int | None:
        return self.state.epoch

    def averaging(self, epoch: int) -> None:
        pass

    def before_allreduce(self) -> None:
        pass

    def average(self, lease, weight, staleness, epoch, stale_weight) -> RoundResult:
        delta, _ = lease.in_flight()
        self.sent.append(([t.clone() for t in delta], weight))
        if self.results.pop(0) == "fail":
            return RoundResult(Outcome.SKIPPED, "partial all-reduce: a member failed", epoch,
                               contributors=("me", "b"), weights=(weight, weight), stale_weights=(0.0, 0.0),
                               stalenesses=(0, 0))
        return RoundResult(Outcome.AVERAGED, "", epoch, contributors=("me", "b"), weights=(weight, weight),
                           stale_weights=(0.0, 0.0), stalenesses=(0, 0),
                           fresh_mean=[self.factor * t for t in delta])

    def resync(self, min_epoch: int) -> bool:
        return False

    def published(self, epoch: int, update: object = None) -> None:
        pass

    def collect(self, epoch: int, timeout: float) -> Collected:
        raise AssertionError("not eager")

    def launch(self, *args: object) -> bool:
        raise AssertionError("not eager")

    def discard(self, why: str) -> None:
        pass

    def lease(self) -> None:
        return None

    def withdraw(self) -> None:
        pass


def _peer(alpha: float = 0.0, delay: int = 0) -> tuple[StreamingRounds, list[torch.Tensor], list[ScriptedPort]]:
    params = [torch.full((3,), float(i + 1)) for i in range(4)]
    names = [f"layers.{i}.weight" for i in range(4)]
    ports: list[ScriptedPort] = []

    def make_port(f: int, state: OuterState, own: list[torch.Tensor]) -> ScriptedPort:
        ports.append(ScriptedPort(state))
        return ports[-1]

    peer = StreamingRounds(params, names, FragmentSchedule(4, 2, delay), RoundPolicy(),
                           lambda f, own: OuterState(own, lr=1.0, momentum=0.0), make_port, "me", alpha=alpha)
    peer.begin()
    return peer, params, ports


def _train(params: list[torch.Tensor], by: float) -> None:
    for p in params:
        p.sub_(by)


def test_a_failed_fragment_allreduce_is_never_applied_and_its_work_is_carried() -> None:
    peer, params, ports = _peer()
    assert peer.fragments[0].indices == [0, 2] and peer.fragments[1].indices == [1, 3]
    ports[1].results = ["fail", "ok"]
    ports[0].results = ["ok"]
    _train(params, 0.5)
    peer.trained(16)
    (report,) = peer.step(2)  # fragment 1 syncs at step 2: its all-reduce fails
    assert report.fragment == 1 and report.outcome is Outcome.SKIPPED
    frag1 = peer.fragments[1]
    # Nothing of the failed round applied: anchors, epoch and the trained parameters are as they were.
    assert frag1.state.epoch == 0
    assert torch.equal(frag1.state.anchors[0], torch.full((3,), 2.0))
    assert torch.equal(params[1], torch.full((3,), 1.5)) and torch.equal(params[3], torch.full((3,), 3.5))
    _train(params, 0.25)
    peer.trained(16)
    (report,) = peer.step(4)  # fragment 0 syncs at step 4 and averages, unaffected by fragment 1's failure
    assert report.fragment == 0 and report.outcome is Outcome.AVERAGED
    assert peer.fragments[0].state.epoch == 1
    # Its group mean is twice our work (0.75 per value): lr 1 moves the anchors by 1.5.
    assert torch.equal(params[0], torch.full((3,), 1.0 - 1.5)) and torch.equal(params[2], torch.full((3,), 1.5))
    assert torch.equal(params[1], torch.full((3,), 1.25))  # fragment 1 untouched, still training on
    _train(params, 0.25)
    peer.trained(16)
    (report,) = peer.step(6)  # fragment 1 again: its pseudo-gradient covers both phases, weighted as both
    delta, weight = ports[1].sent[-1]
    assert weight == 16 + 16 + 16  # the failed round's phase (carried) and this one's two runs of steps
    assert torch.allclose(delta[0], torch.full((3,), 1.0))  # 0.5 + 0.25 + 0.25 since its anchors
    assert report.outcome is Outcome.AVERAGED and frag1.state.epoch == 1
    assert torch.equal(params[1], torch.full((3,), 2.0 - 2.0))


def test_the_merge_keeps_alpha_of_the_local_work_done_while_the_allreduce_ran() -> None:
    peer, params, ports = _peer(alpha=0.5, delay=1)
    ports[1].results = ["ok"]
    ports[1].factor = 3.0
    _train(params, 0.5)
    peer.trained(8)
    assert peer.step(2) == []  # synced, the all-reduce overlaps the next step
    _train(params, 0.5)  # the overlapped step: params[1] 1.0
    peer.trained(4)
    (report,) = peer.step(3)
    assert report.outcome is Outcome.AVERAGED and report.fragment == 1
    delta, weight = ports[1].sent[-1]
    assert weight == 8 and torch.equal(delta[0], torch.full((3,), 0.5))  # taken at the sync, not at the merge
    # global = 2 - 3 * 0.5 = 0.5 and local 1.0 merge to 0.75; for the other tensor 2.5 and 3.0 to 2.75.
    assert torch.equal(peer.fragments[1].state.anchors[0], torch.full((3,), 0.5))
    assert torch.equal(params[1], torch.full((3,), 0.75)) and torch.equal(params[3], torch.full((3,), 2.75))
    assert torch.equal(params[0], torch.full((3,), 0.0))  # fragment 0 has not synced: all local


def test_a_launched_round_changes_nothing_until_it_lands_and_lands_as_the_blocking_one() -> None:
    # the swarm's τ > 0 path: the round opened at the sync, its exchange (decision and all-reduce) run while the
    # next step trains, landed at the merge step; the same numbers as the blocking test above
    peer, params, ports = _peer(alpha=0.5, delay=1)
    ports[1].results = ["ok"]
    ports[1].factor = 3.0
    _train(params, 0.5)
    peer.trained(8)
    peer.sync(1, 2)
    exchange = peer.launch(1)
    frag1 = peer.fragments[1]
    assert frag1.synced is None and frag1.flight is not None
    exchange()  # on the session's thread in the swarm; here at once
    assert len(ports[1].sent) == 1 and ports[1].sent[0][1] == 8
    assert frag1.state.epoch == 0 and torch.equal(frag1.state.anchors[0], torch.full((3,), 2.0))
    _train(params, 0.5)  # the overlapped step trains on the parameters the exchange left alone
    peer.trained(4)
    assert torch.equal(params[1], torch.full((3,), 1.0))
    report = peer.finish(1)
    assert report.outcome is Outcome.AVERAGED and report.fragment == 1 and frag1.flight is None
    assert torch.equal(frag1.state.anchors[0], torch.full((3,), 0.5))
    assert torch.equal(params[1], torch.full((3,), 0.75)) and torch.equal(params[3], torch.full((3,), 2.75))
    with pytest.raises(RuntimeError, match="no synced work"):
        peer.finish(1)


@pytest.mark.parametrize("exchanged", [True, False])
def test_a_launched_round_that_failed_or_never_exchanged_is_carried_not_applied(exchanged: bool) -> None:
    peer, params, ports = _peer(delay=1)
    ports[1].results = ["fail"]
    _train(params, 0.5)
    peer.trained(8)
    peer.sync(1, 2)
    exchange = peer.launch(1)
    if exchanged:
        exchange()
    _train(params, 0.25)
    peer.trained(4)
    report = peer.finish(1)
    assert report.outcome is Outcome.SKIPPED and report.new_epoch == 0
    frag1 = peer.fragments[1]
    assert frag1.state.epoch == 0 and torch.equal(frag1.state.anchors[0], torch.full((3,), 2.0))
    assert torch.equal(params[1], torch.full((3,), 1.25))  # all the work kept, for the next round
    assert frag1.driver.pending.weight_for(0) == 8  # the failed round's samples carried
    assert len(ports[1].sent) == int(exchanged)


def test_a_port_that_raises_during_the_exchange_gives_a_carried_round() -> None:
    # exchange may run on a thread of its own: a port breaking its never-raise contract there must not kill the
    # round unseen, nor let anything be applied
    peer, params, ports = _peer(delay=1)
    ports[1].results = ["ok"]

    def broken(*args: object) -> RoundResult:
        raise ConnectionError("the averager process went away")

    ports[1].average = broken
    _train(params, 0.5)
    peer.trained(8)
    peer.sync(1, 2)
    peer.launch(1)()
    report = peer.finish(1)
    assert report.outcome is Outcome.SKIPPED and "the round raised" in report.reason
    assert peer.fragments[1].state.epoch == 0 and torch.equal(params[1], torch.full((3,), 1.5))
    assert peer.fragments[1].driver.pending.weight_for(0) == 8


def _sim_cfg(**outer: object) -> TrainConfig:
    cfg = TrainConfig()
    cfg.outer.lr, cfg.outer.momentum, cfg.outer.local_steps, cfg.outer.min_local_steps = 1.0, 0.0, 4, 2
    cfg.inner.lr, cfg.inner.warmup_steps, cfg.inner.batch_size = 1e-3, 2, 2
    cfg.model.seq_len, cfg.data.eval_batches = 32, 1
    for key, value in outer.items():
        setattr(cfg.outer, key, value)
    cfg.outer.__post_init__()
    return cfg


@pytest.mark.parametrize("codec", ["none", "4bit"])
def test_one_fragment_without_delay_is_diloco_bit_for_bit(codec: str) -> None:
    ef = codec != "none"
    diloco = run(_sim_cfg(compression=codec, error_feedback=ef), SimConfig(mode="diloco", workers=2, rounds=3))
    streaming = run(_sim_cfg(compression=codec, error_feedback=ef), SimConfig(mode="streaming", workers=2, rounds=3))
    assert [r.eval_loss for r in streaming.rounds] == [r.eval_loss for r in diloco.rounds]
    assert streaming.total_bytes_sent_per_worker == diloco.total_bytes_sent_per_worker > 0
    assert streaming.fragment_outcomes == {"averaged": 6}


def test_four_fragments_send_the_same_bytes_at_a_quarter_of_the_peak() -> None:
    one = run(_sim_cfg(), SimConfig(mode="streaming", workers=2, rounds=2))
    four = run(_sim_cfg(fragments=4), SimConfig(mode="streaming", workers=2, rounds=2))
    assert four.total_bytes_sent_per_worker == one.total_bytes_sent_per_worker
    assert four.peak_bytes_per_s == pytest.approx(
        max(four.fragment_numels) / sum(four.fragment_numels) * one.peak_bytes_per_s)
    assert four.peak_bytes_per_s <= 0.3 * one.peak_bytes_per_s
    assert four.fragment_outcomes == {"averaged": 2 * 4 * 2}


def test_peak_rate_adds_overlapping_transfers_only() -> None:
    assert peak_rate([[0, 1, 10], [1, 2, 10]]) == 10
    assert peak_rate([[0, 2, 10], [1, 3, 10]]) == 10
    assert peak_rate([[0, 2, 20], [1, 3, 10]]) == 15
    assert peak_rate([]) == 0


@pytest.mark.parametrize(("changes", "message"), [
    ({"fragments": 5, "local_steps": 4, "min_local_steps": 2}, "at most local_steps=4"),
    ({"fragments": 2, "local_steps": 8, "fragment_delay": 5}, r"fragment_delay: must be in \[0, local_steps / fragments = 4\]"),
    ({"fragment_alpha": 1.0}, "fragment_alpha"),
    ({"fragments": 2, "overlap": "eager"}, "use it with --overlap none"),
])
def test_fragment_settings_are_validated(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OuterConfig(**changes)


def test_fragments_outside_the_streaming_mode_are_refused() -> None:
    with pytest.raises(ValueError, match="need --mode streaming"):
        run(_sim_cfg(fragments=2), SimConfig(mode="diloco", workers=2, rounds=1))


def test_a_drifted_fragment_is_voted_out_resynced_alone_and_its_work_folded_late() -> None:
    from p2p_diloco.simulate.streaming import StreamingSimulation

    simulation = StreamingSimulation(_sim_cfg(fragments=2), SimConfig(mode="streaming", workers=3, rounds=3))
    drifted = simulation.peers[2].fragments[1]

    def drift(step: int) -> None:
        if step == 2:  # after fragment 1's first round: worker 2's copy of it drifts
            with torch.no_grad():
                drifted.state.anchors[0].add_(0.01)

    result = simulation.run(after_step=drift)
    # Fragment 1 at step 6: workers 0 and 1 average, worker 2 (minority) resyncs fragment 1 from them; its work
    # of that phase is folded into fragment 1's round at step 10. Fragment 0 never noticed.
    assert result.fragment_outcomes == {"averaged": 3 * 6 - 2, "resynced": 1, "folded_late": 1}
    for f in range(2):
        states = [peer.fragments[f].state for peer in simulation.peers]
        assert len({s.epoch for s in states}) == 1
        for other in states[1:]:
            assert all(torch.equal(a, b) for a, b in zip(states[0].anchors, other.anchors, strict=True))


def test_a_peers_place_in_the_schedule_follows_from_its_fragments_epochs() -> None:
    schedule = FragmentSchedule(local_steps=10, fragments=2)  # fragment 1 syncs at 5, 15, ...; fragment 0 at 10, 20
    assert [schedule.sync_step(1, k) for k in range(4)] == [0, 5, 15, 25]
    assert [schedule.sync_step(0, k) for k in range(4)] == [0, 10, 20, 30]
    assert schedule.position([0, 0]) == 0  # nothing synced: the next event is fragment 1's first sync
    assert schedule.position([0, 1]) == 5 and schedule.next_event(5) == 10  # between the two: fragment 0 next
    assert schedule.position([1, 1]) == 10 and schedule.next_event(10) == 15
    assert schedule.position([3, 4]) == 35 and schedule.next_event(35) == 40
    # a peer whose fragment 1 is a round behind (a skipped round) stands where its last sync was
    assert schedule.position([4, 3]) == 40
    with pytest.raises(ValueError, match="2 fragments"):
        schedule.position([1, 1, 1])
    # with τ = 2 a peer stands at its last merge, and its phases end at merges (each sync τ steps inside one)
    delayed = FragmentSchedule(local_steps=10, fragments=2, delay=2)
    assert delayed.position([0, 0]) == 0 and delayed.next_merge(0) == 7
    assert delayed.position([0, 1]) == 7 and delayed.next_merge(7) == 12 and delayed.syncs(12 - 2) == [0]
    assert delayed.position([1, 1]) == 12 and delayed.next_merge(12) == 17
    assert schedule.next_merge(35) == schedule.next_event(35) == 40  # τ = 0: a merge is a sync
