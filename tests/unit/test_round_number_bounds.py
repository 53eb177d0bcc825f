"""Round numbers on the wire cover every legal fragment round and nothing beyond (issue 51, finding 5c).

A fragment round meets under e·F + f; epochs are capped at ``EPOCH_LIMIT`` (10^8), and the gathered metadata
refused round numbers over 10^9, so every round of a run with F >= 11 fragments past epoch ~9·10^7 was refused.
"""

from __future__ import annotations

import pytest
from hivemind.averaging.allreduce import AveragingMode
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.config import OuterConfig
from p2p_diloco.core.evidence import EPOCH_LIMIT
from p2p_diloco.core.fragments import MAX_FRAGMENTS, ROUND_LIMIT, FragmentSchedule, round_number
from p2p_diloco.swarm.buffer_layout import BufferLayout
from p2p_diloco.swarm.group import MemberInfo, decode_gather, encode_gather


def _info(epoch: int) -> MemberInfo:
    return MemberInfo.for_round("run", "f" * 16, epoch, 1.0, 0.0, 0, True, False, norm=1.0, stale_norm=0.0)


def _wire(epoch: object) -> dict:
    wire = _info(0).to_wire()
    wire["ep"] = epoch
    return wire


@pytest.mark.parametrize("fragments", [1, 11, MAX_FRAGMENTS])
def test_the_last_legal_round_of_any_run_is_accepted(fragments: int) -> None:
    last = round_number(EPOCH_LIMIT, fragments - 1, fragments)
    assert last > 10**9 or fragments < 11
    assert last <= ROUND_LIMIT
    info = _info(last)
    assert MemberInfo.from_wire(info.to_wire()) == info
    raw = encode_gather(None, AveragingMode.NODE, info)
    assert decode_gather(raw)[2].epoch == last


def test_round_numbers_beyond_any_legal_run_are_refused() -> None:
    assert ROUND_LIMIT == round_number(EPOCH_LIMIT, MAX_FRAGMENTS - 1, MAX_FRAGMENTS)
    with pytest.raises(ValueError):
        _info(ROUND_LIMIT + 1)
    for bad in (ROUND_LIMIT + 1, -1, 10**30, True, 1.0):
        with pytest.raises(ValueError):
            MemberInfo.from_wire(_wire(bad))
    raw = MSGPackSerializer.dumps([None, AveragingMode.NODE.value, MSGPackSerializer.dumps(_wire(ROUND_LIMIT + 1))])
    with pytest.raises(ValueError):
        decode_gather(raw)
    for epoch, fragment, fragments in ((EPOCH_LIMIT + 1, 0, 1), (0, 2, 2), (0, 0, MAX_FRAGMENTS + 1), (-1, 0, 1)):
        with pytest.raises(ValueError):
            round_number(epoch, fragment, fragments)


def test_no_run_has_more_fragments_than_the_wire_allows() -> None:
    with pytest.raises(ValueError):
        FragmentSchedule(local_steps=1000, fragments=MAX_FRAGMENTS + 1)
    FragmentSchedule(local_steps=1000, fragments=MAX_FRAGMENTS)
    with pytest.raises(ValueError):
        OuterConfig(local_steps=1000, fragments=MAX_FRAGMENTS + 1)


def test_the_swarm_layout_numbers_rounds_as_the_core_does() -> None:
    import torch

    template = [torch.zeros(4) for _ in range(12)]
    layout = BufferLayout.of(template, [[i] for i in range(12)])
    assert layout.round_number(EPOCH_LIMIT, 11) == round_number(EPOCH_LIMIT, 11, 12)
    _info(layout.round_number(EPOCH_LIMIT, 11))  # accepted: 1.2e9 > 10^9
