"""Trust from what a peer saw (``core.evidence``) and the port that feeds it: free identities can neither
move an anchored peer's epoch nor win its checksum vote, and an honest peer ahead still brings newcomers along.
"""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.core.delayed import StalenessPolicy
from p2p_diloco.core.evidence import (
    EPOCH_LIMIT,
    MOVED_ON_PASSES,
    Claim,
    Evidence,
    outvoted,
    state_verdict,
)
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.swarm.checksum import params_sha256, state_sha256
from p2p_diloco.swarm.group import MemberInfo
from p2p_diloco.swarm.protocol import PROTOCOL_VERSION
from p2p_diloco.swarm.records import ProgressRecord

SYBILS = [f"sybil{i}" for i in range(10)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_newcomer_follows_the_largest_claim_an_anchored_peer_only_trusted_ones() -> None:
    ev = Evidence("me")
    claims = [Claim("me", 0), Claim("alone", 10), Claim("sybil", 10**6)]
    assert ev.swarm_epoch(claims) == 10**6  # nobody to check against: the largest claim, as before
    ev.averaged_with(["me", "alone"])
    assert ev.trusts("alone") and not ev.trusts("me")
    assert ev.swarm_epoch(claims) == 10  # the Sybil's claim changes nothing now
    # every trusted peer gone: back to the newcomer rule (no split, no stall waiting for the departed)
    assert ev.swarm_epoch([Claim("me", 10), Claim("other", 12)]) == 12


def test_a_lone_peer_ahead_brings_newcomers_to_its_state_and_is_trusted_for_it() -> None:
    joiner = Evidence("joiner")
    claims = [Claim("joiner", 0), Claim("lone", 7)]
    assert joiner.swarm_epoch(claims) == 7
    assert joiner.trusted_or_none(["lone"]) is None  # nothing to check the state against yet
    joiner.adopted_from("lone")
    assert joiner.trusted_or_none(["lone"]) == frozenset({"lone"})
    later = [Claim("joiner", 7), Claim("lone", 8), *(Claim(s, 10**6) for s in SYBILS)]
    assert joiner.swarm_epoch(later) == 8


def test_claims_nobody_serves_are_ignored_for_a_while_then_believed_again() -> None:
    clock = Clock()
    ev = Evidence("me", unbacked_s=(60.0, 900.0), clock=clock)
    claims = [Claim("me", 0), Claim("honest", 3), Claim("liar", 10**6), Claim("liar2", 10**6 - 1)]
    assert ev.swarm_epoch(claims) == 10**6
    assert ev.unbacked(claims, 10**6 - 1) == {"liar": 60.0, "liar2": 60.0}  # one failed try covers both
    assert ev.swarm_epoch(claims) == 3
    clock.now = 61.0  # an honest donor that was only slow is believed again soon ...
    assert ev.swarm_epoch(claims) == 10**6
    for window in (120.0, 240.0, 480.0, 900.0, 900.0):  # ... a claim that keeps failing, ever longer
        assert ev.unbacked(claims, 10**6)["liar"] == window
    clock.now += 899.0
    assert ev.swarm_epoch(claims) == 10**6 - 1  # liar2 failed less often: its window ended first
    ev.averaged_with(["liar"])  # a vouch clears the record
    ev.unbacked(claims, 0)
    assert ev.swarm_epoch(claims) == 10**6


def test_epochs_past_the_limit_are_never_believed_nor_loaded() -> None:
    ev = Evidence("me")
    assert ev.swarm_epoch([Claim("me", 2), Claim("x", EPOCH_LIMIT + 1)]) == 2
    assert ev.swarm_epoch([Claim("x", EPOCH_LIMIT)]) == EPOCH_LIMIT
    state = OuterState([torch.zeros(2)], lr=0.7, momentum=0.9, policy=StalenessPolicy())
    with pytest.raises(ValueError, match="epoch must be an integer within"):
        state.load_state_tensors(state.state_tensors(), EPOCH_LIMIT + 1)
    record = dict(epoch=EPOCH_LIMIT + 1, inner_step=0, steps_per_s=1.0, samples_per_s=1.0, tokens_per_s=1.0,
                  fingerprint="abcdef01", time=1.0, client_mode=False, phase_s=0.0, protocol=PROTOCOL_VERSION)
    with pytest.raises(ValueError):
        ProgressRecord.parse_obj(record)
    # An epoch at the limit still leaves the wire format (10**9) all the headroom a run could use.
    MemberInfo.for_round("run", "abcdef01", EPOCH_LIMIT + 10**6, 1.0, 0.0, 0, True, False, norm=1.0, stale_norm=0.0)


def test_sybil_votes_do_not_count_trusted_ones_do() -> None:
    ev = Evidence("me")
    ev.averaged_with(["a", "b"])
    votes = {s: "f" * 64 for s in SYBILS} | {"a": "0" * 64, "b": "0" * 64, "me": "0" * 64}
    assert not outvoted(ev.trusted_votes(votes), "0" * 64)  # 10 Sybils against 2 groupmates
    assert outvoted(ev.trusted_votes(votes | {"a": "1" * 64, "b": "1" * 64}), "0" * 64)
    assert not outvoted(ev.trusted_votes({s: "f" * 64 for s in SYBILS}), "0" * 64)  # nobody trusted voted
    assert not outvoted({"a": "1" * 64, "b": "0" * 64}, "0" * 64)  # our own vote counts: 2 against 1


def test_a_split_round_closes_one_side_moves_and_the_other_stays() -> None:
    x, y = "1" * 64, "9" * 64
    # two groups of two made epoch e (a, b: x; c, d: y). Without its own vote each peer saw the other side
    # 2 to 1 and all four swapped; now the tie goes to the lowest digest on every peer alike.
    everyone = {"a": x, "b": x, "c": y, "d": y}
    moved = {me for me, mine in everyone.items() if outvoted({p: d for p, d in everyone.items() if p != me}, mine)}
    assert moved == {"c", "d"}
    # a lone peer and one trusted voter of another digest: only the higher digest moves
    assert outvoted({"a": x}, y) and not outvoted({"a": y}, x)
    # more of ours than of theirs: stay, whatever the digests
    assert not outvoted({"a": x, "b": y, "c": y}, y)


def test_a_donor_state_needs_a_trusted_digest_unless_the_donor_is_trusted() -> None:
    good, evil = "0" * 64, "e" * 64
    trusted = frozenset({"a", "b"})
    sybil_votes = {s: evil for s in SYBILS}
    # Untrusted donor: only a digest trusted peers published.
    assert state_verdict("sybil0", evil, sybil_votes, trusted) is not None
    assert state_verdict("sybil0", good, sybil_votes | {"a": good}, trusted) is None
    # Trusted donor: accepted unless trusted voters published another digest.
    assert state_verdict("a", good, sybil_votes, trusted) is None
    assert "trusted peers published" in state_verdict("a", good, {"b": evil}, trusted)
    # A newcomer's verdict from untrusted votes (download_state then only ranks such a donor last: a veto by
    # a head count of free identities kept joiners from the honest state and split the swarm at start-up).
    assert state_verdict("x", good, {}, None) is None
    assert "2/3 untrusted peers" in state_verdict("x", good, {"p": evil, "q": evil, "r": good}, None)


def test_the_state_digest_covers_the_momentum() -> None:
    params, momentum = [torch.ones(3)], [torch.zeros(3)]
    assert state_sha256(params, momentum) != state_sha256(params, [torch.full((3,), 1e30)])
    assert state_sha256(params, momentum) != params_sha256(params)


def test_a_donor_that_keeps_moving_on_is_forgiven_three_times_in_a_row() -> None:
    ev = Evidence("me", unbacked_s=(60.0, 600.0))
    for epoch in range(1, 5):
        claims, now = [Claim("a", epoch)], [Claim("a", epoch + 1)]
        ignored = ev.unbacked(claims, epoch, served={"a": epoch}, now=now)
        assert ("a" in ignored) == (epoch > MOVED_ON_PASSES), (epoch, ignored)
    ev.adopted_from("b")  # a download succeeded: the count starts again
    assert "a" not in ev.unbacked([Claim("a", 9)], 9, served={"a": 9}, now=[Claim("a", 10)])


def test_a_donor_that_stopped_serving_is_forgiven_while_its_record_keeps_the_epoch_it_served() -> None:
    """Donors of short rounds step on between their manifest and a loaded joiner's first chunk, and their
    records say so only after their outer step: a record still at the epoch served is forgiven like one past it
    (within MOVED_ON_PASSES); one that went back, or vanished, is struck."""
    ev = Evidence("me", unbacked_s=(60.0, 600.0))
    claims = [Claim("a", 7), Claim("b", 7), Claim("c", 7), Claim("d", 7)]
    ignored = ev.unbacked(claims, 7, served={"a": 7, "b": 7, "c": 7},
                          now=[Claim("a", 7), Claim("b", 8), Claim("c", 6)])
    assert set(ignored) == {"c", "d"}  # c went back; d handed out no manifest of epoch 7 at all
    assert ev.swarm_epoch([Claim("a", 7), Claim("b", 8)]) == 8


def test_a_donor_that_served_a_state_newer_than_its_record_is_forgiven() -> None:
    """A donor serves the state it just stepped to before its record says so: the manifest is of epoch 21 while
    its record still claims the 20 the joiner asked for. That is no going back (three honest donors of
    one-second rounds were struck for it, and the joiner trained alone from epoch 0); a record below the epoch
    asked for still is."""
    ev = Evidence("me", unbacked_s=(60.0, 600.0))
    claims = [Claim("a", 20), Claim("b", 20), Claim("c", 20)]
    ignored = ev.unbacked(claims, 20, served={"a": 21, "b": 21, "c": 21},
                          now=[Claim("a", 20), Claim("b", 21), Claim("c", 19)])
    assert set(ignored) == {"c"}


def test_left_behind_needs_every_believed_peer_past_the_epoch() -> None:
    ev = Evidence("me")
    assert not ev.left_behind([Claim("me", 3)], 3)  # alone: nobody to have moved on
    assert ev.left_behind([Claim("me", 3), Claim("a", 4), Claim("b", 5)], 3)
    # another group of the same round still assembles: not left behind (a split round must not give up)
    assert not ev.left_behind([Claim("me", 3), Claim("a", 4), Claim("b", 3)], 3)
    # a peer one epoch behind (downloading) may still join this round
    assert not ev.left_behind([Claim("me", 3), Claim("a", 4), Claim("late", 2)], 3)
    ev.averaged_with(["b"])
    # anchored: Sybil records ahead cannot end the round while a trusted peer is still at this epoch ...
    claims = [Claim("me", 3), Claim("b", 3)] + [Claim(s, 4) for s in SYBILS]
    assert not ev.left_behind(claims, 3)
    # ... and once the trusted peer moved on, this peer is left behind whatever the Sybils say
    assert ev.left_behind([Claim("me", 3), Claim("b", 4), Claim("sybil0", 3)], 3)


def test_a_round_is_over_within_the_window_only_when_every_believed_peer_finished_it() -> None:
    ev = Evidence("me")
    ahead = [Claim("me", 3), Claim("a", 4), Claim("b", 5)]
    assert ev.round_over(ahead, 3, {"a", "b"})  # both moved on and published their checksum of epoch 4
    # an eager peer publishes epoch 4 while its all-reduce of 3 may still look for a group: no checksum, no end
    assert not ev.round_over(ahead, 3, {"a"})
    assert not ev.round_over(ahead, 3, set())
    # a checksum of a peer still at this epoch ends nothing (left_behind's rule comes first)
    assert not ev.round_over([Claim("me", 3), Claim("a", 4), Claim("b", 3)], 3, {"a", "b"})
    assert not ev.round_over([Claim("me", 3)], 3, {"me"})  # alone: nobody to have finished it
    # anchored: Sybils' votes and records count for nothing, the trusted peer's decide
    ev.averaged_with(["b"])
    sybils = [Claim(s, 4) for s in SYBILS]
    assert not ev.round_over([Claim("me", 3), Claim("b", 4), *sybils], 3, set(SYBILS))
    assert ev.round_over([Claim("me", 3), Claim("b", 4), *sybils], 3, {"b"})


def test_forgiven_downloads_are_counted_for_the_peer_not_per_donor_identity() -> None:
    """k Sybils taking turns, each serving a few chunks then raising its claim: per identity they got 3k
    forgiven failed downloads; now the peer forgives MOVED_ON_PASSES in a row, whoever served them."""
    ev = Evidence("me", unbacked_s=(60.0, 600.0))
    for i, sybil in enumerate(SYBILS[:6]):
        ignored = ev.unbacked([Claim(sybil, 5)], 5, served={sybil: 5}, now=[Claim(sybil, 6)])
        assert (sybil in ignored) == (i >= MOVED_ON_PASSES), (i, ignored)
    # honest donors of one swarm step on together: one failed download is one pass for all of them
    honest = Evidence("me", unbacked_s=(60.0, 600.0))
    ignored = honest.unbacked([Claim("a", 2), Claim("b", 2)], 2, served={"a": 2, "b": 2},
                              now=[Claim("a", 3), Claim("b", 3)])
    assert not ignored and honest._passes == 1
