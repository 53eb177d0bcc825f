"""core.sync: every branch of the catch-up (SyncPolicy's choices, Catchup's checks and loads) on a fake port.

The fake port fetches what a test scripts, hashes with sha256 over the tensors' bytes and records what it was
asked; the swarm's port (peer.sync_port) is covered by test_port_evidence.py, the network by the
integration tests."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from p2p_diloco.core.delayed import Contribution, StalenessPolicy, aggregate_round
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.core.sync import Catchup, Digest, JoinStep, SyncPolicy, SyncStep


def _sha(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in (*params, *momentum):
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _state(epoch: int = 0) -> OuterState:
    """A state at ``epoch`` after real outer steps (momentum non-zero), the same for the same epoch."""
    state = OuterState([torch.zeros(4)], lr=0.7, momentum=0.9, policy=StalenessPolicy(), device="cpu")
    for k in range(epoch):
        state.apply(aggregate_round([Contribution([torch.full((4,), 0.1 * (k + 1))], 1.0, 0, "a")]))
    return state


def _momentum(state: OuterState) -> list[torch.Tensor]:
    return [m if m is not None else torch.zeros_like(a) for m, a in zip(state.outer.momentum_buffers(),
                                                                          state.anchors, strict=True)]


FRESH = [torch.tensor([0.3, -0.2, 0.0, 1e-3])]


def _truth(epoch: int) -> tuple[OuterState, str]:
    """The swarm's state at ``epoch`` and its digest."""
    truth = _state(epoch - 1)
    truth.apply(aggregate_round([Contribution([t.clone() for t in FRESH], 1.0, 0, "a")]))
    return truth, _sha(truth.anchors, _momentum(truth))


@dataclass
class Update:
    fresh: list[torch.Tensor] | None
    stale: list[torch.Tensor] | None
    result_sha: str
    donor: str = "a"
    vouching: str = "a"
    sources: tuple[str, ...] = ("a",)
    delivered: dict[str, int] | None = field(default_factory=lambda: {"a": 1})


@dataclass
class Download:
    params: list[torch.Tensor]
    opt_tensors: list[torch.Tensor]
    epoch: int
    state_sha256: str
    donor: str = "a"
    params_manifest: object = "manifest"
    delivered: dict[str, int] | None = field(default_factory=lambda: {"a": 1})


def _download_of(state: OuterState) -> Download:
    params, momentum = [a.clone() for a in state.anchors], [m.clone() for m in _momentum(state)]
    return Download(params, momentum, state.epoch, _sha(params, momentum))


@dataclass
class FakeSyncPort:
    """Scripted answers; ``calls`` records what was asked, in order."""

    epochs: list[int | None] = field(default_factory=list)
    """What swarm_epoch() answers, one per call (the last one repeats)."""
    updates: list[Update | None] = field(default_factory=list)
    downloads: list[Download | None] = field(default_factory=list)
    votes_by_epoch: dict[int, dict[str, str]] = field(default_factory=dict)
    trust: frozenset[str] | None = None
    calls: list[tuple] = field(default_factory=list)
    watched: OuterState | None = None
    """The live state; what its epoch was at each fetch or download goes into ``calls``."""
    backer: str | None = "b"
    """The donor a download finds serving a state of ``min_epoch`` and stopping midway (``backed``); ``None``:
    no donor served one (nobody is serving it yet)."""

    def swarm_epoch(self) -> int | None:
        self.calls.append(("swarm_epoch",))
        return self.epochs.pop(0) if len(self.epochs) > 1 else (self.epochs[0] if self.epochs else None)

    def trusted(self) -> frozenset[str] | None:
        return self.trust

    def syncing(self, min_epoch: int) -> None:
        self.calls.append(("syncing", min_epoch))

    def resume_serving(self) -> None:
        self.calls.append(("resume_serving",))

    def serve(self, manifest: object) -> None:
        self.calls.append(("serve", manifest))

    def base_digest(self) -> str:
        assert self.watched is not None
        return _sha(self.watched.anchors, _momentum(self.watched))

    def fetch_update(self, params, base_sha, epoch, timeout, trusted):  # noqa: ANN001, ANN201
        self.calls.append(("fetch_update", epoch, self.watched.epoch if self.watched else None))
        return self.updates.pop(0) if self.updates else None

    def download(self, min_epoch, timeout, trusted, backed):  # noqa: ANN001, ANN201
        self.calls.append(("download", min_epoch, self.watched.epoch if self.watched else None))
        if self.backer is not None:
            backed[self.backer] = min_epoch
        return self.downloads.pop(0) if self.downloads else None

    def received(self, ok: bool) -> None:
        self.calls.append(("received", ok))

    def digest(self, params, momentum) -> Digest:  # noqa: ANN001
        problem = None if all(bool(torch.isfinite(t).all()) for t in (*params, *momentum)) else "NaN"
        return Digest(_sha(params, momentum), "stepped manifest", problem)

    def votes(self, epoch: int) -> dict[str, str]:
        return self.votes_by_epoch.get(epoch, {})

    def credit(self, delivered, trusted):  # noqa: ANN001, ANN201
        self.calls.append(("credit", dict(delivered or {})))
        return "a"

    def unbacked(self, min_epoch: int, backed: dict[str, int]) -> dict[str, float]:
        self.calls.append(("unbacked", min_epoch, dict(backed)))
        return {"liar": 60.0}

    def started_late(self, epoch: int, floor_s: float) -> None:
        self.calls.append(("started_late", epoch))


def _catchup(port: FakeSyncPort, epoch: int, *, eager: bool = False) -> tuple[Catchup, OuterState, list[float]]:
    state = _state(epoch)
    params = [torch.full((4,), 9.0)]
    port.watched = state
    slept: list[float] = []
    catchup = Catchup(state, params, SyncPolicy(eager=eager), port, default_timeout_s=60.0, sleep=slept.append)
    return catchup, state, slept


def _names(port: FakeSyncPort) -> list[str]:
    return [c[0] for c in port.calls if c[0] != "swarm_epoch"]


# ---------------------------------------------------------------------- SyncPolicy


def test_policy_chooses_the_cheapest_way() -> None:
    policy = SyncPolicy()
    assert policy.first(3, 4, again=False) is SyncStep.LIVE_UPDATE
    assert policy.first(3, 5, again=False) is SyncStep.DOWNLOAD  # two rounds behind: no update applies
    assert policy.first(3, 4, again=True) is SyncStep.DOWNLOAD  # a second try downloads
    assert SyncPolicy(eager=True).first(3, 4, again=False) is SyncStep.DOWNLOAD  # eager peers serve no update
    assert policy.after_download(4, 5) is SyncStep.STEP_DOWNLOADED
    assert policy.after_download(4, 4) is SyncStep.LOAD
    assert policy.after_download(4, 6) is SyncStep.LOAD  # two rounds on: load, the round policy resyncs later
    assert policy.after_download(4, None) is SyncStep.LOAD
    assert SyncPolicy(eager=True).after_download(4, 5) is SyncStep.LOAD
    assert policy.after_bad_step(again=False) is SyncStep.DOWNLOAD_AGAIN
    assert policy.after_bad_step(again=True) is SyncStep.GIVE_UP


def test_policy_retries_a_download_only_when_the_swarm_stepped_on_and_time_is_left() -> None:
    policy = SyncPolicy()
    assert policy.retry_download(4, 5, 30.0)
    assert not policy.retry_download(4, 4, 30.0)  # the same donors in the same state
    assert not policy.retry_download(None, 5, 30.0) and not policy.retry_download(4, None, 30.0)
    assert not policy.retry_download(4, 5, 0.5)  # no time left
    # donors that stopped serving the state midway moved on before any record said so
    assert policy.retry_download(4, 4, 30.0, donors_stepped_on=True)
    assert policy.retry_download(None, None, 30.0, donors_stepped_on=True)
    assert not policy.retry_download(4, 4, 0.5, donors_stepped_on=True)


def test_policy_at_join_stops_waits_or_retries() -> None:
    policy = SyncPolicy()
    assert policy.after_failed_join(None, 3, 5) is JoinStep.STOP
    assert policy.after_failed_join(3, 3, 5) is JoinStep.STOP  # nobody believed is ahead
    assert policy.after_failed_join(5, 3, 5) is JoinStep.WAIT  # the same claim still believed
    assert policy.after_failed_join(6, 3, 5) is JoinStep.RETRY


# ---------------------------------------------------------------------- Catchup: the live update


def test_live_update_is_applied_to_copies_and_loaded_once_verified() -> None:
    truth, swarm_sha = _truth(4)
    port = FakeSyncPort(epochs=[4], updates=[Update([t.clone() for t in FRESH], None, swarm_sha)],
                        votes_by_epoch={4: {"a": swarm_sha, "b": swarm_sha}})
    catchup, state, _ = _catchup(port, 3)
    assert catchup.run(4)
    assert catchup.last.steps == [SyncStep.LIVE_UPDATE]
    assert state.epoch == 4 and _sha(state.anchors, _momentum(state)) == swarm_sha
    torch.testing.assert_close(catchup.params[0], state.anchors[0])  # the parameters start from the new state
    assert _names(port) == ["syncing", "fetch_update", "credit", "serve", "started_late"]
    assert ("serve", "stepped manifest") in port.calls


def test_a_round_update_vouches_for_nobody_but_a_newcomer_s_download_credits_its_donor() -> None:
    """A peer trusting nobody online (late for the swarm's first round) applies a round's update delivered
    mostly by one identity: nobody is credited, so a relay of the honest swarm's update earns no trust. A
    download loaded on the same terms passes its donors on (``core.evidence``'s newcomer rule decides)."""
    truth, swarm_sha = _truth(4)
    update = Update([t.clone() for t in FRESH], None, swarm_sha, donor="relay", vouching="relay",
                    sources=("relay", "b"), delivered={"relay": 7, "b": 1})
    port = FakeSyncPort(epochs=[4], updates=[update], votes_by_epoch={4: {"relay": swarm_sha}})
    catchup, state, _ = _catchup(port, 3)
    assert catchup.run(4) and catchup.last.steps == [SyncStep.LIVE_UPDATE] and state.epoch == 4
    assert [c for c in port.calls if c[0] == "credit"] == [("credit", {})]

    port = FakeSyncPort(epochs=[4], downloads=[_download_of(truth)])
    catchup, state, _ = _catchup(port, 3)
    assert catchup.run(4) and state.epoch == 4
    assert [c for c in port.calls if c[0] == "credit"] == [("credit", {"a": 1})]


@pytest.mark.parametrize("why", ["claimed another digest", "voted down", "not finite"])
def test_a_live_update_that_fails_a_check_changes_nothing_before_the_download(why: str) -> None:
    truth, swarm_sha = _truth(4)
    fresh = [t.clone() for t in FRESH]
    claimed, votes = swarm_sha, {"a": swarm_sha, "b": swarm_sha}
    if why == "claimed another digest":
        claimed = "0" * 64
    elif why == "voted down":
        fresh = [t + 1.0 for t in fresh]
        claimed = "1" * 64
        votes = {"a": "1" * 64, "b": "2" * 64, "c": "2" * 64}  # the majority voted for another digest
    else:
        fresh = [torch.full((4,), float("nan"))]
    port = FakeSyncPort(epochs=[4], updates=[Update(fresh, None, claimed)], votes_by_epoch={4: votes},
                        downloads=[_download_of(truth)])
    catchup, state, _ = _catchup(port, 3)
    before = [a.clone() for a in state.anchors]
    assert catchup.run(4)  # then the whole state is downloaded
    download = next(c for c in port.calls if c[0] == "download")
    assert download[2] == 3  # the live state was still epoch 3 when the download began
    assert catchup.last.steps == [SyncStep.LIVE_UPDATE, SyncStep.DOWNLOAD, SyncStep.LOAD]
    assert state.epoch == 4 and not torch.equal(state.anchors[0], before[0])
    assert _sha(state.anchors, _momentum(state)) == swarm_sha


def test_no_update_served_means_a_download() -> None:
    truth, _ = _truth(4)
    port = FakeSyncPort(epochs=[4], downloads=[_download_of(truth)])
    catchup, state, _ = _catchup(port, 3)
    assert catchup.run(4) and state.epoch == 4
    assert _names(port) == ["syncing", "fetch_update", "download", "received", "credit", "serve", "started_late"]
    assert ("serve", "manifest") in port.calls  # the download's own manifest: no second hash pass


# ---------------------------------------------------------------------- Catchup: downloads


def test_a_failed_download_keeps_our_state_and_serves_it_again() -> None:
    port = FakeSyncPort(epochs=[7])
    catchup, state, _ = _catchup(port, 3)
    before = state.anchors[0].clone()
    assert not catchup.run(7)
    assert state.epoch == 3 and torch.equal(state.anchors[0], before)
    # donor b stopped serving midway: asked once more (b stopped again, nothing new: no third try)
    assert _names(port) == ["syncing", "download", "download", "received", "unbacked", "resume_serving"]
    assert [c[1] for c in port.calls if c[0] == "download"] == [7, 7]  # a donor's claim raises no epoch
    assert ("unbacked", 7, {"b": 7}) in port.calls  # whose claims of epoch 7 go unbacked
    assert ("received", False) in port.calls


def test_a_download_is_asked_again_while_the_swarm_steps_on_and_at_most_so_often() -> None:
    port = FakeSyncPort(epochs=[7, 8, 8, 9, 9, 10])
    catchup, state, _ = _catchup(port, 3)
    assert not catchup.run(7)
    asked = [c[1] for c in port.calls if c[0] == "download"]
    assert asked == [7, 8, 9]  # each time for the epoch the swarm stepped to, and DOWNLOAD_ATTEMPTS in all
    assert state.epoch == 3


def test_a_download_whose_donors_stepped_on_before_any_record_said_so_is_asked_again_and_loaded() -> None:
    truth, _ = _truth(7)
    port = FakeSyncPort(epochs=[7, 7, 7], downloads=[None, _download_of(truth)])  # the records never moved
    catchup, state, _ = _catchup(port, 3)
    assert catchup.run(7) and state.epoch == 7
    assert [c[1] for c in port.calls if c[0] == "download"] == [7, 7]


def test_a_retried_download_that_arrives_is_loaded() -> None:
    truth, _ = _truth(8)
    port = FakeSyncPort(epochs=[7, 8, 8], downloads=[None, _download_of(truth)])
    catchup, state, _ = _catchup(port, 3)
    assert catchup.run(7) and state.epoch == 8
    assert [c[1] for c in port.calls if c[0] == "download"] == [7, 8]


def test_a_download_the_swarm_moved_past_is_stepped_by_the_missed_round() -> None:
    base = _state(3)
    truth, swarm_sha = _truth(4)
    download = _download_of(base)
    port = FakeSyncPort(epochs=[4], downloads=[download],
                        updates=[Update([t.clone() for t in FRESH], None, swarm_sha)],
                        votes_by_epoch={4: {"a": swarm_sha}})
    catchup, state, _ = _catchup(port, 1)
    assert catchup.run(3)
    assert catchup.last.steps == [SyncStep.DOWNLOAD, SyncStep.STEP_DOWNLOADED]
    assert state.epoch == 4 and _sha(state.anchors, _momentum(state)) == swarm_sha
    assert ("serve", "stepped manifest") in port.calls


def test_without_the_missed_round_the_download_is_loaded_as_it_is() -> None:
    base = _state(3)
    port = FakeSyncPort(epochs=[4], downloads=[_download_of(base)])
    catchup, state, _ = _catchup(port, 1)
    assert catchup.run(3) and state.epoch == 3
    torch.testing.assert_close(state.anchors[0], base.anchors[0])


def test_a_stepped_download_that_fails_its_check_is_downloaded_again_once() -> None:
    base = _state(3)
    truth, swarm_sha = _truth(4)
    lying = Update([t + 1.0 for t in FRESH], None, swarm_sha)  # does not lead to the claimed digest
    port = FakeSyncPort(epochs=[4], downloads=[_download_of(base), _download_of(truth)], updates=[lying],
                        votes_by_epoch={4: {"a": swarm_sha}})
    catchup, state, _ = _catchup(port, 1)
    assert catchup.run(3)
    assert catchup.last.steps == [SyncStep.DOWNLOAD, SyncStep.STEP_DOWNLOADED, SyncStep.DOWNLOAD_AGAIN,
                                  SyncStep.DOWNLOAD, SyncStep.LOAD]
    assert [c[1] for c in port.calls if c[0] == "download"] == [3, 4]
    assert state.epoch == 4 and _sha(state.anchors, _momentum(state)) == swarm_sha


def test_a_second_bad_step_gives_up_with_our_state_unchanged() -> None:
    base, newer = _state(3), _state(4)
    port = FakeSyncPort(epochs=[4, 4, 5, 5],  # read before and after each download
                        downloads=[_download_of(base), _download_of(newer)],
                        updates=[Update([t + 1.0 for t in FRESH], None, "0" * 64),
                                 Update([t + 1.0 for t in FRESH], None, "0" * 64)])
    catchup, state, _ = _catchup(port, 1)
    before = state.anchors[0].clone()
    assert not catchup.run(3)
    assert catchup.last.steps[-1] is SyncStep.GIVE_UP
    assert state.epoch == 1 and torch.equal(state.anchors[0], before)
    assert _names(port)[-1] == "resume_serving"


def test_eager_peers_only_download() -> None:
    truth, swarm_sha = _truth(4)
    port = FakeSyncPort(epochs=[5], downloads=[_download_of(truth)],
                        updates=[Update([t.clone() for t in FRESH], None, swarm_sha)])
    catchup, state, _ = _catchup(port, 3, eager=True)
    assert catchup.run(4) and state.epoch == 4
    assert "fetch_update" not in _names(port)


# ---------------------------------------------------------------------- Catchup.join


def test_join_waits_for_a_believed_donor_then_loads() -> None:
    truth, _ = _truth(5)
    port = FakeSyncPort(epochs=[5], downloads=[None, _download_of(truth)], backer=None)  # none serves it yet
    catchup, state, slept = _catchup(port, 0)
    assert catchup.join(5) == 5 and state.epoch == 5
    assert slept == [5.0]


def test_join_follows_a_newer_belief_at_once_and_stops_when_nobody_is_ahead() -> None:
    truth, _ = _truth(6)
    port = FakeSyncPort(epochs=[5, 5, 6, 6], downloads=[None, _download_of(truth)])
    catchup, state, slept = _catchup(port, 0)
    assert catchup.join(5) == 6 and slept == []
    port = FakeSyncPort(epochs=[None])
    catchup, state, slept = _catchup(port, 2)
    assert catchup.join(5) is None and state.epoch == 2 and slept == []


def test_join_gives_up_at_its_deadline() -> None:
    port = FakeSyncPort(epochs=[5])
    catchup, state, slept = _catchup(port, 0)
    assert catchup.join(5, timeout=0.0) is None and port.calls == []  # no time: nothing asked
