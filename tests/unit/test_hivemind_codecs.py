"""The hivemind compression adapter (swarm/hivemind_codecs.py), and that no core module imports hivemind."""

from __future__ import annotations

import ast
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hivemind.compression import (
    CompressionInfo,
    NoCompression,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.compression import serialization as hivemind_serialization
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

import p2p_diloco.core
from p2p_diloco.core.codecs import CODEC_NAMES, get_codec
from p2p_diloco.core.sparse import SparsePartError
from p2p_diloco.swarm.hivemind_codecs import (
    _CODEC_IDS,
    HEADER_NBYTES,
    HIVEMIND_SLOT,
    CodecCompression,
    install,
    uninstall,
)


@pytest.fixture
def restore_hivemind_table() -> Iterator[None]:
    original = hivemind_serialization._BASE_COMPRESSION_TYPES[HIVEMIND_SLOT]
    yield
    hivemind_serialization._BASE_COMPRESSION_TYPES[HIVEMIND_SLOT] = original


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_roundtrip_matches_the_codec(name: str) -> None:
    compression = CodecCompression(name, block_size=64)
    x = _randn(33, 7).requires_grad_()
    message = compression.compress(x, CompressionInfo.from_tensor(x, key=0))
    assert message.compression == runtime_pb2.CompressionType.Value(HIVEMIND_SLOT)
    assert len(message.buffer) == HEADER_NBYTES + compression.codec.encoded_nbytes(x.numel())
    assert not message.requires_grad  # autograd state never goes on the wire
    y = compression.extract(message)
    assert y.shape == x.shape and not y.requires_grad and y.grad_fn is None
    assert torch.equal(y, get_codec(name, 64).roundtrip(x.detach()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtype_is_preserved(dtype: torch.dtype) -> None:
    compression = CodecCompression("int8")
    x = _randn(100).to(dtype)
    y = compression.extract(compression.compress(x, CompressionInfo.from_tensor(x)))
    assert y.dtype == dtype
    assert torch.allclose(y.float(), x.float(), atol=0.05)


def test_installed_slot_routes_hivemind_serialization(restore_hivemind_table: None) -> None:
    previous = install(CodecCompression("4bit"))
    x = _randn(1000, seed=1)
    message = serialize_torch_tensor(x, runtime_pb2.CompressionType.Value(HIVEMIND_SLOT))
    assert len(message.buffer) == HEADER_NBYTES + get_codec("4bit").encoded_nbytes(1000)
    # The installed instance decodes only its own codec: a header cannot pick another decoder.
    int8_message = CodecCompression("int8", block_size=32).compress(x, CompressionInfo.from_tensor(x))
    with pytest.raises(ValueError, match="codec"):
        deserialize_torch_tensor(int8_message)
    # Streamed in small chunks, as hivemind sends large parts.
    chunks = list(split_for_streaming(message, chunk_size_bytes=100))
    assert len(chunks) > 1
    assert torch.equal(
        deserialize_torch_tensor(combine_from_streaming(chunks)), get_codec("4bit").roundtrip(x)
    )
    uninstall(previous)
    assert hivemind_serialization._BASE_COMPRESSION_TYPES[HIVEMIND_SLOT] is previous


def test_install_validation(restore_hivemind_table: None) -> None:
    with pytest.raises(TypeError):
        install(NoCompression())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        uninstall(NoCompression())


def test_estimate_compression_ratio() -> None:
    info32 = CompressionInfo.from_tensor(torch.zeros(10))
    info16 = CompressionInfo.from_tensor(torch.zeros(10, dtype=torch.float16))
    assert CodecCompression("4bit").estimate_compression_ratio(info32) == pytest.approx(4.125 / 32)
    assert CodecCompression("int8").estimate_compression_ratio(info16) == pytest.approx(8.125 / 16)
    assert CodecCompression("none").estimate_compression_ratio(info32) == 1.0


def _message(buffer: bytes, size: tuple[int, ...] = (4,), dtype: str = "float32") -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(
        compression=runtime_pb2.CompressionType.Value(HIVEMIND_SLOT), buffer=buffer, size=size, dtype=dtype
    )


def test_malformed_messages_raise_value_error() -> None:
    compression = CodecCompression("4bit", block_size=8)
    good = compression.compress(_randn(4), CompressionInfo.from_tensor(_randn(4)))
    header, payload = good.buffer[:HEADER_NBYTES], good.buffer[HEADER_NBYTES:]
    cases = {
        "shorter than the header": _message(b"PD\x01"),
        "not a p2p_diloco": _message(b"\x00" * 8 + payload),  # e.g. plain hivemind's blockwise format
        "version": _message(b"PD\x02" + header[3:] + payload),
        "unknown codec id": _message(b"PD\x01\x09" + header[4:] + payload),
        "block size": _message(header[:4] + (0).to_bytes(4, "little") + payload),
        "dtype": _message(good.buffer, dtype="int64"),
        "bytes": _message(good.buffer, size=(5,)),
    }
    for match, message in cases.items():
        with pytest.raises(ValueError, match=match):
            compression.extract(message)
    with pytest.raises(ValueError, match="block size"):
        compression.extract(
            _message(b"PD\x01\x00" + (8).to_bytes(4, "little") + torch.zeros(4).numpy().tobytes())
        )


def test_error_feedback_per_part_key() -> None:
    compression = CodecCompression("4bit", error_feedback=True)
    x = _randn(300, seed=2)
    info = CompressionInfo.from_tensor(x, key=3).get_part(1, 300)
    first = compression.extract(compression.compress(x, info))
    assert compression.error_feedback is not None
    residual = compression.error_feedback.residual((3, 1))
    assert residual is not None and torch.allclose(residual, x - first)
    second = compression.extract(compression.compress(x, info))
    assert not torch.equal(first, second)  # the second round carries the first round's error
    # Replies (no key) are encoded plainly and leave the residuals alone.
    compression.compress(x, CompressionInfo.from_tensor(x))
    assert len(compression.error_feedback) == 1


def test_core_modules_do_not_import_hivemind() -> None:
    core_dir = Path(p2p_diloco.core.__file__).parent
    assert not (core_dir / "hivemind_codecs.py").exists(), "the adapter lives in swarm/, where hivemind is"
    for path in sorted(core_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "hivemind" for n in names), f"{path.name} imports hivemind"
            assert not any(n.endswith("hivemind_codecs") for n in names), f"{path.name} imports the adapter"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_real_allreduce_between_two_averagers(restore_hivemind_table: None) -> None:
    """Two averagers on localhost average through the installed int8 codec, parts split mid-block."""
    import hivemind
    from hivemind.averaging import DecentralizedAverager

    compression = CodecCompression("int8", block_size=128)
    install(compression)  # before the averagers start: their processes are forked from this one
    first = [_randn(3000, seed=1), _randn(50, 7, seed=2)]
    second = [_randn(3000, seed=3), _randn(50, 7, seed=4)]
    exact = [(x + y) / 2 for x, y in zip(first, second, strict=True)]
    dhts: list[hivemind.DHT] = []
    averagers: list[DecentralizedAverager] = []
    try:
        dhts.append(hivemind.DHT(start=True))
        dhts.append(hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs(), start=True))
        for tensors, dht in zip((first, second), dhts, strict=True):
            averager = DecentralizedAverager(
                [t.clone() for t in tensors],
                dht=dht,
                prefix="core_codec_test",
                target_group_size=2,
                min_group_size=2,
                compression=compression,
                part_size_bytes=2000,
                start=True,
            )
            averagers.append(averager)
        futures = [averager.step(wait=False, timeout=30) for averager in averagers]
        assert all(future.result() is not None for future in futures)
        # One int8 rounding on the way to the reducer and one on the way back.
        bound = 2 * max(float(t.abs().max()) for t in first + second) / 254 * (1 + 2.0**-7)
        for averager in averagers:
            with averager.get_tensors() as averaged:
                for got, want in zip(averaged, exact, strict=True):
                    assert float((got - want).abs().max()) <= bound
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


# --- the sparse codecs on the wire ---------------------------------------------------------------------------


def test_sparse_parts_carry_chunk_and_k_in_the_header_and_replies_their_own_codec() -> None:
    from p2p_diloco.core.sparse import SparseAverageCodec, TopKCodec

    compression = CodecCompression("topk", chunk_size=1024, k=16, error_feedback=True, error_feedback_decay=0.9)
    assert compression.sparse and compression.error_feedback.decay == 0.9
    x = _randn(5000, seed=4)
    info = CompressionInfo.from_tensor(x, key=3)
    message = compression.compress(x, info)
    # chunk size and k travel in the header; another swarm's codec refuses it
    decoded = compression.extract(message)
    with pytest.raises(ValueError, match="codec"):
        CodecCompression("4bit").extract(message)
    assert torch.equal(decoded, TopKCodec(1024, 16).roundtrip(x))
    assert len(message.buffer) == HEADER_NBYTES + 5 * 5 + -(-80 * 10 // 8) + -(-80 * 2 // 8)
    assert compression.error_feedback.residual((3, 0)) is not None  # keyed by tensor and part
    # the reducer's reply: the aggregate's own top-k at 2 bits, no error feedback
    aggregate = (decoded + TopKCodec(1024, 16).roundtrip(_randn(5000, seed=5))) / 2
    reply = compression.compress_average(aggregate, info)
    assert torch.equal(compression.extract(reply), TopKCodec(1024, 16).roundtrip(aggregate))
    assert len(reply.buffer) == len(message.buffer)  # a reply costs what a part costs
    assert len(compression.error_feedback) == 1
    # a header cannot raise k (or change the chunk size) past what this swarm sends
    for chunk, k in ((1024, 17), (512, 16)):
        wide = CodecCompression("topk", chunk_size=chunk, k=k).compress_average(aggregate, info)
        with pytest.raises(SparsePartError, match="more than k entries"):
            compression.extract(wide)
    # a union reply (SparseAverageCodec) is not this swarm's reply codec: refused
    union = runtime_pb2.Tensor()
    union.CopyFrom(reply)
    union.buffer = bytes(union.buffer[:3]) + bytes([_CODEC_IDS["topk-reply"]]) + struct.pack("<I", 10 << 16) + \
        SparseAverageCodec(1024).encode(aggregate)
    with pytest.raises(ValueError, match="codec"):
        compression.extract(union)
    # a reducer's own part: what a remote reducer would decode, through the same error feedback
    own = compression.own_part(x, CompressionInfo.from_tensor(x, key=7))
    assert int((own != 0).sum()) == 80 and len(compression.error_feedback) == 2
    # what the reply dropped comes back to the residual of that part, once
    residual = compression.error_feedback.residual((3, 0)).clone()
    replied = compression.extract(reply)
    credited = compression.credit_reply(3, 0, replied)
    assert credited == int(((replied == 0) & (decoded != 0)).sum()) > 0
    assert torch.equal(compression.error_feedback.residual((3, 0)), torch.where(replied == 0, residual + decoded,
                                                                                residual))
    assert compression.credit_reply(3, 0, replied) == 0  # used up
    compression.reset_residuals()
    assert len(compression.error_feedback) == 0
    assert compression.credit_reply(7, 0, own) == 0  # a reset (a rejected part) owes nothing


def _split_infos(tensors: list[torch.Tensor], part_size: int) -> list[tuple[torch.Tensor, CompressionInfo]]:
    """Parts and infos as hivemind's ``TensorPartContainer`` makes them (key = tensor index)."""
    return [(part, CompressionInfo.from_tensor(t, key=key).get_part(index, part_size))
            for key, t in enumerate(tensors) for index, part in enumerate(t.reshape(-1).split(part_size))]


def test_credit_replies_returns_what_the_reply_dropped_once_and_only_for_an_applied_round() -> None:
    import asyncio

    from p2p_diloco.swarm.round_process import _settle_credit

    shapes, part_size = [(4, 96), (200,)], 128  # parts of 128, the last of each tensor shorter
    senders = [CodecCompression("topk", chunk_size=64, k=4, error_feedback=True, error_feedback_decay=0.95)
               for _ in range(3)]
    inputs = [[_randn(*shape, seed=10 * s + i) for i, shape in enumerate(shapes)] for s in range(3)]
    parts = [_split_infos(x, part_size) for x in inputs]
    # sender 0 reduces part 1 of tensor 0 itself (own_part), every other part goes out as compress() does
    decoded = [[s.own_part(part, info) if (k, info.key, info.part_index) == (0, 0, 1)
                else s.extract(s.compress(part, info)) for part, info in p]
               for k, (s, p) in enumerate(zip(senders, parts, strict=True))]
    averaged = [torch.zeros(shape) for shape in shapes]
    replies = []
    for index, (_, info) in enumerate(parts[0]):  # every reducer answers with the aggregate's own top-k
        aggregate = sum(d[index] for d in decoded)
        reply = senders[0].extract(senders[0].compress_average(aggregate, info))
        start = info.part_index * part_size
        averaged[info.key].reshape(-1)[start:start + reply.numel()] = reply
        replies.append(reply)
    sender, sent = senders[0], decoded[0]
    before = {(info.key, info.part_index): sender.error_feedback.residual((info.key, info.part_index)).clone()
              for _, info in parts[0]}
    assert sender.credit_replies(averaged) == sum(int(((r == 0) & (d != 0)).sum())
                                                  for r, d in zip(replies, sent, strict=True)) > 0
    for (_, info), r, d in zip(parts[0], replies, sent, strict=True):
        key = (info.key, info.part_index)
        # exactly what we sent where the reply is empty; nothing where it carried the entry
        assert torch.equal(sender.error_feedback.residual(key), torch.where((r == 0) & (d != 0), before[key] + d,
                                                                            before[key]))
    after = {key: sender.error_feedback.residual(key).clone() for key in before}
    assert sender.credit_replies(averaged) == 0  # a second credit of the same round does nothing
    assert all(torch.equal(sender.error_feedback.residual(key), after[key]) for key in after)
    # the round process: a round that was not applied forgets; one that was, credits
    asyncio.run(_settle_credit(senders[1], averaged, applied=False))
    assert senders[1].credit_replies(averaged) == 0
    asyncio.run(_settle_credit(senders[2], averaged, applied=True))
    assert senders[2].credit_replies(averaged) == 0 and len(senders[2]._sent) == 0
    # a NaN reply credits nothing (the host skips that round); neither does crediting turned off
    part, info = parts[0][0]
    sender.compress(part, info)
    residual = sender.error_feedback.residual((0, 0)).clone()
    poisoned = [t.clone() for t in averaged]
    poisoned[1][0] = float("nan")
    assert sender.credit_replies(poisoned) == 0 and torch.equal(sender.error_feedback.residual((0, 0)), residual)
    off = CodecCompression("topk", chunk_size=64, k=4, error_feedback=True, credit_undelivered=False)
    off.compress(part, info)
    assert not off.credit_undelivered and off.credit_replies(averaged) == 0
    # a part sent as zeros (no work this round) owes nothing, whatever an earlier round kept for it
    sender.compress(part, info)
    sender.compress(torch.zeros_like(part), info)
    assert sender.credit_replies(averaged) == 0


def test_zero_parts_are_sent_without_the_residual() -> None:
    compression = CodecCompression("topk", chunk_size=64, k=4, error_feedback=True)
    info = CompressionInfo.from_tensor(torch.zeros(256), key=0)
    compression.compress(_randn(256), info)
    zeros = compression.compress(torch.zeros(256), info)
    assert not bool(compression.extract(zeros).any())  # a member without work in a region sends zeros


def test_hostile_sparse_parts_fail_to_extract_with_their_reason() -> None:
    compression = CodecCompression("topk", chunk_size=64, k=4)
    x = _randn(64)
    message = compression.compress(x, CompressionInfo.from_tensor(x))
    message.buffer = message.buffer + b"\0"
    with pytest.raises(ValueError, match="declared size disagrees"):
        compression.extract(message)
    bad = bytearray(compression.compress(x, CompressionInfo.from_tensor(x)).buffer)
    bad[HEADER_NBYTES] = 9  # count of the only chunk: 9 > k
    message.buffer = bytes(bad)
    with pytest.raises(ValueError, match="more than k entries"):
        compression.extract(message)
    bad = bytearray(message.buffer)
    bad[5] = 40  # header: k = 40 of a chunk of 2**0: not a valid sparse parameter
    bad[6] = 0
    message.buffer = bytes(bad)
    with pytest.raises(ValueError, match="invalid"):
        compression.extract(message)
