"""A part's codec is the run's codec, a reply's the run's reply codec (issue 51, finding 6).

The codec id and parameter travel in each payload's header, and the installed decoder used to decode whatever
codec a header named: a dense part was accepted in a top-k swarm (every value non-zero, 1/140 of the bytes
a dense part costs sent as 8 bits a value instead), another block size in an int8 swarm."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hivemind.compression import CompressionInfo
from hivemind.compression import serialization as hivemind_serialization

from p2p_diloco.swarm.hivemind_codecs import HIVEMIND_SLOT, CodecCompression, install
from p2p_diloco.swarm.runner import decode_part


@pytest.fixture(autouse=True)
def _restore_hivemind_table() -> Iterator[None]:
    original = hivemind_serialization._BASE_COMPRESSION_TYPES[HIVEMIND_SLOT]
    yield
    hivemind_serialization._BASE_COMPRESSION_TYPES[HIVEMIND_SLOT] = original


def _part(sender: CodecCompression, x: torch.Tensor, reply: bool = False):  # noqa: ANN202 - a protobuf message
    info = CompressionInfo.from_tensor(x, key=0)
    return sender.compress_average(x, info) if reply else sender.compress(x, info)


@pytest.mark.parametrize(("run", "sender"), [
    (dict(codec="topk"), dict(codec="int8")),  # a dense part in a top-k swarm: every value non-zero
    (dict(codec="topk"), dict(codec="none")),
    (dict(codec="int8"), dict(codec="4bit")),
    (dict(codec="int8"), dict(codec="int8", block_size=64)),  # another block size
    (dict(codec="2bit"), dict(codec="int8")),
    (dict(codec="topk"), dict(codec="topk-sign")),
], ids=["dense-in-topk", "fp32-in-topk", "4bit-in-int8", "int8-block-64-in-128", "int8-in-2bit", "sign-in-topk"])
def test_a_part_of_another_codec_is_refused(run: dict, sender: dict) -> None:
    receiver = CodecCompression(**run)
    install(receiver)  # the receiving peer's decoder, as run_peer installs it
    x = torch.randn(8192)
    part, problem = decode_part(_part(CodecCompression(**sender), x), (8192,), receiver.compression_type)
    assert problem is not None and "codec" in problem and part.numel() == 0


@pytest.mark.parametrize("name", ["int8", "4bit", "2bit", "topk", "topk-sign"])
def test_the_runs_own_parts_and_replies_still_decode(name: str) -> None:
    receiver = CodecCompression(name)
    install(receiver)
    x = torch.randn(8192)
    for reply in (False, True):
        part, problem = decode_part(_part(CodecCompression(name), x, reply), (8192,), receiver.compression_type)
        assert problem is None and part.shape == (8192,)
