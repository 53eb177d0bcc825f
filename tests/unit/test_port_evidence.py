"""SwarmPort on a scripted swarm: what the port does with what core.evidence decides (downloads, catch-ups,
votes, crediting), with no network."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from test_evidence import SYBILS, Clock  # the same fake clock and Sybil ids as the evidence tests

from p2p_diloco.core.delayed import Contribution, StalenessPolicy, aggregate_round
from p2p_diloco.core.dylu import PHASE_RECORD_MAX_AGE_S
from p2p_diloco.core.evidence import (
    MOVED_ON_PASSES,
    Claim,
    Evidence,
    credited,
    state_verdict,
)
from p2p_diloco.core.lease import BufferLease, LeaseState
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.core.rounds import LateWork, Outcome, RoundResult
from p2p_diloco.peer.faults import NO_FAULTS
from p2p_diloco.peer.port import DOWNLOAD_ATTEMPTS, SwarmPort
from p2p_diloco.swarm.checksum import params_sha256, state_sha256, tensor_manifest

# ---------------------------------------------------------------------- the port, on a scripted swarm


@dataclass
class ScriptedSwarm:
    """What ``SwarmPort`` asks of ``swarm.facade.Swarm``, scripted: records, votes, downloads, rounds."""

    peer_id: str = "me"
    cfg: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(max_round_weight=100.0,
                                                                         state_download_timeout_s=60.0))
    averaged: list[tuple[float, float]] = field(default_factory=list)
    claims: dict[str, int] = field(default_factory=dict)
    speeds: dict[str, float] = field(default_factory=dict)
    votes: dict[str, str] = field(default_factory=dict)
    donor: SimpleNamespace | None = None
    downloads: list[tuple[int, frozenset[str] | None]] = field(default_factory=list)
    update: SimpleNamespace | None = None
    """What ``download_update`` returns (``swarm.catchup``)."""
    moves_on: dict[str, int] = field(default_factory=dict)
    """Claims that change while a download runs (the swarm moved on meanwhile)."""
    served_chunks: dict[str, int] = field(default_factory=dict)
    """Donors that delivered verified chunks of a download that then failed, with its epoch (``backed``)."""
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)
    """``(phase_s, age_s)`` of a peer's record: how far into its inner phase it was, how long ago."""
    result: RoundResult | None = None
    buffers: list[torch.Tensor] | None = None
    """What ``fresh_buffers`` offers (the averager's shared buffers); None: a round still holds them."""
    withdrawn_updates: int = 0
    served: list[tuple[int, bool]] = field(default_factory=list)
    """``(epoch, checksum published)`` of every ``serve``."""
    votes_read: list[int] = field(default_factory=list)
    """The epoch of every ``checksum_votes`` read."""

    def records(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(peer_id=p, epoch=e, client_mode=False, steps_per_s=self.speeds.get(p, 1.0),
                                phase_s=self.phases.get(p, (0.0, 0.0))[0],
                                age_s=lambda p=p: self.phases.get(p, (0.0, 0.0))[1])
                for p, e in self.claims.items()]

    def checksum_votes(self, epoch: int) -> dict[str, str]:
        self.votes_read.append(epoch)
        return dict(self.votes)

    def download(self, templates, min_epoch, timeout=None, trusted=None, backed=None):  # noqa: ANN001, ANN201
        self.downloads.append((min_epoch, trusted))
        self.claims.update(self.moves_on)
        if backed is not None:
            backed.update(self.served_chunks)
        donor = self.donor
        if isinstance(donor, list):  # a sequence of downloads
            donor = donor.pop(0)
        return donor

    def download_update(self, templates, base_sha, base_epoch, timeout, trusted=None):  # noqa: ANN001, ANN201
        update, self.update = self.update, None
        return update if update is not None and update.base == (base_sha, base_epoch) else None

    def withdraw_update(self) -> None:
        self.withdrawn_updates += 1

    def serve(self, anchors, momentum, epoch, *, checksum, manifest=None, update=None) -> str:  # noqa: ANN001
        self.served.append((epoch, checksum))
        return state_sha256(anchors, momentum, params_sha=manifest.sha if manifest is not None else None)

    def withdraw(self) -> None:
        pass

    def fresh_buffers(self) -> list[torch.Tensor] | None:
        return self.buffers

    def average(self, delta, weight, staleness, epoch, stale, stale_weight, copy_out=True,  # noqa: ANN001
                left_behind=None, vouched=None) -> RoundResult:  # noqa: ANN001
        self.averaged.append((weight, stale_weight))
        self.left_behind, self.vouched = left_behind, vouched
        return self.result


def sent(delta: list[torch.Tensor], late: list[torch.Tensor] | None = None) -> BufferLease:
    """A round's lease as the driver hands it to the port: in flight, folding ``late`` if given."""
    lease = BufferLease(delta)
    if late is not None:
        lease.fold(LateWork(late, 1.0, 0))
    lease.send()
    return lease


def _port(swarm: ScriptedSwarm) -> tuple[SwarmPort, OuterState]:
    params = [torch.zeros(4)]
    state = OuterState(params, lr=0.7, momentum=0.9, policy=StalenessPolicy(), device="cpu")
    port = SwarmPort(swarm, state, params, [], NO_FAULTS, eager=False)  # type: ignore[arg-type]
    port.view.start()
    return port, state


def test_port_an_inflated_epoch_stalls_nobody_and_moves_no_anchored_peer() -> None:
    swarm = ScriptedSwarm(claims={"me": 3, "a": 3, "b": 3, "liar": 10**6})
    port, _ = _port(swarm)
    assert port.observe(3).swarm_epoch == 10**6  # a peer with no history cannot tell yet
    assert not port.resync(10**6)  # the liar serves nothing acceptable
    assert swarm.downloads == [(10**6, None)]
    assert port.observe(3).swarm_epoch == 3  # one failed try, then the claim stops stalling it
    # After a complete round with a and b, the liar's claims never count, whatever it raises them to.
    swarm.result = RoundResult(Outcome.AVERAGED, "", 3, contributors=("me", "a", "b"),
                                 weights=(1.0, 1.0, 1.0), rejected=())
    port.average(sent([torch.zeros(4)]), 1.0, 0, 3, 0.0)
    # whose records may prove a cut peer alive (core.deadlines) is the evidence's word: a and b now, no liar
    assert swarm.vouched is not None and swarm.vouched("a") and not swarm.vouched("liar")
    swarm.claims["liar2"] = 10**7
    assert port.observe(3).swarm_epoch == 3
    swarm.claims["a"] = 4  # a trusted peer ahead still pulls this one along, checked against trusted peers
    assert port.observe(3).swarm_epoch == 4
    swarm.donor = SimpleNamespace(params=[torch.ones(4)], opt_tensors=[torch.zeros(4)], epoch=4, donor="a", delivered={"a": 1},
                                  params_sha256=params_sha256([torch.ones(4)]),
                                  params_manifest=tensor_manifest([torch.ones(4)]))
    assert port.resync(4)
    assert swarm.downloads[-1] == (4, frozenset({"a", "b"}))


def test_port_times_a_joiners_first_phase_by_how_far_the_swarm_is_into_its_own() -> None:
    def state() -> SimpleNamespace:  # a load takes the downloaded tensors: one state per download
        return SimpleNamespace(params=[torch.ones(4)], opt_tensors=[torch.zeros(4)], epoch=4, donor="a", delivered={"a": 1},
                               params_sha256=params_sha256([torch.ones(4)]),
                               params_manifest=tensor_manifest([torch.ones(4)]))

    swarm = ScriptedSwarm(claims={"me": 0, "a": 4, "b": 4, "old": 3}, donor=[state(), state(), state(), state()],
                          phases={"a": (30.0, 2.0), "b": (28.0, 5.0), "old": (500.0, 1.0), "me": (900.0, 0.0)})
    port, _ = _port(swarm)
    assert port.resync(4)
    # this peer now trusts its donor a alone, 32 s into epoch 4's phase: b, a stranger, is not believed
    assert port.sync.late_start_s == pytest.approx(32.0)
    port.evidence.averaged_with(["a", "b"])  # (a round replaces the download's credit: both must be in it)
    assert port.resync(4)
    # a and b, 32 s and 33 s into the phase; a peer at another epoch and this one do not count
    assert port.sync.late_start_s == pytest.approx(32.5)
    # ages count within [0, PHASE_RECORD_MAX_AGE_S]: a writer's clock cannot put the phase an hour back
    swarm.phases = {"a": (10.0, 3600.0), "b": (10.0, -50.0)}
    assert port.resync(4)
    assert port.sync.late_start_s == pytest.approx((10.0 + PHASE_RECORD_MAX_AGE_S + 10.0) / 2)
    # no peer at the loaded epoch says: the download's own time (here next to nothing)
    swarm.claims = {"me": 0, "old": 3}
    assert port.resync(4)
    assert 0.0 <= port.sync.late_start_s < 5.0


def test_port_keeps_believing_donors_that_served_verified_chunks_of_a_failed_download() -> None:
    # a and b served part of epoch 2's state, then stepped to epoch 3 before the joiner had every chunk
    swarm = ScriptedSwarm(claims={"me": 0, "a": 2, "b": 2, "liar": 50}, moves_on={"a": 3, "b": 3},
                          served_chunks={"a": 2, "b": 2})
    port, _ = _port(swarm)
    assert port.observe(0).swarm_epoch == 50  # a newcomer cannot tell the liar yet
    assert not port.resync(2)
    # the liar, who served nothing, is ignored; a and b still pull this peer to their new epoch at once
    assert port.observe(0).swarm_epoch == 3
    # donors that stopped serving while their records keep the epoch served: forgiven (a record lags its
    # writer's outer step) until MOVED_ON_PASSES failed downloads in a row, then struck
    swarm.served_chunks, swarm.moves_on = {"a": 3, "b": 3}, {}
    for _ in range(MOVED_ON_PASSES - 1):
        assert not port.resync(3)
        assert port.observe(0).swarm_epoch == 3
    assert not port.resync(3)
    assert port.observe(0).swarm_epoch in (None, 0)


def test_port_asks_again_when_the_swarm_stepped_on_during_its_download() -> None:
    stepped = SimpleNamespace(params=[torch.ones(4)], opt_tensors=[torch.zeros(4)], epoch=3, donor="a",
                              delivered={"a": 1}, params_sha256=params_sha256([torch.ones(4)]),
                              params_manifest=tensor_manifest([torch.ones(4)]))
    # a and b stepped from epoch 2 to 3 while the first attempt fetched epoch 2: the second fetches epoch 3
    swarm = ScriptedSwarm(claims={"me": 0, "a": 2, "b": 2}, moves_on={"a": 3, "b": 3}, donor=[None, stepped])
    port, state = _port(swarm)
    assert port.resync(2)
    assert [epoch for epoch, _ in swarm.downloads] == [2, 3] and state.epoch == 3
    # nobody moved on: one attempt only (the same donors would answer the same way)
    swarm.claims, swarm.moves_on, swarm.donor, swarm.downloads = {"me": 3, "a": 4}, {}, [None, stepped], []
    assert not port.resync(4)
    assert len(swarm.downloads) == 1
    # donors that keep stepping on: at most DOWNLOAD_ATTEMPTS tries within one resync
    swarm.donor, swarm.downloads = [None] * 9, []
    epochs = iter(range(5, 50))
    swarm.download = _stepping(swarm, epochs)  # type: ignore[method-assign]
    assert not port.resync(4)
    assert len(swarm.downloads) == DOWNLOAD_ATTEMPTS


def _stepping(swarm: ScriptedSwarm, epochs):  # noqa: ANN001, ANN202
    """A download that fails while every peer steps to the next epoch."""
    plain = ScriptedSwarm.download.__get__(swarm)

    def download(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        epoch = next(epochs)
        swarm.moves_on = {"a": epoch}
        return plain(*args, **kwargs)

    return download


def test_port_gives_a_round_up_when_every_trusted_peer_moved_past_it() -> None:
    swarm = ScriptedSwarm(claims={"me": 3, "a": 3, "b": 3})
    port, _ = _port(swarm)
    swarm.result = RoundResult(Outcome.AVERAGED, "", 3, contributors=("me", "a", "b"),
                                 weights=(1.0, 1.0, 1.0), rejected=())
    port.average(sent([torch.zeros(4)]), 1.0, 0, 3, 0.0)
    assert swarm.left_behind is not None and not swarm.left_behind(False)
    swarm.claims["a"] = 4
    assert not swarm.left_behind(False)  # b still looks for the group of epoch 3
    assert not swarm.left_behind(True) and not swarm.votes_read  # the checksums are read only once all moved on
    swarm.claims["b"] = 5
    assert swarm.left_behind(False)  # the records are read again on each ask
    # within the window, a record ahead is not enough (an eager peer's may be): each must have finished epoch 3,
    # as its checksum of epoch 4 shows
    swarm.votes = {"a": "d"}
    assert not swarm.left_behind(True) and swarm.votes_read == [4]
    swarm.votes = {"a": "d", "b": "d"}
    assert swarm.left_behind(True)


def test_port_checksum_vote_counts_groupmates_not_sybils() -> None:
    swarm = ScriptedSwarm(claims={"me": 2, "a": 2})
    port, state = _port(swarm)
    mine = state_sha256(state.anchors, [torch.zeros(4)])
    swarm.votes = {s: "f" * 64 for s in SYBILS} | {"me": mine}
    assert not port.in_minority(2)
    swarm.result = RoundResult(Outcome.AVERAGED, "", 2, contributors=("me", "a"), weights=(1.0, 1.0),
                                 rejected=())
    port.average(sent([torch.zeros(4)]), 1.0, 0, 2, 0.0)
    swarm.votes["a"] = "1" * 64
    assert port.in_minority(2)  # the one peer it averaged with holds other parameters: it drifted
    swarm.votes["a"] = mine
    assert not port.in_minority(2)


def test_port_never_claims_more_than_max_round_weight() -> None:
    swarm = ScriptedSwarm(result=RoundResult(Outcome.SKIPPED, "alone", 0))
    port, _ = _port(swarm)
    port.average(sent([torch.zeros(4)], [torch.zeros(4)]), 1e6, 1, 0, 250.0)  # e.g. work carried over many rounds
    port.average(sent([torch.zeros(4)]), 40.0, 0, 0, 0.0)
    assert swarm.averaged == [(100.0, 100.0), (40.0, 0.0)]


def test_port_dylu_compares_only_trusted_speeds() -> None:
    swarm = ScriptedSwarm(claims={"me": 0, "a": 0, "liar": 0}, speeds={"me": 2.0, "a": 3.0, "liar": 1e12})
    port, _ = _port(swarm)
    assert port.view.trusted_speeds() == []  # a claimed 10^12 steps/s would have cut everybody to min_local_steps
    port.evidence.averaged_with(["a"])
    assert port.view.trusted_speeds() == [("a", 3.0)]


def _swarm_states() -> tuple[OuterState, list[torch.Tensor], SimpleNamespace]:
    """The swarm's outer state at epoch 3 (after real outer steps), and the round update that takes it to 4."""
    truth = OuterState([torch.zeros(4)], lr=0.7, momentum=0.9, policy=StalenessPolicy(), device="cpu")
    for k in range(3):
        truth.apply(aggregate_round([Contribution([torch.full((4,), 0.1 * (k + 1))], 1.0, 0, "a")]))
    update = [torch.tensor([0.3, -0.2, 0.0, 1e-3])]
    return truth, update, SimpleNamespace()


def _download_of(truth: OuterState, donor: str) -> SimpleNamespace:
    params = [a.clone() for a in truth.anchors]
    momentum = [m.clone() for m in truth.outer.momentum_buffers()]
    manifest = tensor_manifest(params)
    return SimpleNamespace(params=params, opt_tensors=momentum, epoch=truth.epoch, donor=donor, delivered={donor: 1},
                           state_sha256=state_sha256(params, momentum), params_manifest=manifest,
                           params_sha256=manifest.sha)


def test_a_joiner_one_round_behind_applies_the_missed_round_and_takes_part_in_the_next() -> None:
    truth, fresh, _ = _swarm_states()
    download = _download_of(truth, "a")
    base = (download.state_sha256, 3)
    truth.apply(aggregate_round([Contribution(fresh, 1.0, 0, "a")]))  # the round the joiner misses
    swarm_sha = state_sha256(truth.anchors, truth.outer.momentum_buffers())
    # the download was of epoch 3; while it ran, the swarm reached epoch 4 and voted its digest
    swarm = ScriptedSwarm(claims={"a": 3, "b": 3}, moves_on={"a": 4, "b": 4}, donor=download,
                          votes={"a": swarm_sha, "b": swarm_sha},
                          update=SimpleNamespace(base=base, fresh=fresh, stale=None, result_sha=swarm_sha,
                                                 donor="a", sources=("a", "b"), delivered={"a": 1}, vouching="a"))
    port, state = _port(swarm)
    assert port.resync(3)
    assert len(swarm.downloads) == 1  # one download, then the update: not a second download
    assert state.epoch == 4 and port.serving.state_digest() == swarm_sha  # bitwise the swarm's state
    assert port.observe(4).swarm_epoch == 4  # not behind: the round policy averages, it does not resync
    swarm.result = RoundResult(Outcome.AVERAGED, "", 4, contributors=("me", "a", "b"),
                                 weights=(1.0, 1.0, 1.0), rejected=())
    port.average(sent([torch.ones(4)]), 1.0, 0, 4, 0.0)
    assert swarm.averaged == [(1.0, 0.0)]  # it contributed to the round right after its download


def test_an_update_that_does_not_lead_to_the_voted_state_is_dropped_for_a_second_download() -> None:
    truth, fresh, _ = _swarm_states()
    download = _download_of(truth, "a")
    base = (download.state_sha256, 3)
    truth.apply(aggregate_round([Contribution(fresh, 1.0, 0, "a")]))
    swarm_sha = state_sha256(truth.anchors, truth.outer.momentum_buffers())
    newest = _download_of(truth, "b")
    lying = SimpleNamespace(base=base, fresh=[t + 1.0 for t in fresh], stale=None, result_sha=swarm_sha,
                            donor="a", sources=("a",), delivered={"a": 1}, vouching="a")
    swarm = ScriptedSwarm(claims={"a": 3, "b": 3}, moves_on={"a": 4, "b": 4}, donor=[download, newest],
                          votes={"a": swarm_sha, "b": swarm_sha}, update=lying)
    port, state = _port(swarm)
    assert port.resync(3)
    assert [m for m, _ in swarm.downloads] == [3, 4]  # the stepped result failed its check: downloaded again
    assert state.epoch == 4 and port.serving.state_digest() == swarm_sha


def test_a_peer_one_round_behind_with_the_swarms_state_applies_the_update_to_its_own() -> None:
    truth, fresh, _ = _swarm_states()
    download = _download_of(truth, "a")
    swarm = ScriptedSwarm(claims={"a": 3, "b": 3}, donor=download)
    port, state = _port(swarm)
    assert port.resync(3)  # loaded epoch 3 while the swarm averaged it, and then missed that round's group
    truth.apply(aggregate_round([Contribution(fresh, 1.0, 0, "a")]))
    swarm_sha = state_sha256(truth.anchors, truth.outer.momentum_buffers())
    swarm.claims, swarm.votes = {"a": 4, "b": 4}, {"a": swarm_sha, "b": swarm_sha}
    swarm.update = SimpleNamespace(base=(download.state_sha256, 3), fresh=[t.clone() for t in fresh], stale=None,
                                   result_sha=swarm_sha, donor="a", sources=("a", "b"), delivered={"a": 1}, vouching="a")
    assert port.resync(4)
    assert len(swarm.downloads) == 1  # the update only (half a state or less), not a second whole state
    assert state.epoch == 4 and port.serving.state_digest() == swarm_sha  # bitwise the swarm's state
    assert torch.equal(port.params[0], state.anchors[0])  # and the model starts the round from it
    # an update that does not lead to the voted state: the live state changed, so the whole state is downloaded
    truth.apply(aggregate_round([Contribution(fresh, 1.0, 0, "a")]))
    newest = _download_of(truth, "b")
    newest_sha = state_sha256(truth.anchors, truth.outer.momentum_buffers())
    swarm.claims, swarm.votes, swarm.donor = {"a": 5, "b": 5}, {"a": newest_sha, "b": newest_sha}, newest
    swarm.update = SimpleNamespace(base=(swarm_sha, 4), fresh=[t + 1.0 for t in fresh], stale=None,
                                   result_sha=newest_sha, donor="a", sources=("a",), delivered={"a": 1}, vouching="a")
    assert port.resync(5)
    assert [m for m, _ in swarm.downloads] == [3, 5]
    assert state.epoch == 5 and port.serving.state_digest() == newest_sha


def test_only_an_identity_that_delivered_verified_bytes_is_credited_and_only_without_trusted_evidence() -> None:
    # accepted on trusted evidence (a trusted donor, or a digest trusted voters published): a relay earns nothing
    assert credited({"relay": 3, "a": 1}, frozenset({"a"})) is None
    assert credited({"relay": 3}, frozenset()) is None
    # a newcomer (nobody trusted visible): the identity that delivered the most verified chunks, never one with none
    assert credited({"listed-first": 0, "a": 2, "b": 5}, None) == "b"
    assert credited({"x": 2, "a": 2}, None) == "a"  # ties: the smallest id, whatever the order
    assert credited({"listed-first": 0}, None) is None and credited({}, None) is None
    ev = Evidence("me", trusted=["t"])
    assert ev.loaded({"relay": 4}, ev.trusted_or_none(["t", "relay"])) is None and not ev.trusts("relay")
    newcomer = Evidence("me")
    assert newcomer.loaded({"relay": 0, "a": 1}, newcomer.trusted_or_none(["a", "relay"])) == "a"
    assert newcomer.trusts("a") and not newcomer.trusts("relay")


def _one_round_behind(update_of: object) -> tuple[SwarmPort, OuterState, ScriptedSwarm, str, list[torch.Tensor]]:
    """A peer at epoch 3 with the swarm's own state that missed the round to 4; ``update_of(fresh, swarm_sha)``
    makes the update it is served. Returns the port, its state, the swarm, the swarm's digest of epoch 4 and
    the live anchors' values before the catch-up."""
    truth, fresh, _ = _swarm_states()
    download = _download_of(truth, "a")
    swarm = ScriptedSwarm(claims={"a": 3, "b": 3}, donor=download)
    port, state = _port(swarm)
    assert port.resync(3)
    port.evidence.averaged_with(["a", "b"])  # it averaged with a and b before: anchored
    truth.apply(aggregate_round([Contribution(fresh, 1.0, 0, "a")]))
    swarm_sha = state_sha256(truth.anchors, truth.outer.momentum_buffers())
    swarm.claims, swarm.votes = {"a": 4, "b": 4, "relay": 4}, {"a": swarm_sha, "b": swarm_sha}
    swarm.update = update_of(download.state_sha256, fresh, swarm_sha)
    swarm.donor = None  # and the fallback download fails
    return port, state, swarm, swarm_sha, [a.clone() for a in state.anchors]


def test_a_relay_listed_first_is_never_trusted_for_an_update_trusted_votes_accepted() -> None:
    def relayed(base: str, fresh: list[torch.Tensor], sha: str) -> SimpleNamespace:
        return SimpleNamespace(base=(base, 3), fresh=[t.clone() for t in fresh], stale=None, result_sha=sha,
                               donor="relay", sources=("relay", "a"), delivered={"relay": 2, "a": 1},
                               vouching="a")

    port, state, swarm, swarm_sha, _ = _one_round_behind(relayed)
    assert port.resync(4) and state.epoch == 4 and port.serving.state_digest() == swarm_sha
    assert not port.evidence.trusts("relay")  # it relayed the honest bytes: that proves nothing of its own
    swarm.claims["relay"] = 1004  # ... so its claim of a future epoch moves nobody
    assert port.observe(4).swarm_epoch == 4


@pytest.mark.parametrize("poison", ["wrong", "huge", "inf"])
def test_a_poisoned_update_changes_nothing_live_even_when_the_fallback_download_fails(poison: str) -> None:
    values = {"wrong": 1.0, "huge": 3e38, "inf": float("-inf")}[poison]

    def poisoned(base: str, fresh: list[torch.Tensor], sha: str) -> SimpleNamespace:
        bad = [t + values for t in fresh] if poison == "wrong" else [torch.full_like(t, values) for t in fresh]
        return SimpleNamespace(base=(base, 3), fresh=bad, stale=None, result_sha=sha, donor="a", sources=("a",),
                               delivered={"a": 1}, vouching="a")

    port, state, swarm, _, before = _one_round_behind(poisoned)
    momentum = [m.clone() for m in state.outer.momentum_buffers()]
    digest = port.serving.state_digest()
    assert not port.resync(4)  # the update failed its check, and no donor served a whole state either
    assert [m for m, _ in swarm.downloads][-1] == 4  # it tried the download
    assert state.epoch == 3 and port.serving.state_digest() == digest  # its last verified state, served as such
    assert all(torch.equal(a, b) for a, b in zip(state.anchors, before, strict=True))
    assert all(torch.equal(m, b) for m, b in zip(state.outer.momentum_buffers(), momentum, strict=True))
    assert torch.equal(port.params[0], before[0])


def test_an_update_without_terms_or_with_absurd_values_is_refused() -> None:
    from hivemind.utils.serializer import MSGPackSerializer

    from p2p_diloco.core.chunks import CHUNK_BYTES
    from p2p_diloco.swarm.catchup import check_update_metadata, implausible
    from p2p_diloco.swarm.checksum import combine_state_sha, manifest_sha
    from p2p_diloco.swarm.state import STATE_VERSION

    layout = [(torch.float32, (4,))]
    empty = combine_state_sha(manifest_sha([], 0, b""), manifest_sha([], 0, b""))
    meta = {"v": STATE_VERSION, "run": "r", "fp": "f", "ep": 3, "sha": empty, "np": 0, "no": 0,
            "cs": CHUNK_BYTES, "pc": b"", "mc": b"", "base": "0" * 64, "to": "1" * 64}
    assert "no terms" in check_update_metadata(MSGPackSerializer.dumps(meta), "r", "f", layout, "0" * 64, 3)
    assert implausible([torch.ones(4)]) is None
    assert "beyond" in implausible([torch.tensor([0.0, 3e38])])
    assert "NaN or infinite" in implausible([torch.tensor([float("-inf")])])


def test_after_a_missed_round_the_first_phase_is_floored_by_the_updates_fetch_time(monkeypatch) -> None:  # noqa: ANN001
    """The donors served the update from their step on: its fetch time is a floor on how far the swarm is into
    its phase. A believed record of ``phase_s`` 0 made a joiner plan the full H and arrive late."""
    clock = Clock()
    monkeypatch.setattr("p2p_diloco.core.sync.time", SimpleNamespace(monotonic=clock))
    truth, fresh, _ = _swarm_states()
    download = _download_of(truth, "a")
    base = (download.state_sha256, 3)
    truth.apply(aggregate_round([Contribution(fresh, 1.0, 0, "a")]))
    swarm_sha = state_sha256(truth.anchors, truth.outer.momentum_buffers())

    class SlowUpdate(ScriptedSwarm):
        def download_update(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            clock.now += 7.0
            return super().download_update(*args, **kwargs)

    swarm = SlowUpdate(claims={"a": 3, "b": 3}, moves_on={"a": 4, "b": 4}, donor=download,
                       votes={"a": swarm_sha, "b": swarm_sha}, phases={"a": (0.0, 0.0), "b": (0.0, 0.0)},
                       update=SimpleNamespace(base=base, fresh=fresh, stale=None, result_sha=swarm_sha, donor="a",
                                              sources=("a", "b"), delivered={"a": 1}, vouching="a"))
    port, state = _port(swarm)
    assert port.resync(3) and state.epoch == 4
    assert port.sync.late_start_s == pytest.approx(7.0)  # the records say 0 s into epoch 4's phase; the fetch, 7


def test_a_donor_credited_by_a_newcomer_is_trusted_only_until_its_first_round() -> None:
    """A newcomer that trusted nobody credits the donor that delivered most of its state: it may be a relay of
    the honest bytes. Kept for good (before), the relay's later claim of a future epoch was believed and it was
    a trusted donor for the state it then served; now the newcomer's groupmates replace it once it averaged."""
    newcomer = Evidence("me")
    assert newcomer.loaded({"relay": 6, "a": 2}, newcomer.trusted_or_none(["a", "b", "relay"])) == "relay"
    sybils = [Claim(s, 10**6) for s in SYBILS]
    # between its download and its first round the credit anchors it: Sybil epochs change nothing
    assert newcomer.trusts("relay") and newcomer.swarm_epoch([Claim("relay", 7), Claim("a", 7), *sybils]) == 7
    newcomer.averaged_with(["me", "a", "b"])
    assert not newcomer.trusts("relay") and newcomer.trusted == frozenset({"a", "b"})
    claims = [Claim("a", 8), Claim("b", 8), Claim("relay", 1008)]
    assert newcomer.swarm_epoch(claims) == 8  # the relay's claim of a future epoch is not believed
    assert newcomer.trusted_or_none(c.peer_id for c in claims) == frozenset({"a", "b"})
    assert state_verdict("relay", "forged", {}, newcomer.trusted) is not None  # nor is it a trusted donor
    # a solo round (no other contributor) replaces nobody; a donor that then averaged with it is vouched for
    lone = Evidence("me")
    lone.loaded({"p": 3}, None)
    lone.averaged_with(["me"])
    assert lone.trusts("p")
    lone.averaged_with(["me", "p"])
    assert lone.trusts("p") and "p" in lone.vouched and not lone.adopted


def test_a_failed_re_download_after_a_failed_catch_up_check_leaves_the_peer_on_its_own_state() -> None:
    """The download path: a state of epoch 3 arrives while the swarm is at 4, the missed round's update fails
    its check (it does not lead to the voted state) and the second download fails too. The peer keeps and
    serves the state it had before, never the downloaded nor the stepped tensors."""
    truth, fresh, _ = _swarm_states()
    download = _download_of(truth, "a")
    base = (download.state_sha256, 3)
    truth.apply(aggregate_round([Contribution(fresh, 1.0, 0, "a")]))
    swarm_sha = state_sha256(truth.anchors, truth.outer.momentum_buffers())
    lying = SimpleNamespace(base=base, fresh=[t + 1.0 for t in fresh], stale=None, result_sha=swarm_sha,
                            donor="a", sources=("a",), delivered={"a": 1}, vouching="a")
    swarm = ScriptedSwarm(claims={"a": 3, "b": 3}, moves_on={"a": 4, "b": 4}, donor=[download, None],
                          votes={"a": swarm_sha, "b": swarm_sha}, update=lying)
    port, state = _port(swarm)
    before = [a.clone() for a in state.anchors]
    served_before = port.serving.state_digest()
    assert not port.resync(3)
    assert [m for m, _ in swarm.downloads] == [3, 4]  # the stepped result failed its check, then no download
    assert state.epoch == 0 and all(torch.equal(a, b) for a, b in zip(state.anchors, before, strict=True))
    assert port.serving.state_digest() == served_before and port.serving.state_digest() != swarm_sha


def test_port_leases_the_averagers_shared_buffers_and_withdraws_the_served_update_around_them() -> None:
    swarm = ScriptedSwarm(claims={"me": 0}, buffers=[torch.zeros(4)])
    port, _ = _port(swarm)
    lease = port.lease()
    # the last round's update lives in these buffers whichever buffers its delta was written to: withdrawn first
    assert lease is not None and lease.shared and swarm.withdrawn_updates == 1
    assert lease.delta()[0].data_ptr() == swarm.buffers[0].data_ptr()  # no copy on the way to the all-reduce
    lease.release()
    assert swarm.withdrawn_updates == 2 and lease.state is LeaseState.RELEASED
    swarm.buffers = None  # a round whose host side gave up still holds them: the driver's own buffers then
    assert port.lease() is None
    port.eager = True  # the overlap copies into the buffers itself
    swarm.buffers = [torch.zeros(4)]
    assert port.lease() is None


def test_port_a_resync_to_the_epoch_it_voted_for_replaces_its_vote_and_no_other_load_votes() -> None:
    # A peer that published the checksum of epoch 4, then found itself outvoted and loaded the majority's state
    # of epoch 4, no longer holds what it voted for: peers that trust it must see the state it holds (a mixed
    # NAT run: the stale vote kept a peer that trusted only this one off the majority's state for good).
    swarm = ScriptedSwarm(claims={"me": 4, "a": 4, "b": 4})
    port, state = _port(swarm)
    state.epoch = 4
    port.published(4)
    assert swarm.served == [(4, True)]

    def donor(epoch: int) -> SimpleNamespace:
        return SimpleNamespace(params=[torch.ones(4)], opt_tensors=[torch.zeros(4)], epoch=epoch, donor="a",
                               delivered={"a": 1}, params_sha256=params_sha256([torch.ones(4)]),
                               params_manifest=tensor_manifest([torch.ones(4)]))

    swarm.donor = donor(4)
    assert port.resync(4) and state.epoch == 4
    assert swarm.served[-1] == (4, True)  # the vote now names the state it holds
    swarm.donor, swarm.claims = donor(6), {"me": 4, "a": 6, "b": 6}
    assert port.resync(6) and state.epoch == 6
    assert swarm.served[-1] == (6, False)  # a state of an epoch it never voted for gets no vote
