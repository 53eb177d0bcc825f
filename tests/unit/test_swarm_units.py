"""Network-free parts of the swarm layer: config validation, checksums, group planning, epoch rule."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer
from swarm_helpers.harness import SHARED_MEMORY_KEEPALIVE

from p2p_diloco.swarm import SwarmConfig, global_epoch, layout_fingerprint, params_sha256
from p2p_diloco.swarm.group import MemberInfo, decode_gather, encode_gather, plan_group
from p2p_diloco.swarm.patience import JoinTiming
from p2p_diloco.swarm.quorum import due_peers
from p2p_diloco.swarm.records import PeerProgress

assert SHARED_MEMORY_KEEPALIVE.is_shared()

PEERS = [PeerID.from_base58(f"12D3KooWPWyjpgDrvDMn46Chm4HXcF9StX9GF64BXSL17zVSUBP{c}") for c in "ABCDEF"]


# ------------------------------------------------------------------ config


def test_default_and_loopback_configs_are_valid() -> None:
    SwarmConfig()
    cfg = SwarmConfig.for_loopback(initial_peers=[f"/ip4/127.0.0.1/tcp/5/p2p/{PEERS[0].to_base58()}"])
    assert cfg.host_maddrs == ["/ip4/127.0.0.1/tcp/0"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(initial_peers=["garbage"]), r"initial_peers\[0\].*/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW"),
        (dict(initial_peers=["/ip4/1.2.3.4/tcp/31337"]), r"initial_peers\[0\].*no /p2p/"),
        (
            dict(initial_peers=["/ip4/1.2.3.4/tcp/31337/p2p/notapeer"]),
            r"initial_peers\[0\].*cannot parse.*notapeer",
        ),
        (dict(host_maddrs=["/ip4/1.2.3.4/tcp/x"]), r"host_maddrs\[0\]"),
        (dict(host_maddrs=[]), "host_maddrs must hold at least one"),
        (dict(announce_maddrs=["/ip4/1.2.3.4/tcp/0"]), r"announce_maddrs\[0\].*explicit port"),
        (dict(run_id="a.b"), "run_id"),
        (dict(target_group_size=1), r"target_group_size must be within \[2, 1024\]"),
        (dict(target_group_size=4, min_group_size=8), "min_group_size .* must not exceed target_group_size"),
        (dict(min_group_size=True), "min_group_size must be an integer"),
        (dict(matchmaking_time_s=float("nan")), "matchmaking_time_s must be within"),
        (dict(matchmaking_timeout_s=10.0, matchmaking_time_s=15.0), "matchmaking_timeout_s .* must exceed"),
        (dict(request_timeout_s=20.0), "request_timeout_s .* must be below matchmaking_time_s"),
        (dict(next_chunk_timeout_s=400.0), "next_chunk_timeout_s .* below half of allreduce_timeout_s"),
        (dict(part_size_bytes=10), "part_size_bytes must be within"),
        (dict(identity_path=""), "identity_path"),
        (dict(nat_port_map="yes"), "nat_port_map"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SwarmConfig(**overrides)


# --------------------------------------------------------------- checksums


def test_params_sha256_covers_values_dtype_shape_and_order() -> None:
    a = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(2)]
    base = params_sha256(a)
    assert base == params_sha256([t.clone() for t in a])
    assert base == params_sha256([a[0].t().contiguous().t(), a[1]])  # strides do not matter
    assert base != params_sha256([a[0].reshape(3, 2), a[1]])
    assert base != params_sha256([a[0].double(), a[1]])
    assert base != params_sha256([a[1], a[0]])
    assert base != params_sha256([a[0], a[1], torch.zeros(0)])
    changed = a[0].clone()
    changed[1, 2] = torch.nextafter(changed[1, 2], torch.tensor(100.0))
    assert base != params_sha256([changed, a[1]])
    assert len(params_sha256([torch.ones(3, dtype=torch.bfloat16)])) == 64


def test_params_sha256_is_stable_across_processes() -> None:
    code = (
        "import torch; from p2p_diloco.swarm.checksum import params_sha256;"
        "print(params_sha256([torch.arange(10, dtype=torch.float32) / 3, torch.ones(2, 2, dtype=torch.bfloat16)]))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    here = params_sha256([torch.arange(10, dtype=torch.float32) / 3, torch.ones(2, 2, dtype=torch.bfloat16)])
    assert other.stdout.strip() == here


def test_layout_fingerprint_ignores_values_but_not_layout() -> None:
    a = [torch.zeros(2, 3), torch.zeros(4)]
    assert layout_fingerprint(a) == layout_fingerprint([torch.ones(2, 3), torch.ones(4)])
    assert layout_fingerprint(a) != layout_fingerprint([torch.zeros(3, 2), torch.zeros(4)])
    assert layout_fingerprint(a) != layout_fingerprint(a, extra="llama-150m")
    assert len(layout_fingerprint(a)) == 16


# ------------------------------------------------------------ group planning


def _info(weight: float = 0.0, stale_weight: float = 0.0, **overrides: object) -> MemberInfo:
    values = dict(
        run_id="run",
        fingerprint="abcdef0123456789",
        epoch=3,
        weight=weight,
        stale_weight=stale_weight,
        staleness=2 if stale_weight else 0,
        has_fresh=weight > 0,
        has_stale=stale_weight > 0,
        norm=weight,
        stale_norm=stale_weight,
    )
    values.update(overrides)
    return MemberInfo(**values)  # type: ignore[arg-type]


def test_prescaled_plain_mean_equals_the_normalised_aggregates() -> None:
    infos = [_info(1.0), _info(3.0, 0.5), _info(0.0, 1.5), _info(2.0)]
    gathered = [encode_gather(None, AveragingMode.NODE, info) for info in infos]
    plan = plan_group(PEERS[:4], gathered, PEERS[0], min_group_size=2)
    assert plan.skip_reason is None and plan.with_stale and plan.fresh_weight_total == 6.0
    torch.manual_seed(0)
    fresh = [torch.randn(5, dtype=torch.float64) for _ in infos]
    stale = [torch.randn(5, dtype=torch.float64) for _ in infos]
    scaled_fresh, scaled_stale = [], []
    for peer, f, s in zip(PEERS[:4], fresh, stale, strict=True):
        fresh_scale, stale_scale = plan.local_scales(peer)
        scaled_fresh.append(f * fresh_scale)
        scaled_stale.append(s * stale_scale)
    # what hivemind's all-reduce computes with weight 1 for every member: a plain mean
    mean_fresh = sum(scaled_fresh) / 4
    mean_stale = sum(scaled_stale) / 4
    expected_fresh = (1.0 * fresh[0] + 3.0 * fresh[1] + 2.0 * fresh[3]) / 6.0
    expected_stale = (0.5 * stale[1] + 1.5 * stale[2]) / 6.0
    torch.testing.assert_close(mean_fresh, expected_fresh)
    torch.testing.assert_close(mean_stale, expected_stale)


def test_plan_refuses_other_runs_models_epochs_and_garbage() -> None:
    infos = [
        _info(1.0),
        _info(1.0, fingerprint="0123456789abcdef"),
        _info(1.0, run_id="other"),
        _info(1.0, epoch=4),
        _info(2.0),
    ]
    gathered = [encode_gather(None, AveragingMode.NODE, info) for info in infos] + [b"\x93\x01"]
    plan = plan_group(PEERS[:6], gathered, PEERS[0], min_group_size=2)
    assert plan.peer_ids == (PEERS[0], PEERS[4])
    reasons = dict(plan.refused)
    assert "fingerprint" in reasons[PEERS[1].to_base58()]
    assert "run id" in reasons[PEERS[2].to_base58()]
    assert "epoch" in reasons[PEERS[3].to_base58()]
    assert "malformed" in reasons[PEERS[5].to_base58()]
    # the refused peer, planning from its own point of view, ends up alone
    lonely = plan_group(PEERS[:6], gathered, PEERS[1], min_group_size=2)
    assert lonely.peer_ids == (PEERS[1],) and "fewer than min_group_size" in lonely.skip_reason


def test_plan_skips_groups_without_fresh_work_or_reducers() -> None:
    stale_only = [encode_gather(None, AveragingMode.NODE, _info(0.0, 1.0)) for _ in range(2)]
    assert "fresh work" in plan_group(PEERS[:2], stale_only, PEERS[0], min_group_size=2).skip_reason
    clients = [encode_gather(0.0, AveragingMode.CLIENT, _info(1.0)) for _ in range(2)]
    assert "client" in plan_group(PEERS[:2], clients, PEERS[0], min_group_size=2).skip_reason
    fresh = [encode_gather(None, AveragingMode.NODE, _info(1.0)) for _ in range(2)]
    assert plan_group(PEERS[:2], fresh, PEERS[0], min_group_size=2).with_stale is False


@pytest.mark.parametrize(
    "mutation",
    [
        dict(w=float("nan")),
        dict(w=float("inf")),
        dict(w=-1.0),
        dict(w=1),  # an int where a float is expected
        dict(ep=-1),
        dict(ep=True),
        dict(st=10**9),
        dict(fp="XYZ"),
        dict(run="a" * 100),
        dict(f=1),
        dict(f=False),  # weight > 0 but claims no fresh work
        dict(v=1),  # the version before announced norms
        dict(n=float("inf")),
        dict(n=-0.5),
        dict(sn=1.0),  # a norm for stale work it does not carry
        dict(extra=1),
    ],
)
def test_member_metadata_validation(mutation: dict) -> None:
    wire = _info(1.0).to_wire()
    wire.update(mutation)
    raw = MSGPackSerializer.dumps([None, AveragingMode.NODE.value, MSGPackSerializer.dumps(wire)])
    with pytest.raises(ValueError):
        decode_gather(raw)


def test_gather_envelope_validation() -> None:
    good = MSGPackSerializer.dumps(_info(1.0).to_wire())
    assert decode_gather(MSGPackSerializer.dumps([12.5, 0, good]))[0] == 12.5
    for envelope in ([float("nan"), 0, good], [None, 2, good], [None, 0, "text"], [None, 0], "x"):
        with pytest.raises(ValueError):
            decode_gather(MSGPackSerializer.dumps(envelope))
    with pytest.raises(ValueError):
        decode_gather(b"\xc1")  # not msgpack
    with pytest.raises(ValueError):
        decode_gather(b"\x90" * 5000)  # oversized


# --------------------------------------------------------------- epoch rule


def _progress(epoch: int, client: bool = False, fingerprint: str = "abcdef0123456789") -> PeerProgress:
    return PeerProgress("peer", epoch, 0, 1.0, 1.0, 1.0, fingerprint, 0.0, client, math.inf)


def test_due_peers_are_those_within_one_epoch_of_the_round_clients_included() -> None:
    records = [dataclasses.replace(_progress(epoch, client=client), peer_id=name)
               for name, epoch, client in [("behind", 3, False), ("training", 4, False), ("stepped", 5, True),
                                           ("gone", 2, False), ("ahead", 6, False)]]
    assert due_peers(records, 4) == {"behind", "training", "stepped"}
    assert due_peers([], 4) == frozenset()


def test_global_epoch_is_the_max_of_non_client_peers_with_optional_quorum() -> None:
    records = [
        _progress(3),
        _progress(5),
        _progress(4),
        _progress(9, client=True),
        _progress(7, fingerprint="0" * 16),
    ]
    assert global_epoch(records, fingerprint="abcdef0123456789") == 5
    assert global_epoch(records) == 7
    assert global_epoch(records, min_peers=2, fingerprint="abcdef0123456789") == 4
    assert global_epoch(records, min_peers=4, fingerprint="abcdef0123456789") is None
    assert global_epoch([]) is None
    with pytest.raises(ValueError):
        global_epoch(records, min_peers=0)


def test_member_info_for_round_validates_and_marks_absent_work() -> None:
    norms = dict(norm=0.5, stale_norm=0.25)
    info = MemberInfo.for_round("run", "abcdef0123456789", 3, 2.0, 0.0, 5, True, True, **norms)
    assert info.has_fresh and not info.has_stale and info.staleness == 0  # zero stale weight: no stale work
    assert info.norm == 0.5 and info.stale_norm == 0.0
    assert MemberInfo.from_wire(info.to_wire()) == info
    info = MemberInfo.for_round("run", "abcdef0123456789", 3, 2.0, 1.0, 5, False, True, **norms)
    assert not info.has_fresh and info.weight == 0.0 and info.has_stale and info.staleness == 5
    assert info.norm == 0.0 and info.stale_norm == 0.25
    with pytest.raises(ValueError, match="absent"):
        MemberInfo.from_wire(info.to_wire() | {"n": 1.0})
    for bad in (
        dict(weight=float("nan")),
        dict(weight=-1.0),
        dict(stale_weight=float("inf")),
        dict(staleness=-1),
        dict(epoch=1.5),
        dict(epoch=True),
        dict(norm=float("nan")),
        dict(stale_norm=-1.0),
        dict(norm=1e31),
    ):
        args = dict(weight=1.0, stale_weight=0.0, staleness=0, epoch=0, norm=1.0, stale_norm=0.0) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            MemberInfo.for_round("run", "abcdef0123456789", carries_fresh=True, carries_stale=False, **args)


# ------------------------------------------------------------------ matchmaking patience


def test_leaders_see_the_followers_own_expiration_and_turn_away_requests_they_answer_too_late() -> None:
    timing = JoinTiming(request_timeout=1.0)
    assert timing.patience == 2.0
    request = averaging_pb2.JoinRequest(expiration=100.0, gather=b"meta", schema_hash=b"s")
    seen: list[float] = []
    check = timing._in_time(lambda req, ctx: seen.append(req.expiration))
    with timing.leader_view(request) as view:
        # the follower added its patience; the admission check gets the expiration it declared
        assert (view.expiration, view.gather, request.expiration) == (98.0, b"meta", 100.0)
        assert check(view, None) is None and seen == [98.0]
        timing._arrivals[id(view)] -= 0.6  # as if it had waited 0.6 s for the leader's lock
        late = check(view, None)
        assert late.code == averaging_pb2.BAD_EXPIRATION_TIME and seen == [98.0]
    assert not timing._arrivals


def test_a_client_asks_to_join_with_the_end_of_its_search_so_a_leader_a_moment_later_takes_it() -> None:
    from types import SimpleNamespace

    from hivemind.averaging.matchmaking import Matchmaking

    window, floor, now = 8.0, 3.0, 1000.0  # adaptive deadlines: the window grew, hivemind's minimum is the floor
    timing = JoinTiming(1.0)  # patience 2 s
    deadline = now + 12.0
    assert timing.scheduled_time(now, window, deadline, client_mode=False) == now + window
    # the end of its search, before its deadline: hivemind warns of a step scheduled at or after it
    assert timing.scheduled_time(now, window, deadline, client_mode=True) == deadline - 2.0 < deadline

    def request_expiration(scheduled: float, at: float) -> float:
        # hivemind's own rule for a peer that never declares (a client), run on the values of such a peer
        me = SimpleNamespace(min_matchmaking_time=floor, step_control=SimpleNamespace(scheduled_time=scheduled),
                             potential_leaders=SimpleNamespace(declared_expiration_time=float("inf"),
                                                               search_end_time=deadline - 2.0))
        with mock.patch("hivemind.averaging.matchmaking.get_dht_time", return_value=at):
            return Matchmaking.get_request_expiration_time(me)

    leader_declared = now + 0.05 + window  # the only full peer started its round 50 ms after the client
    # with the end of its first window, the client is turned away (BAD_EXPIRATION_TIME) until the leader's
    # window ends; with the end of its search it is taken at once
    assert request_expiration(now + window, now + 0.06) < leader_declared
    assert request_expiration(timing.scheduled_time(now, window, deadline, True), now + 0.06) >= leader_declared


def test_more_due_peers_than_one_group_holds_is_told_to_the_operator_once_per_50_rounds(
        caplog: pytest.LogCaptureFixture) -> None:
    from p2p_diloco.swarm.facade import Swarm

    swarm = Swarm(dataclasses.replace(SwarmConfig.for_loopback(), target_group_size=8), "ab" * 8, [torch.zeros(2)])
    with caplog.at_level("WARNING", logger="p2p_diloco.swarm.facade"):
        swarm._warn_above_target(8, 1)  # one group holds them all
        assert not caplog.records
        for epoch in range(2, 60):
            swarm._warn_above_target(12, epoch)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "--target-group-size on every peer to at least 12" in warnings[0], warnings


class _Control:
    """A ``StepControl`` stand-in for ``round_wait.wait_for_round``: no result yet, a stage, a cancel."""

    def __init__(self, stage, result=None, answer_after: int = 10**9) -> None:  # noqa: ANN001
        self.stage, self._result, self.cancelled, self.asks = stage, result, False, 0
        self._answer_after = answer_after

    def result(self, timeout: float):  # noqa: ANN201
        self.asks += 1
        if self.asks > self._answer_after:
            return self._result
        time.sleep(min(timeout, 0.01))  # waits as the real one does, briefly
        raise TimeoutError

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def answer_now(self) -> None:
        """The averager process answers at the next ask (as it does a ``commands.GiveUp``)."""
        self._answer_after = 0


def test_a_round_is_given_up_only_while_looking_for_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from hivemind.averaging.control import AveragingStage

    from p2p_diloco.core.rounds import Outcome, RoundResult
    from p2p_diloco.swarm import round_wait
    from p2p_diloco.swarm.round_wait import wait_for_round

    monkeypatch.setattr(round_wait, "LEFT_BEHIND_POLL_S", 0.01)

    asked: list[int] = []
    requests: list[int] = []

    def left_behind(window_open: bool) -> bool:
        asked.append(1)
        return len(asked) >= 2  # the swarm moves on between the first and the second ask

    # Left behind: the averager process is asked once to stop its search, and its answer is the round's
    # result; this thread never cancels the step (a group may have formed since it read the stage).
    stopped = RoundResult(Outcome.SKIPPED, "the swarm left epoch 3 before a group formed", 3, left_behind=True)
    looking = _Control(AveragingStage.LOOKING_FOR_GROUP, stopped, answer_after=20)
    assert wait_for_round(looking, 60.0, left_behind, give_up=lambda: requests.append(1)) is stopped  # type: ignore[arg-type]
    assert not looking.cancelled and len(asked) == 2 and requests == [1]
    # The process refused (its group had formed): the group's all-reduce is this round's result.
    asked.clear(), requests.clear()
    formed = RoundResult(Outcome.AVERAGED, "", 3)
    joined = _Control(AveragingStage.LOOKING_FOR_GROUP, formed, answer_after=20)
    assert wait_for_round(joined, 60.0, left_behind, give_up=lambda: requests.append(1)) is formed  # type: ignore[arg-type]
    assert not joined.cancelled and requests == [1]
    # Within the round's window the question says so (a record ahead may be an eager peer still averaging this
    # epoch: only the others' finished round may end the search, Evidence.round_over), and a "no" goes on waiting.
    opens: list[bool] = []
    requests.clear()
    patient = _Control(AveragingStage.LOOKING_FOR_GROUP, RoundResult(Outcome.AVERAGED, "", 3), answer_after=50)
    assert wait_for_round(patient, 60.0, lambda window_open: opens.append(window_open) or not window_open,  # type: ignore[arg-type]
                          after_s=3600.0, give_up=lambda: requests.append(1)).averaged
    assert not requests and not patient.cancelled
    assert len(opens) >= 10 and all(opens)  # asked every poll_interval, each time with the window open
    # ... and the window's end is asked at once, as closed: a peer left behind gives up then.
    opens.clear(), requests.clear()
    stopped_late = _Control(AveragingStage.LOOKING_FOR_GROUP, stopped, answer_after=10**6)
    monkeypatch.setattr(round_wait, "LEFT_BEHIND_POLL_S", 60.0)  # no poll before the window ends
    # (without the ask at the window's end the next one would fall at the budget's end: TimeoutError)
    assert wait_for_round(stopped_late, 60.0, lambda window_open: opens.append(window_open) or not window_open,  # type: ignore[arg-type]
                               after_s=0.2, give_up=lambda: (requests.append(1), stopped_late.answer_now())
                               ) is stopped
    assert opens == [False] and requests == [1]
    monkeypatch.setattr(round_wait, "LEFT_BEHIND_POLL_S", 0.01)
    # The asks come every quarter of a short window, never faster than MIN_POLL_S, never slower than the cap.
    monkeypatch.setattr(round_wait, "LEFT_BEHIND_POLL_S", 2.0)
    assert round_wait.poll_interval(3.0) == 0.75 and round_wait.poll_interval(0.4) == round_wait.MIN_POLL_S
    assert round_wait.poll_interval(15.0) == 2.0 and round_wait.poll_interval(0.0) == 2.0
    monkeypatch.setattr(round_wait, "LEFT_BEHIND_POLL_S", 0.01)
    # Once the all-reduce runs, the round is never abandoned: it is waited for until its result.
    done = RoundResult(Outcome.AVERAGED, "", 3)
    running = _Control(AveragingStage.RUNNING_ALLREDUCE, done, answer_after=3)
    asked.clear(), requests.clear()
    assert wait_for_round(running, 60.0, lambda window_open: True, give_up=lambda: requests.append(1)) is done  # type: ignore[arg-type]
    assert not running.cancelled and not asked and not requests
    # Without the question, a round waits its whole budget, in one wait.
    alone = _Control(AveragingStage.LOOKING_FOR_GROUP)
    with pytest.raises(TimeoutError):
        wait_for_round(alone, 0.01, None)  # type: ignore[arg-type]
    assert not alone.cancelled


def test_a_give_up_request_only_marks_a_running_search() -> None:
    from p2p_diloco.swarm.round_process import SearchStop

    async def scenario() -> tuple[bool, bool, bool, bool]:
        search = SearchStop()
        idle = search.request()  # between searches: nothing to stop
        running = search.begin()
        asked = search.request()
        search.end()
        return idle, asked, running.is_set(), search.request()

    assert asyncio.run(scenario()) == (False, True, True, False)


def test_only_vouched_peers_records_reach_the_round_as_proof_of_life() -> None:
    # core.deadlines grows the window for a cut peer whose record was written again; identities are free, so
    # only the records of peers the caller vouches for (Evidence.trusts) are passed on
    from types import SimpleNamespace

    from p2p_diloco.swarm.facade import Swarm
    from p2p_diloco.swarm.records import PeerProgress

    swarm = Swarm(SwarmConfig.for_loopback(), "ab" * 8, [torch.zeros(2)])
    calls: list[dict] = []
    swarm.averager = SimpleNamespace(average=lambda *args, **kwargs: calls.append(kwargs))
    seen = [PeerProgress(peer, 3, 0, 1.0, 1.0, 1.0, "ab" * 8, 10.0, False, expires)
            for peer, expires in (("a", 40.0), ("sybil", 41.0))]
    swarm.average([torch.zeros(2)], 1.0, 0, 3, None, 0.0, seen=seen, vouched=lambda peer: peer == "a")
    swarm.average([torch.zeros(2)], 1.0, 0, 3, None, 0.0, seen=seen)
    assert calls[0]["published"] == {"a": 40.0} and calls[0]["due"] == frozenset({"a", "sybil"})
    assert calls[1]["published"] is None
