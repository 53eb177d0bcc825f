"""Wire fuzzer: genuine messages, every field mutated, through the real decode and check path (issue 51).

Messages: parts and replies of every wire compression (``hivemind_codecs.wire_compression``: hivemind's
``none``/``fp16``, ours for the rest) through ``runner.decode_part`` and the reducer's ``check_part``, replies
through ``runner._count_received`` and the reply check; the codecs' decoders themselves; state manifests
(``state.check_state_metadata``), chunk and manifest requests as a donor serves them and answers as a joiner
fetches them (``chunk_transfer``), msgpack length claims in every msgpack reader; signed join
metadata (``claims.open_gather``, ``access.epoch_mismatch``, ``group.decode_gather``); progress and checksum
records as a node receives them (``signing.RecordGuard``) and reads them (``records``); completion reports
(``completion.judge``). Fields mutated: buffer bytes, header (magic, version, codec id, parameter), dtype,
shape (extra, huge, many dimensions), ``requires_grad``, the compression enum, lengths, NaN/inf/largest-scale
payloads, and each message's protobuf or msgpack fields.

Asserted: nothing raises out of a handler beyond the documented ``ValueError`` or refusal; whatever is
accepted lies within its documented bounds (shape, float32, finite, at most ``k`` entries per chunk, signed
content unchanged); a decoder is reached only once the wire check pinned the shape and capped the bytes, and a
decoder allocates for the shape its caller expects, never for one the payload claims (numpy's allocations
traced); no accepted tensor carries autograd state.

Reproducing a failure: the seed is printed with it (captured stdout); run
``WIRE_FUZZ_SEED=<seed> pytest tests/unit/test_wire_fuzz.py``. Hypothesis also prints the falsifying example.
With ``CI`` set the seed is 0, so every CI run tries the same inputs; elsewhere each run draws a new seed.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import os
import random
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.compression import CompressionInfo, Float16Compression, NoCompression, serialize_torch_tensor
from hivemind.compression import serialization as hivemind_serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import ValueWithExpiration
from hivemind.utils.asyncio import as_aiter
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import HealthCheck, assume, event, given, seed, settings
from hypothesis import strategies as st

from p2p_diloco.core.chunks import ChunkMap
from p2p_diloco.core.codecs import get_codec
from p2p_diloco.core.evidence import plausible_epoch
from p2p_diloco.core.sparse import SparseAverageCodec, TopKCodec
from p2p_diloco.swarm import chunk_transfer
from p2p_diloco.swarm.access import epoch_mismatch
from p2p_diloco.swarm.checksum import combine_state_sha, tensor_manifest
from p2p_diloco.swarm.chunk_transfer import (
    MANIFEST,
    ChunkFetcher,
    ChunkServer,
    ServingCounters,
    decode_request,
    encode_request,
    read_chunk,
    state_chunk_map,
)
from p2p_diloco.swarm.claims import open_gather, sign_gather
from p2p_diloco.swarm.completion import BLOCK as BLOCK_VALUES
from p2p_diloco.swarm.completion import DIGEST_VALUES, CheckLayout, judge, make_block, received_digest
from p2p_diloco.swarm.group import MemberInfo, decode_gather, encode_gather
from p2p_diloco.swarm.hivemind_codecs import HEADER_NBYTES, HIVEMIND_SLOT, CodecCompression, install
from p2p_diloco.swarm.protocol import PROTOCOL_VERSION
from p2p_diloco.swarm.records import (
    PeerProgress,
    ProgressSchema,
    _parse_checksum,
    _parse_progress,
    checksum_key,
    progress_key,
)
from p2p_diloco.swarm.reducer import check_part
from p2p_diloco.swarm.runner import (
    _WIRE_SLACK_BYTES,
    MAX_WIRE_BYTES_PER_VALUE,
    ByteCounter,
    _count_received,
    _Replies,
    decode_part,
)
from p2p_diloco.swarm.signing import RecordGuard, Rejection, peer_id_of_public_key, signed_subkey
from p2p_diloco.swarm.state import check_state_metadata, make_state_metadata

SEED = int(os.environ.get("WIRE_FUZZ_SEED") or (0 if os.environ.get("CI") else random.SystemRandom().getrandbits(32)))
_SETTINGS = settings(max_examples=60, deadline=None, database=None, print_blob=True,
                     suppress_health_check=list(HealthCheck))


def fuzz(examples: int = 60) -> Callable[[Any], Any]:
    """``@given``-wrapped test, run ``examples`` times under this module's :data:`SEED`."""
    def wrap(test: Any) -> Any:
        return seed(SEED)(settings(_SETTINGS, max_examples=examples)(test))
    return wrap


@pytest.fixture(autouse=True)
def _print_seed() -> None:
    print(f"wire fuzzer seed {SEED}: reproduce with WIRE_FUZZ_SEED={SEED} pytest tests/unit/test_wire_fuzz.py")


@pytest.fixture(autouse=True)
def _restore_hivemind_table() -> Iterator[None]:
    original = hivemind_serialization._BASE_COMPRESSION_TYPES[HIVEMIND_SLOT]
    yield
    hivemind_serialization._BASE_COMPRESSION_TYPES[HIVEMIND_SLOT] = original


# ------------------------------------------------------------------ parts and replies

CHUNK, K, BLOCK = 64, 4, 32
WIRE_NAMES = ("none", "fp16", "int8", "4bit", "2bit", "topk", "topk-sign")
HIVEMIND_DECODER_ERRORS: dict[str, tuple[type[Exception], ...]] = {}
"""Exceptions a decoder may raise out of ``runner.decode_part``, per codec: none (``wire_part_problem`` pins the
dtype and ``decode_part`` refuses whatever its decoder raises)."""


def _compression(name: str) -> Any:
    """What ``wire_compression`` gives a run of ``name``, at small blocks and chunks so parts span several."""
    if name == "none":
        return NoCompression()
    if name == "fp16":
        return Float16Compression()
    return CodecCompression(name, block_size=BLOCK, chunk_size=CHUNK, k=K)


def _genuine(name: str, compression: Any, values: torch.Tensor, reply: bool) -> runtime_pb2.Tensor:
    if isinstance(compression, CodecCompression):
        info = CompressionInfo.from_tensor(values, key=0)
        return compression.compress_average(values, info) if reply else compression.compress(values, info)
    return serialize_torch_tensor(values, compression.compression_type)


_NONFINITE = [struct.pack("<f", float("nan")), struct.pack("<f", float("inf")), struct.pack("<f", -float("inf")),
              b"\x00\x7e", b"\x00\x7c", b"\xc0\x7f", b"\x80\x7f", b"\x7f\x7f", b"\xff\x7f\x7f\x7f"]
"""NaN and inf as fp32, fp16 and bf16, bf16's largest finite value (a block scale) and fp32's largest."""
_DTYPES = ["float32", "float16", "bfloat16", "float64", "int64", "int8", "uint8", "bool", "complex64", "",
           "garbage", "object", "S4", "V4"]
_PARAMS = [0, 1, BLOCK, 64, 128, 1 << 16, 6 << 16 | K, 6 << 16 | (K + 1), 6 << 16, 12 << 16 | 64, 3 << 16 | 1,
           16 << 16 | 1, 0xFFFFFFFF]

byte_mutation = st.one_of(
    st.tuples(st.just("byte"), st.integers(0, 1 << 16), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 16)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=64)),
)
"""A byte of a buffer overwritten, the buffer cut or extended."""
payload_mutation = byte_mutation | st.tuples(st.just("nonfinite"), st.integers(0, 1 << 16), st.sampled_from(_NONFINITE))
mutation = st.one_of(
    payload_mutation,
    st.tuples(st.just("magic"), st.binary(min_size=2, max_size=2)),
    st.tuples(st.just("version"), st.integers(0, 255)),
    st.tuples(st.just("codec"), st.integers(0, 12)),
    st.tuples(st.just("param"), st.one_of(st.sampled_from(_PARAMS), st.integers(0, 0xFFFFFFFF))),
    st.tuples(st.just("dtype"), st.sampled_from(_DTYPES)),
    st.tuples(st.just("size"), st.lists(st.one_of(st.integers(0, 300), st.just(2**31), st.just(2**32 - 1)),
                                        max_size=9)),
    st.tuples(st.just("requires_grad"), st.booleans()),
    st.tuples(st.just("compression"), st.sampled_from(runtime_pb2.CompressionType.values())),
)


def _mutate(message: runtime_pb2.Tensor, mutations: list[tuple]) -> runtime_pb2.Tensor:
    hostile = runtime_pb2.Tensor()
    hostile.CopyFrom(message)
    buffer = bytearray(hostile.buffer)
    for kind, *args in mutations:
        if kind == "byte" and buffer:
            buffer[args[0] % len(buffer)] = args[1]
        elif kind == "truncate":
            del buffer[args[0] % (len(buffer) + 1):]
        elif kind == "extend":
            buffer += args[0]
        elif kind == "nonfinite" and buffer:
            at = args[0] % len(buffer)
            buffer[at:at + len(args[1])] = args[1]
        elif kind == "magic" and len(buffer) >= 2:
            buffer[0:2] = args[0]
        elif kind == "version" and len(buffer) >= 3:
            buffer[2] = args[0]
        elif kind == "codec" and len(buffer) >= 4:
            buffer[3] = args[0]
        elif kind == "param" and len(buffer) >= HEADER_NBYTES:
            buffer[4:8] = struct.pack("<I", args[0])
        elif kind == "dtype":
            hostile.dtype = args[0]
        elif kind == "size":
            del hostile.size[:]
            hostile.size.extend(args[0])
        elif kind == "requires_grad":
            hostile.requires_grad = args[0]
        elif kind == "compression":
            hostile.compression = args[0]
    hostile.buffer = bytes(buffer)
    return hostile


def _check_accepted(name: str, tensor: torch.Tensor, shape: tuple[int, ...], message: runtime_pb2.Tensor) -> None:
    """What the reducer (parts) and the reply check (replies) let through lies within the documented bounds."""
    assert tuple(tensor.shape) == shape and tensor.dtype == torch.float32
    assert bool(torch.isfinite(tensor).all())
    assert not tensor.requires_grad and tensor.grad_fn is None
    if name in ("topk", "topk-sign") and message.buffer[3:4] != bytes([len(WIRE_NAMES)]):  # not a union reply
        chunks = torch.nn.functional.pad(tensor.reshape(-1), (0, -tensor.numel() % CHUNK)).view(-1, CHUNK)
        assert int((chunks != 0).sum(dim=1).max()) <= K, "a sparse part with more than k entries in a chunk"


class _DecodeSpy:
    """Stands in for hivemind's ``deserialize_torch_tensor`` in the runner: asserts that nothing reaches a
    decoder before the wire check pinned its shape, capped its bytes and refused autograd state."""

    def __init__(self, shapes: list[tuple[int, ...]], compression_type: int) -> None:
        self.shapes, self.compression_type, self.calls = shapes, compression_type, 0
        self._real = hivemind_serialization.deserialize_torch_tensor

    def __call__(self, part: runtime_pb2.Tensor) -> torch.Tensor:
        assert tuple(part.size) in self.shapes, f"decoded a part of claimed shape {tuple(part.size)[:9]}"
        numel = int(np.prod(tuple(part.size)))
        assert len(part.buffer) <= numel * MAX_WIRE_BYTES_PER_VALUE + _WIRE_SLACK_BYTES
        assert not part.requires_grad and part.compression == self.compression_type and part.dtype == "float32"
        self.calls += 1
        return self._real(part)


def _traced_peak(work: Callable[[], Any]) -> tuple[Any, int]:
    """``work()`` (or the exception it raised) and the peak of numpy's allocations meanwhile."""
    tracemalloc.start()
    try:
        try:
            result: Any = work()
        except Exception as e:  # noqa: BLE001 - judged by the caller
            result = e
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@fuzz(examples=300)
@given(name=st.sampled_from(WIRE_NAMES), reply=st.booleans(), numel=st.integers(1, 300),
       values=st.sampled_from(["normal", "tiny", "huge", "zeros", "sparse"]),
       mutations=st.lists(mutation, max_size=4))
def test_a_mutated_part_or_reply_is_refused_or_within_bounds(name: str, reply: bool, numel: int, values: str,
                                                            mutations: list[tuple]) -> None:
    """A reducer's receive path: ``decode_part`` (wire check, then the decoder), then ``check_part``."""
    compression = _compression(name)
    if isinstance(compression, CodecCompression):
        install(compression)  # the receiving peer's decoder, as run_peer installs it
    shape = (numel,)
    x = {"normal": torch.randn(numel), "tiny": torch.randn(numel) * 1e-30, "huge": torch.randn(numel) * 1e37,
         "zeros": torch.zeros(numel), "sparse": torch.zeros(numel).index_fill_(0, torch.tensor([numel // 2]), 3.0)}[values]
    message = _mutate(_genuine(name, compression, x, reply), mutations)
    spy = _DecodeSpy([shape], compression.compression_type)
    with mock.patch("p2p_diloco.swarm.runner.deserialize_torch_tensor", spy):
        outcome, peak = _traced_peak(lambda: decode_part(message, shape, compression.compression_type, torch.float32))
    if isinstance(outcome, Exception):  # decode_part refuses, it never raises
        assert isinstance(outcome, HIVEMIND_DECODER_ERRORS.get(name, ())), repr(outcome)
        return
    part, problem = outcome
    assert peak <= 64 * (numel * 4 + len(message.buffer)) + (1 << 20), f"{peak} bytes for {numel} values"
    if problem is not None:
        assert part.numel() == 0
        return
    if check_part(part, torch.Size(shape), torch.float32) is None:  # the reducer's (and the reply check's) test
        _check_accepted(name, part, shape, message)


@fuzz(examples=100)
@given(name=st.sampled_from(WIRE_NAMES), sizes=st.lists(st.integers(1, 150), min_size=1, max_size=3),
       extra=st.integers(0, 2), codes=st.lists(st.sampled_from(averaging_pb2.MessageCode.values()), max_size=2),
       mutations=st.lists(st.tuples(st.integers(0, 5), mutation), max_size=3))
def test_a_reducers_mutated_replies_are_refused_or_within_bounds(name: str, sizes: list[int], extra: int,
                                                                codes: list[int], mutations: list[tuple]) -> None:
    """A sender's receive path for a reducer's replies: ``_count_received`` (wire check, count), hivemind's
    deserialization (any failure: the reducer failed), then the reply check (``verify.AverageCheck``)."""
    compression = _compression(name)
    if isinstance(compression, CodecCompression):
        install(compression)
    shapes = tuple((n,) for n in sizes)
    messages = [averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART,
                                            tensor_part=_genuine(name, compression, torch.randn(n), True))
                for n in sizes + sizes[:1] * extra]  # a reducer may send more parts than expected
    messages += [averaging_pb2.AveragingData(code=code) for code in codes]
    for index, change in mutations:
        if index < len(messages):
            messages[index].tensor_part.CopyFrom(_mutate(messages[index].tensor_part, [change]))
    replies = _Replies(expected=len(shapes), shapes=shapes, compression_type=compression.compression_type)

    async def receive() -> list[averaging_pb2.AveragingData]:
        got = []
        try:
            async for message in _count_received(as_aiter(*messages), ByteCounter(), replies):
                got.append(message)
        except ValueError:
            pass  # documented: the reducer's part was refused on the wire, the reducer failed
        return got

    received = asyncio.run(receive())
    for index, message in enumerate(received):
        if message.code != averaging_pb2.AVERAGED_PART:
            continue  # hivemind's reply loop ends the reducer on any other code
        assert index < len(shapes), "more replies than parts were passed on"
        try:
            part = hivemind_serialization.deserialize_torch_tensor(message.tensor_part)
        except Exception:  # noqa: BLE001 - hivemind's reply loop counts the reducer as failed
            continue
        if check_part(part, torch.Size(shapes[index]), torch.float32) is None:
            _check_accepted(name, part, shapes[index], message.tensor_part)


UNREACHABLE_SHAPES_LEFT_OUT = False
"""Whether shapes whose dimensions multiply past 2^62 are left out: ``core.codec_base._numel`` refuses them, so
they are fuzzed too."""


@fuzz(examples=300)
@given(codec=st.sampled_from(["none", "fp16", "int8", "4bit", "2bit", "topk", "topk-sign", "union"]),
       numel=st.integers(0, 300), mutations=st.lists(payload_mutation, max_size=3),
       claim=st.one_of(st.none(), st.lists(st.one_of(st.integers(-3, 300), st.just(2**26), st.just(2**62)),
                                           max_size=12)))
def test_every_decoder_refuses_with_value_error_or_decodes_within_bounds(codec: str, numel: int,
                                                                       mutations: list[tuple],
                                                                       claim: list[int] | None) -> None:
    """The codecs' own decoders, given a mutated genuine payload and the shape the caller expects (or any):
    ValueError naming the fault, or a finite float32 tensor of that shape within the codec's bounds; numpy
    allocates for the expected shape only (a payload's own counts never size an allocation)."""
    decoder = SparseAverageCodec(CHUNK) if codec == "union" else get_codec(codec, BLOCK, chunk_size=CHUNK, k=K)
    x = torch.randn(numel) * torch.randint(0, 2, (numel,))
    data = _mutate(runtime_pb2.Tensor(buffer=decoder.encode(x)), mutations).buffer
    shape = (numel,) if claim is None else tuple(claim)
    if UNREACHABLE_SHAPES_LEFT_OUT:
        assume(math.prod(max(d, 1) for d in shape) < 2**62)
    out, peak = _traced_peak(lambda: decoder.decode(data, shape))
    if isinstance(out, Exception):
        assert isinstance(out, ValueError), repr(out)
        assert peak <= 64 * len(data) + (1 << 20), f"{peak} bytes allocated to refuse {len(data)} bytes"
        return
    assert tuple(out.shape) == shape and out.dtype == torch.float32 and not out.requires_grad
    # (a shape of no values may still have dimensions too large for torch to compute strides of: nothing to read)
    assert out.numel() == 0 or bool(torch.isfinite(out).all()), "finite bytes decoded to NaN or inf"
    assert peak <= 64 * (out.numel() * 4 + len(data)) + (1 << 20)
    if isinstance(decoder, TopKCodec) and out.numel():
        chunks = torch.nn.functional.pad(out.reshape(-1), (0, -out.numel() % CHUNK)).view(-1, CHUNK)
        assert int((chunks != 0).sum(dim=1).max()) <= K


def test_int8_at_bf16s_largest_scale_is_refused_not_decoded_to_inf() -> None:
    """Finding 6: a code of 127 at the largest finite bf16 scale (0x7F7F) overflowed fp32 to inf."""
    payload = struct.pack("<H", 0x7F7F) + bytes([127, 0, 0, 0])
    with pytest.raises(ValueError, match="infinite"):
        get_codec("int8", 4).decode(payload, [4])
    assert bool(torch.isfinite(get_codec("int8", 4).decode(struct.pack("<H", 0x7F7F) + bytes([1, 0, 0, 0]),
                                                           [4])).all())  # the same scale, a finite product


def test_a_union_reply_at_the_largest_scale_is_refused_not_decoded_to_inf() -> None:
    """Finding 6: the union reply's int8 values times a chunk scale of 0x7F7F overflowed fp32 to inf."""
    # offsets coding, one entry (offset 0) in the one chunk of 16 values, scale 0x7F7F, code 127
    payload = bytes([0]) + struct.pack("<H", 1) + struct.pack("<H", 0x7F7F) + bytes([0]) + bytes([127])
    with pytest.raises(ValueError, match="infinite"):
        SparseAverageCodec(16).decode(payload, [16])


@pytest.mark.parametrize("decoder", [TopKCodec(CHUNK, K), TopKCodec(CHUNK, K, signs_only=True),
                                     SparseAverageCodec(CHUNK)], ids=["topk", "topk-sign", "union"])
def test_a_sparse_decoder_refuses_a_huge_shape_before_allocating_for_it(decoder: Any) -> None:
    """Finding 6 (allocation): the chunk table was built for the claimed shape before the bytes were checked
    (2^60 values: MemoryError out of the decoder; 2^26 values in chunks of 64: 8 MB allocated to refuse 10 bytes)."""
    for shape in ([2**60], [2**31 - 1] * 3, [2**26]):
        out, peak = _traced_peak(lambda shape=shape: decoder.decode(b"\x00" * 10, shape))
        assert isinstance(out, ValueError) and peak < (64 << 10), (shape, out, peak)


# ------------------------------------------------------------------ state manifests, chunk requests and answers

_STATE = [torch.arange(40, dtype=torch.float32), torch.ones(24)]
_LAYOUTS = ([(t.dtype, tuple(t.shape)) for t in _STATE], [(t.dtype, tuple(t.shape)) for t in _STATE])
_SMALL_CHUNKS = 64  # bytes: the small state spans several chunks


def _small_chunk_map(tensors: list[torch.Tensor], n_params: int) -> ChunkMap:
    sizes = [t.numel() * t.element_size() for t in tensors]
    return ChunkMap([sizes[:n_params], sizes[n_params:]], chunk_bytes=_SMALL_CHUNKS)


_MANIFEST_CHUNKS = state_chunk_map(_STATE + _STATE, 2)
_FP = "abcdef0123456789"


def _honest_manifest() -> bytes:
    manifest = tensor_manifest(_STATE)
    return MSGPackSerializer.dumps(make_state_metadata("run", _FP, 4, combine_state_sha(manifest.sha, manifest.sha),
                                                       manifest, manifest, 2, 2))


@fuzz(examples=100)
@given(mutations=st.lists(byte_mutation, min_size=1,
                          max_size=3))
def test_a_mutated_state_manifest_is_the_honest_one_or_refused(mutations: list[tuple]) -> None:
    honest = _honest_manifest()
    raw = _mutate(runtime_pb2.Tensor(buffer=honest), mutations).buffer
    meta = check_state_metadata(raw, "run", _FP, _LAYOUTS, _MANIFEST_CHUNKS)
    if isinstance(meta, dict):
        # the epoch is the donor's claim (voted on by the joiner, not bound to the bytes); all else is ours or
        # tied to the digest
        assert plausible_epoch(meta["ep"])
        expected = check_state_metadata(honest, "run", _FP, _LAYOUTS, _MANIFEST_CHUNKS)
        assert {**meta, "ep": None} == {**expected, "ep": None}


@fuzz(examples=60)
@given(raw=st.binary(max_size=80), sha=st.one_of(st.none(), st.binary(min_size=32, max_size=32).map(bytes.hex)),
       index=st.integers(0, 2**32 - 1))
def test_chunk_requests_decode_or_are_ignored(raw: bytes, sha: str | None, index: int) -> None:
    parsed = decode_request(raw)
    assert parsed is None or (len(parsed[0]) == 64 and 0 <= parsed[1] < 2**32)
    assert decode_request(encode_request(sha, index)) == (sha or "00" * 32, index)


class _Stub:
    """A donor that answers each request with ``answer(request index)``."""

    def __init__(self, answer: Callable[[int], list[averaging_pb2.DownloadData]]) -> None:
        self.answer = answer

    async def rpc_state_chunk(self, request: averaging_pb2.DownloadData) -> Any:
        return as_aiter(*self.answer(decode_request(request.metadata)[1]))


class _Future:
    def __init__(self) -> None:
        self.result: Any = None

    def set_result(self, value: Any) -> None:
        self.result = value

    def set_exception(self, error: BaseException) -> None:
        raise AssertionError(f"the fetch failed instead of dropping its donors: {error!r}")


_answer = st.one_of(st.just("honest"), st.just("nothing"), st.tuples(st.just("flip"), st.integers(0, 1 << 10)),
                    st.tuples(st.just("cut"), st.integers(0, 200)), st.tuples(st.just("pad"), st.integers(1, 300)),
                    st.tuples(st.just("split"), st.integers(1, 70)), st.tuples(st.just("meta"), st.integers(1, 99)))


def _donor_answer(behaviour: Any, data: bytes) -> list[averaging_pb2.DownloadData]:
    def part(buffer: bytes) -> averaging_pb2.DownloadData:
        return averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=buffer))
    kind, arg = (behaviour, 0) if isinstance(behaviour, str) else behaviour
    if kind == "nothing":
        return []
    if kind == "flip":
        at = arg % len(data)
        return [part(data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])]
    if kind == "cut":
        return [part(data[:arg % len(data)])]
    if kind == "pad":
        return [part(data + bytes(arg))]
    if kind == "split":
        return [part(data[i:i + arg]) for i in range(0, len(data), arg)]
    if kind == "meta":
        return [averaging_pb2.DownloadData(metadata=bytes(arg)), part(data)]
    return [part(data)]


@fuzz(examples=40)
@given(behaviours=st.lists(st.lists(_answer, min_size=1, max_size=4), min_size=1, max_size=3))
def test_chunks_from_hostile_donors_are_written_only_when_they_match_their_digest(
        behaviours: list[list[Any]]) -> None:
    """The joiner's chunk fetch against donors that flip, cut, pad, split or pad with metadata their answers:
    each answer is capped at its chunk's length, only chunks that match their digest reach the destination,
    the others stay as they were, and the fetch ends with a result (never an exception)."""
    source = _STATE + [t * 3 for t in _STATE]
    chunks = _small_chunk_map(source, 2)
    views = [t.reshape(-1).view(torch.uint8).numpy() for t in source]
    truth = [read_chunk(views, chunks, i) for i in range(chunks.count)]
    digests = b"".join(hashlib.sha256(c).digest() for c in truth)
    donors = {f"donor{i}": answers for i, answers in enumerate(behaviours)}
    asked: dict[str, int] = {}

    def stub(peer: str) -> _Stub:
        def answer(index: int) -> list[averaging_pb2.DownloadData]:
            turn = asked[peer] = asked.get(peer, -1) + 1
            answers = donors[peer]
            return _donor_answer(answers[turn % len(answers)], truth[index])
        return _Stub(answer)

    dest = [torch.full_like(t, -1.0) for t in source]
    future = _Future()
    with mock.patch.object(chunk_transfer, "state_chunk_map", _small_chunk_map):
        asyncio.run(ChunkFetcher(stub, next_chunk_timeout=2.0).fetch_chunks(
            list(donors), "ab" * 32, dest, 2, digests, [], None, 10.0, future))
    done = set(future.result["done"])
    got = [read_chunk([t.reshape(-1).view(torch.uint8).numpy() for t in dest], chunks, i) for i in range(chunks.count)]
    for index in range(chunks.count):
        if index in done:
            assert got[index] == truth[index]
        else:
            assert set(got[index]) <= set(torch.tensor([-1.0]).view(torch.uint8).tolist())  # untouched
    if all(b == ["honest"] for b in behaviours):
        assert done == set(range(chunks.count))


@fuzz(examples=40)
@given(sizes=st.lists(st.integers(0, 300), max_size=6), meta=st.lists(st.integers(0, 300), max_size=3),
       cap=st.integers(1, 600))
def test_an_answer_is_read_only_up_to_its_cap(sizes: list[int], meta: list[int], cap: int) -> None:
    """``ChunkFetcher.request``: a donor's answer larger than the asked-for bytes is refused while it streams."""
    messages = [averaging_pb2.DownloadData(metadata=bytes(m)) for m in meta]
    messages += [averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=bytes(n))) for n in sizes]
    fetcher = ChunkFetcher(lambda peer: _Stub(lambda index: messages), next_chunk_timeout=2.0)
    try:
        metadata, data = asyncio.run(fetcher.request("donor", None, 0, cap))
    except ValueError:
        assert sum(meta) + sum(sizes) > cap or sum(meta) + sum(sizes) == 0
        return
    assert len(metadata) + len(data) <= cap


@functools.cache
def _donor() -> tuple[ChunkServer, dict, list[torch.Tensor]]:
    """A donor's chunk server over the small state, live (a manifest request never waits for a republication)."""
    counters = ServingCounters()
    counters.live.value = True
    tensors = [t.clone() for t in _STATE + _STATE]
    manifest = tensor_manifest(_STATE)
    meta = make_state_metadata("run", _FP, 4, combine_state_sha(manifest.sha, manifest.sha), manifest, manifest, 2, 2)

    async def host_state() -> tuple[bytes, list[torch.Tensor], None]:
        return MSGPackSerializer.dumps({"s": meta}), tensors, None

    return ChunkServer(counters, host_state, lambda: True, lambda stage: None), meta, tensors


@fuzz(examples=60)
@given(raw=st.one_of(st.sampled_from([("state", 0), ("state", 1), ("any", MANIFEST), ("state", 2), ("any", 0),
                                      ("state", MANIFEST), ("other", 0), ("other", MANIFEST)]),
                     st.tuples(st.sampled_from(["state", "any", "other"]), st.integers(0, 2**32 - 1)),
                     st.binary(max_size=80)))
def test_a_donor_answers_a_hostile_request_with_what_it_names_or_nothing(raw: bytes | tuple[str, int]) -> None:
    """The donor's handler of ``rpc_state_chunk``: any request bytes; it never raises, answers a manifest only
    for a digest it serves one under, a chunk only of the state it serves and exactly that chunk's bytes."""
    server, meta, tensors = _donor()
    if isinstance(raw, tuple):
        digest = {"state": meta["sha"], "any": None, "other": "cd" * 32}[raw[0]]
        raw = encode_request(digest, raw[1])

    async def ask() -> list[averaging_pb2.DownloadData]:
        return [message async for message in server.serve(averaging_pb2.DownloadData(metadata=raw))]

    answer = asyncio.run(ask())
    assert server.counters.streams_open.value == 0
    parsed = decode_request(raw)
    event("answered" if answer else "not answered")
    if not answer:
        return
    assert parsed is not None
    sha, index = parsed
    chunks = state_chunk_map(tensors, 2)
    if index == MANIFEST:
        assert sha == "00" * 32 and [m.metadata for m in answer] == [MSGPackSerializer.dumps(meta)]
    else:
        assert sha == meta["sha"] and index < chunks.count
        views = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors]
        assert b"".join(m.tensor_part.buffer for m in answer) == read_chunk(views, chunks, index)


# ------------------------------------------------------------------ join requests (signed group metadata)

KEYS = [RSAPrivateKey(), RSAPrivateKey()]
PEERS = [peer_id_of_public_key(k.get_public_key().to_bytes()) for k in KEYS]


def _inner(epoch: int = 3) -> bytes:
    info = MemberInfo.for_round("run", _FP, epoch, 2.0, 0.0, 0, True, False, norm=1.5, stale_norm=0.0)
    return encode_gather(None, AveragingMode.NODE, info)


@fuzz(examples=80)
@given(mutations=st.lists(byte_mutation, max_size=3),
       signer=st.integers(0, 1), member=st.integers(0, 1), inner_epoch=st.integers(0, 10))
def test_join_metadata_is_accepted_only_as_its_member_signed_it(mutations: list[tuple], signer: int, member: int,
                                                                inner_epoch: int) -> None:
    inner = _inner(inner_epoch)
    raw = _mutate(runtime_pb2.Tensor(buffer=sign_gather(inner, KEYS[signer])), mutations).buffer
    opened = open_gather(raw, PEERS[member])
    if isinstance(opened, bytes):
        assert opened == inner and signer == member
        _, mode, info = decode_gather(opened)
        assert info.epoch == inner_epoch and mode == AveragingMode.NODE
    else:
        assert isinstance(opened, str)
    matchmaking = SimpleNamespace(step_control=SimpleNamespace(data_for_gather=sign_gather(_inner(3), KEYS[0])))
    verdict = epoch_mismatch(raw, matchmaking)  # a join request's check, before anything is signed-checked
    assert verdict is None or isinstance(verdict, str)


_MSGPACK_CLAIMS = [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
                   b"\xc9\xff\xff\xff\xff\x05", b"\x93\xdd\x7f\xff\xff\xff", b"\x93\xc4\x05ab"]
"""msgpack headers that claim a container, string, binary or extension of 2^32 - 1 elements or bytes."""


@fuzz(examples=40)
@given(claim=st.sampled_from(_MSGPACK_CLAIMS), tail=st.binary(max_size=100))
def test_a_msgpack_length_claim_sizes_no_allocation(claim: bytes, tail: bytes) -> None:
    """Every msgpack reader of network bytes (a manifest, join metadata signed or not) refuses a length claim
    its bytes cannot hold without allocating for it."""
    raw = claim + tail
    readers = (lambda: check_state_metadata(raw, "run", _FP, _LAYOUTS, _MANIFEST_CHUNKS),
               lambda: open_gather(raw, PEERS[0]), lambda: decode_gather(raw),
               lambda: open_gather(MSGPackSerializer.dumps([raw, raw, raw]), PEERS[0]))
    for read in readers:
        out, peak = _traced_peak(read)
        assert isinstance(out, (str, ValueError)), repr(out)
        assert peak < (1 << 20), f"{peak} bytes allocated to read {len(raw)} bytes (the claim: 4 GiB)"


# ------------------------------------------------------------------ progress and checksum records

RUN = "run"
GUARD = RecordGuard(schemas=[SchemaValidator(ProgressSchema, prefix=RUN)], signed_keys=[progress_key(RUN)])


def _signed_record(key: str, value: Any, expiration: float) -> DHTRecord:
    subkey = MSGPackSerializer.dumps(signed_subkey(PEERS[0], KEYS[0]))
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), subkey, MSGPackSerializer.dumps(value), expiration)
    return DHTRecord(record.key, record.subkey, RSASignatureValidator(KEYS[0]).sign_value(record), expiration)


@fuzz(examples=100)
@given(kind=st.sampled_from(["progress", "checksum"]), field=st.sampled_from(["key", "subkey", "value"]),
       mutations=st.lists(byte_mutation, min_size=1,
                          max_size=3),
       expiration=st.one_of(st.just(0.0), st.floats(allow_nan=True)))
def test_a_mutated_signed_record_is_refused_or_unchanged(kind: str, field: str, mutations: list[tuple],
                                                        expiration: float) -> None:
    """A node's receive check (``RecordGuard``) then the reader's parse: whatever is accepted under our keys
    is exactly what its owner signed."""
    now = 1000.0
    if kind == "progress":
        value = dict(epoch=2, inner_step=5, steps_per_s=1.0, samples_per_s=1.0, tokens_per_s=1.0, fingerprint=_FP,
                     time=now, client_mode=False, phase_s=0.0, protocol=PROTOCOL_VERSION)
        key = progress_key(RUN)
    else:
        value, key = "a" * 64, checksum_key(RUN, 2)
    original = _signed_record(key, value, now + 60.0)
    fields = {"key": original.key, "subkey": original.subkey, "value": original.value}
    fields[field] = _mutate(runtime_pb2.Tensor(buffer=fields[field]), mutations).buffer
    chosen = now + 60.0 if expiration == 0.0 else expiration
    record = DHTRecord(fields["key"], fields["subkey"], fields["value"], chosen)
    verdict = GUARD.judge(record)
    assert verdict is None or isinstance(verdict, Rejection)
    if verdict is not None or record.key != original.key:
        return  # refused, or under a key none of our readers looks at
    try:  # what the DHT hands the reader: subkey and value deserialized (hivemind drops what does not load)
        subkey, stored = MSGPackSerializer.loads(record.subkey), MSGPackSerializer.loads(GUARD.strip_value(record))
    except Exception:  # noqa: BLE001
        return
    # checksum keys are per epoch, not guarded by name: a record without an owner key passes the node as
    # "not ours", and the reader refuses it
    parsed = (_parse_progress if kind == "progress" else _parse_checksum)(subkey, ValueWithExpiration(stored, chosen),
                                                                           now)
    if isinstance(parsed, Rejection) or parsed is None:
        return
    assert (record.subkey, record.value) == (original.subkey, original.value) and chosen == now + 60.0, \
        "a record whose content its owner did not sign was accepted"
    assert isinstance(parsed, PeerProgress) if kind == "progress" else parsed == (PEERS[0].to_base58(), "a" * 64)


# ------------------------------------------------------------------ completion reports

@fuzz(examples=100)
@given(members=st.integers(2, 4), clients=st.integers(0, 1),
       changes=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 200),
                                  st.sampled_from([float("nan"), float("inf"), -1.0, 0.5, 65536.0, 1e30, 0.0, 1.0,
                                                   65535.0, 7.0])), max_size=3))
def test_a_mutated_completion_report_is_confirmed_only_when_it_is_the_honest_one(
        members: int, clients: int, changes: list[tuple[int, int, float]]) -> None:
    reducers = tuple(range(members - clients))
    layout = CheckLayout(members, reducers)
    digests = [hashlib.sha256(bytes([i])).digest() if i in reducers else hashlib.sha256(b"").digest()
               for i in range(members)]
    blocks = [make_block(True, digests[i] if i in reducers else None, received_digest(digests))
              for i in range(members)]
    ranges = [torch.cat([blocks[owner] for owner in (r, *layout.clients)]) for r in reducers]
    honest = [r.clone() for r in ranges]
    for reducer, position, value in changes:
        if reducer < len(ranges):
            ranges[reducer][position % ranges[reducer].numel()] = value
    verdict = judge(layout, 0, ranges, [f"peer{i}" for i in range(members)], digests, True)
    # what each report is compared on: its status, the digest of what a reducer sent and (but for our own, which
    # only has to be a digest) the digest of all it received; a client reduces nothing, its "sent" is not read
    compared = []
    for reducer in reducers:
        mask = torch.ones(BLOCK_VALUES, dtype=torch.bool).repeat(1 + clients)
        if reducer == 0:
            mask[1 + DIGEST_VALUES:BLOCK_VALUES] = False
        for slot in range(1, 1 + clients):
            mask[slot * BLOCK_VALUES + 1: slot * BLOCK_VALUES + 1 + DIGEST_VALUES] = False
        compared.append(mask)
    if verdict.confirmed:
        assert all(torch.equal(r[m], h[m]) for r, h, m in zip(ranges, honest, compared, strict=True)), \
            "a report that is not the honest one was confirmed"
    if all(torch.equal(r, h) for r, h in zip(ranges, honest, strict=True)):
        assert verdict.confirmed, f"the honest report was not confirmed: {verdict.detail}"
