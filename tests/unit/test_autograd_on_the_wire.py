"""No autograd state from the wire (issue 51, finding 1).

A sender that sets protobuf ``requires_grad`` on its parts (hivemind's deserializer takes the flag as sent)
made every member's decoded parts, aggregate, reply and finally its shared buffers non-leaf tensors: their
history kept each later round's reply alive (4 bytes per parameter per round) and a fold round's result could
no longer be pickled to the host. Parts and replies that carry the flag are refused on the wire, our decoder
never sets it, and the copy into the shared buffers runs without grad."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import torch
from hivemind.compression import CompressionInfo, NoCompression, serialize_torch_tensor
from hivemind.compression import serialization as hivemind_serialization
from hivemind.proto import averaging_pb2, runtime_pb2

from p2p_diloco.core.codecs import CODEC_NAMES
from p2p_diloco.swarm.hivemind_codecs import HIVEMIND_SLOT, CodecCompression, install
from p2p_diloco.swarm.runner import ByteCounter, _count_received, _Replies, decode_part, run_allreduce


def _flagged(message: runtime_pb2.Tensor) -> runtime_pb2.Tensor:
    hostile = runtime_pb2.Tensor()
    hostile.CopyFrom(message)
    hostile.requires_grad = True
    return hostile


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_our_decoder_never_hands_out_autograd_state(name: str) -> None:
    compression = CodecCompression(name, block_size=64)
    x = torch.randn(33, 7)
    y = compression.extract(_flagged(compression.compress(x, CompressionInfo.from_tensor(x, key=0))))
    assert not y.requires_grad and y.grad_fn is None


@pytest.fixture
def restore_hivemind_table() -> Iterator[None]:
    original = hivemind_serialization._BASE_COMPRESSION_TYPES[HIVEMIND_SLOT]
    yield
    hivemind_serialization._BASE_COMPRESSION_TYPES[HIVEMIND_SLOT] = original


@pytest.mark.parametrize("compression", [NoCompression(), CodecCompression("int8"), CodecCompression("topk")],
                         ids=["none", "int8", "topk"])
def test_a_part_that_sets_requires_grad_is_refused_before_it_is_decoded(
        compression: object, restore_hivemind_table: None) -> None:
    if isinstance(compression, CodecCompression):
        install(compression)  # the receiving peer's decoder, as run_peer installs it
    x = torch.randn(4096)
    message = (compression.compress(x, CompressionInfo.from_tensor(x, key=0))  # type: ignore[attr-defined]
               if isinstance(compression, CodecCompression) else serialize_torch_tensor(x, compression.compression_type))
    part, problem = decode_part(message, (4096,), message.compression)
    assert problem is None and not part.requires_grad
    part, problem = decode_part(_flagged(message), (4096,), message.compression)
    assert problem is not None and "requires_grad" in problem and part.numel() == 0


def test_a_reducer_reply_that_sets_requires_grad_fails_that_reducer() -> None:
    x = torch.randn(64)
    reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART,
                                        tensor_part=_flagged(serialize_torch_tensor(x)))

    async def stream() -> AsyncIterator[averaging_pb2.AveragingData]:
        yield reply

    async def read() -> None:
        replies = _Replies(expected=1, shapes=((64,),), compression_type=reply.tensor_part.compression)
        async for _ in _count_received(stream(), ByteCounter(), replies):
            pass

    with pytest.raises(ValueError, match="requires_grad"):
        asyncio.run(read())


class _RunnerWithHistory:
    """Yields averages that carry autograd history, as a reply decoded with the flag used to."""

    def __init__(self, values: list[torch.Tensor]):
        self.values = values

    def __aiter__(self) -> Iterator[torch.Tensor]:
        return self._gen()  # type: ignore[return-value]

    async def _gen(self) -> AsyncIterator[torch.Tensor]:
        for value in self.values:
            yield value.clone().requires_grad_() * 1.0

    def faults(self) -> list[str]:
        return []


def test_the_shared_buffers_stay_leaves_whatever_the_runner_yields() -> None:
    shared = [torch.zeros(8), torch.zeros(3, 2)]
    values = [torch.arange(8.0), torch.ones(3, 2)]
    assert asyncio.run(run_allreduce(_RunnerWithHistory(values), shared)) == []  # type: ignore[arg-type]
    for buffer, value in zip(shared, values, strict=True):
        assert buffer.is_leaf and not buffer.requires_grad and buffer.grad_fn is None
        assert torch.equal(buffer, value)
