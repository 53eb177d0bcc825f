"""The completion check compares what each member received, so an equivocating reducer is caught and named.

These drive the check's real pieces (``CheckLayout``, ``OwnerPickReducer``, ``judge``) over three members, as
hivemind's runner would: each member's input is split into the reducers' ranges, every reducer takes every
sender's range through ``accumulate_part``, and every member judges the same delivered ranges.
"""

from __future__ import annotations

import asyncio
import hashlib

import torch

from p2p_diloco.swarm.completion import (
    CheckLayout,
    OwnerPickReducer,
    digest_values,
    judge,
    make_block,
    received_digest,
    values_digest,
)

IDS = ["honestA", "honestB", "evilR"]
TRUE = hashlib.sha256(b"the average").digest()
OTHER = hashlib.sha256(b"another average").digest()


def _run_check(layout: CheckLayout, blocks: list[torch.Tensor],
               tamper: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every member sends its ranges to their reducers; returns the delivered ranges (one per reducer).
    ``tamper``: member -> a tensor it sends to every range instead of its honest input (with a huge weight)."""
    inputs = [layout.tensors(m, block) for m, block in enumerate(blocks)]
    for member, junk in (tamper or {}).items():
        inputs[member] = [junk.clone() for _ in layout.reducers]

    async def reduce_range(k: int) -> torch.Tensor:
        reducer = layout.reducers[k]
        red = OwnerPickReducer((torch.Size([layout.range_size]),), layout.owners(reducer), range(layout.members))
        outs = await asyncio.gather(*(red.accumulate_part(m, 0, inputs[m][k], weight=1e30 if tamper and m in tamper
                                                          else 1.0) for m in range(layout.members)))
        assert all(torch.equal(out, outs[0]) for out in outs[1:])  # every member gets the same bytes
        return outs[0]

    async def everything() -> list[torch.Tensor]:
        return list(await asyncio.gather(*(reduce_range(k) for k in range(len(layout.reducers)))))

    return asyncio.run(everything())


def test_digests_travel_exactly_and_junk_is_no_digest() -> None:
    assert values_digest(digest_values(TRUE)) == TRUE
    assert values_digest(torch.full((16,), 0.5)) is None
    assert values_digest(torch.full((16,), float("nan"))) is None


def test_honest_members_confirm_and_a_sender_cannot_steer_blocks_it_does_not_own() -> None:
    layout = CheckLayout(3, (0, 2))  # member 1 is a client: its block travels through both reducers
    digests = [TRUE, hashlib.sha256(b"").digest(), OTHER]
    blocks = [make_block(True, digests[m] if m in layout.reducers else None, received_digest(digests))
              for m in range(3)]
    ranges = _run_check(layout, blocks)
    assert all(judge(layout, m, ranges, IDS, digests, True).confirmed for m in range(3))

    # member 2 sends all-ones (as if everyone completed) with an enormous weight: it owns only its block, so
    # member 0's "incomplete" still reaches everyone
    blocks[0] = make_block(False, TRUE, received_digest(digests))
    ranges = _run_check(layout, blocks, tamper={2: torch.ones(layout.range_size)})
    for member in (0, 1):
        verdict = judge(layout, member, ranges, IDS, digests, member != 0)
        assert not verdict.confirmed and "honestA" in verdict.detail
        assert set(verdict.equivocators) <= {"evilR"}  # its own block now misstates what it sent


def test_an_equivocating_reducer_fails_the_round_for_everyone_and_its_victim_names_it() -> None:
    layout = CheckLayout(3, (0, 1, 2))
    honest_view = [TRUE, TRUE, TRUE]  # digests per reducer as A and R see them (R: what it sent)
    victim_view = [TRUE, TRUE, OTHER]  # R sent B other averages, within every bound B can check alone
    views = [honest_view, victim_view, honest_view]
    blocks = [make_block(True, views[m][m], received_digest(views[m])) for m in range(3)]
    ranges = _run_check(layout, blocks)

    victim = judge(layout, 1, ranges, IDS, victim_view, True)
    assert not victim.confirmed and "evilR" in victim.detail
    assert list(victim.equivocators) == ["evilR"] and "equivocation" in victim.equivocators["evilR"]

    other = judge(layout, 0, ranges, IDS, honest_view, True)
    assert not other.confirmed and "honestB" in other.detail
    assert other.equivocators == {}  # A cannot tell whether R or B lies: nobody banned

    # the equivocator, judging honestly, also sees B disagree: nobody applies the round
    assert not judge(layout, 2, ranges, IDS, honest_view, True).confirmed

    # a victim whose own view was incomplete skips without banning (its digest may just be cut short)
    assert judge(layout, 1, ranges, IDS, victim_view, False).equivocators == {}


def test_a_member_misreporting_what_it_received_fails_the_round_but_frames_no_reducer() -> None:
    layout = CheckLayout(3, (0, 1, 2))
    view = [TRUE, TRUE, TRUE]
    blocks = [make_block(True, view[m], received_digest(view)) for m in range(3)]
    blocks[2] = make_block(True, TRUE, received_digest([TRUE, OTHER, TRUE]))  # R claims B sent it other values
    ranges = _run_check(layout, blocks)
    for member in (0, 1):
        verdict = judge(layout, member, ranges, IDS, view, True)
        assert not verdict.confirmed and "evilR" in verdict.detail and verdict.equivocators == {}


def test_a_rewritten_copy_of_a_clients_block_counts_as_a_failure() -> None:
    layout = CheckLayout(3, (0, 2))
    digests = [TRUE, hashlib.sha256(b"").digest(), TRUE]
    blocks = [make_block(m != 1, digests[m] if m in layout.reducers else None, received_digest(digests))
              for m in range(3)]  # the client (member 1) saw an incomplete all-reduce
    ranges = _run_check(layout, blocks)
    ranges[1][layout.range_size - 33] = 1.0  # reducer 2 rewrites its copy of the client's status
    verdict = judge(layout, 0, ranges, IDS, digests, True)
    assert not verdict.confirmed and "honestB" in verdict.detail
