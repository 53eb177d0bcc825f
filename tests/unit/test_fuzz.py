"""Property-based fuzzing of every decoder of network (and key-file) input: arbitrary bytes and arbitrary
well-typed-but-wrong structures must end in the documented rejection, never in another exception.

Decoders covered: the core codecs' ``decode``; the hivemind adapter's ``CodecCompression.extract``; the
gathered group metadata (``group.decode_gather``, ``MemberInfo.from_wire``, and ``plan_group`` over a whole
gathered list); signed DHT records (``signing.RecordGuard`` on arbitrary and on nearly valid records,
``signing.parse_signed_subkey``); progress and checksum records as read back (``records._parse_progress``,
``records._parse_checksum``, the pydantic ``ProgressRecord`` schema); a donor's state metadata
(``state.check_state_metadata``); the reducer's per-part check (``reducer.check_part``); and the
``allowed_peers`` file.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import ValueWithExpiration
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco.core.codecs import get_codec
from p2p_diloco.swarm.checksum import combine_state_sha, tensor_manifest
from p2p_diloco.swarm.chunk_transfer import state_chunk_map
from p2p_diloco.swarm.config import read_allowed_peers
from p2p_diloco.swarm.group import MemberInfo, decode_gather, encode_gather, plan_group
from p2p_diloco.swarm.hivemind_codecs import CodecCompression
from p2p_diloco.swarm.protocol import PROTOCOL_VERSION
from p2p_diloco.swarm.records import (
    PeerProgress,
    ProgressSchema,
    _parse_checksum,
    _parse_progress,
    progress_key,
)
from p2p_diloco.swarm.reducer import check_part
from p2p_diloco.swarm.signing import (
    REJECTED_RECORD_KINDS,
    RecordGuard,
    Rejection,
    parse_signed_subkey,
    peer_id_of_public_key,
    signed_subkey,
)
from p2p_diloco.swarm.state import check_state_metadata, make_state_metadata

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FINGERPRINT = "abcdef0123456789"
PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
KEY = RSAPrivateKey()
KEY_PEER = peer_id_of_public_key(KEY.get_public_key().to_bytes())
SIGNED = signed_subkey(KEY_PEER, KEY)
GUARD = RecordGuard(schemas=[SchemaValidator(ProgressSchema, prefix="run")], signed_keys=[progress_key("run")])

# msgpack-encodable values, nested a little: what a hostile peer can put in any field
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
    st.text(max_size=20), st.binary(max_size=20),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=10)


def _valid_wire() -> dict:
    info = MemberInfo.for_round("run", FINGERPRINT, 3, 2.0, 0.0, 0, True, False, norm=1.5, stale_norm=0.0)
    return info.to_wire()


@FUZZ
@given(name=st.sampled_from(["none", "fp16", "int8", "4bit", "2bit"]), data=st.binary(max_size=600),
       shape=st.lists(st.integers(0, 40), max_size=3))
def test_codec_decode_raises_only_value_error(name: str, data: bytes, shape: list[int]) -> None:
    codec = get_codec(name)
    try:
        out = codec.decode(data, shape)
    except ValueError:
        return
    assert tuple(out.shape) == tuple(shape) and out.dtype == torch.float32


@FUZZ
@given(buffer=st.binary(max_size=300), size=st.lists(st.integers(0, 30), max_size=3),
       dtype=st.sampled_from(["float32", "float16", "bfloat16", "int64", "", "object"]),
       prefix=st.booleans())
def test_hivemind_adapter_extract_raises_only_value_error(buffer: bytes, size: list[int], dtype: str,
                                                          prefix: bool) -> None:
    compression = CodecCompression("int8")
    if prefix:  # start with a genuine header so the fuzzing reaches the payload checks
        genuine = compression.compress(torch.ones(4), _info(), allow_inplace=False)
        buffer = bytes(genuine.buffer[:16]) + buffer
    message = runtime_pb2.Tensor(buffer=buffer, size=size, dtype=dtype)
    try:
        out = compression.extract(message)
    except ValueError:
        return
    assert tuple(out.shape) == tuple(size)


def _info():
    from hivemind.compression import CompressionInfo

    return CompressionInfo.from_tensor(torch.ones(4), key=0)


@FUZZ
@given(raw=st.binary(max_size=200))
def test_decode_gather_on_random_bytes(raw: bytes) -> None:
    try:
        decode_gather(raw)
    except ValueError:
        pass


@FUZZ
@given(bandwidth=values, mode=values, user=values, mutate=st.dictionaries(
    st.sampled_from(["v", "run", "fp", "ep", "w", "sw", "st", "f", "s", "n", "sn", "extra"]), values, max_size=3))
def test_decode_gather_on_wrong_structures(bandwidth: object, mode: object, user: object, mutate: dict) -> None:
    wire = {**_valid_wire(), **mutate} if mutate else user
    try:
        raw = MSGPackSerializer.dumps([bandwidth, mode, MSGPackSerializer.dumps(wire)])
    except (TypeError, ValueError, OverflowError):
        return  # not encodable, so no peer can send it
    try:
        _, got_mode, info = decode_gather(raw)
    except ValueError:
        return
    assert got_mode in (AveragingMode.NODE, AveragingMode.CLIENT)
    assert 0 <= info.weight <= 1e12 and math.isfinite(info.weight) and info.has_fresh == (info.weight > 0)


@FUZZ
@given(obj=values)
def test_member_info_from_wire_on_anything(obj: object) -> None:
    try:
        MemberInfo.from_wire(obj)
    except ValueError:
        pass


@FUZZ
@given(garbage=st.lists(st.binary(max_size=60), min_size=1, max_size=3))
def test_plan_group_survives_garbage_members(garbage: list[bytes]) -> None:
    ids = [PeerID.from_base58(PEER)] + [PeerID(bytes([i + 1]) * 34) for i in range(len(garbage))]
    mine = encode_gather(None, AveragingMode.NODE, MemberInfo.from_wire(_valid_wire()))
    plan = plan_group(ids, [mine, *garbage], ids[0], min_group_size=2)
    assert ids[0] in plan.peer_ids and len(plan.peer_ids) + len(plan.refused) == len(ids)


def _rejected_or(parsed: object, kind: type) -> bool:
    if isinstance(parsed, Rejection):
        return parsed.kind in REJECTED_RECORD_KINDS and (parsed.owner is None or isinstance(parsed.owner, str))
    return parsed is None or isinstance(parsed, kind)


@FUZZ
@given(subkey=values, value=values, expiration=st.one_of(st.floats(allow_nan=True), st.integers(), st.none()),
       mutate=st.dictionaries(st.sampled_from(["epoch", "inner_step", "steps_per_s", "time", "fingerprint",
                                               "client_mode", "phase_s", "x"]), values, max_size=2))
def test_progress_records_parse_or_give_a_reason(subkey: object, value: object, expiration: object,
                                                 mutate: dict) -> None:
    good = dict(epoch=1, inner_step=2, steps_per_s=1.0, samples_per_s=1.0, tokens_per_s=1.0,
                fingerprint=FINGERPRINT, time=1.0, client_mode=False, phase_s=0.0, protocol=PROTOCOL_VERSION)
    record = {**good, **mutate} if mutate else value
    for key in (subkey, PEER, SIGNED, SIGNED[:-2] + b"A]", PEER.encode() + SIGNED[len(KEY_PEER.to_base58()):]):
        parsed = _parse_progress(key, ValueWithExpiration(record, expiration), now=0.0)
        assert _rejected_or(parsed, PeerProgress), parsed
        if isinstance(parsed, PeerProgress):
            assert key == SIGNED and parsed.peer_id == KEY_PEER.to_base58() and parsed.epoch >= 0
    # field names that are not strings make pydantic raise TypeError, not ValidationError: parsed, not raised
    assert _rejected_or(_parse_progress(SIGNED, ValueWithExpiration({None: 1, **good}, 1.0), now=0.0), PeerProgress)


@FUZZ
@given(subkey=values, value=values, expiration=st.one_of(st.floats(allow_nan=True), st.integers(), st.none()))
def test_checksum_records_parse_or_give_a_reason(subkey: object, value: object, expiration: object) -> None:
    for key in (subkey, SIGNED):
        for digest in (value, "a" * 64):
            parsed = _parse_checksum(key, ValueWithExpiration(digest, expiration), now=0.0)
            assert _rejected_or(parsed, tuple), parsed
            if isinstance(parsed, tuple):
                assert parsed == (KEY_PEER.to_base58(), "a" * 64)


@FUZZ
@given(key=st.one_of(st.binary(max_size=40), st.just(DHTID.generate(source=progress_key("run")).to_bytes())),
       subkey=st.one_of(st.binary(max_size=80), st.just(MSGPackSerializer.dumps(SIGNED))),
       value=st.binary(max_size=200), expiration=st.floats(allow_nan=True), sign=st.booleans())
def test_record_guard_judges_any_record(key: bytes, subkey: bytes, value: bytes, expiration: float,
                                        sign: bool) -> None:
    record = DHTRecord(key, subkey, value, expiration)
    if sign:
        record = DHTRecord(key, subkey, RSASignatureValidator(KEY).sign_value(record), expiration)
    verdict = GUARD.judge(record)
    assert verdict is None or (verdict.kind in REJECTED_RECORD_KINDS
                               and verdict.owner in (None, KEY_PEER.to_base58())), verdict
    assert GUARD.validate(record) == (verdict is None)


@FUZZ
@given(subkey=st.one_of(values, st.binary(max_size=600), st.just(SIGNED)))
def test_signed_subkeys_parse_or_give_a_reason(subkey: object) -> None:
    parsed = parse_signed_subkey(subkey)
    assert isinstance(parsed, str) or (subkey == SIGNED and parsed == (KEY_PEER.to_base58(),) * 2)


_STATE = [torch.zeros(2), torch.ones(2)]
_LAYOUTS = ([(t.dtype, tuple(t.shape)) for t in _STATE], [(t.dtype, tuple(t.shape)) for t in _STATE])
_CHUNKS = state_chunk_map(_STATE + _STATE, 2)


@FUZZ
@given(raw=st.one_of(st.none(), st.binary(max_size=120)), mutate=st.dictionaries(
    st.sampled_from(["v", "run", "fp", "ep", "sha", "np", "no", "cs", "pc", "mc", "x"]), values, max_size=3))
def test_state_metadata_is_accepted_only_when_it_is_ours(raw: bytes | None, mutate: dict) -> None:
    manifest = tensor_manifest(_STATE)
    if mutate:
        honest = make_state_metadata("run", FINGERPRINT, 4, combine_state_sha(manifest.sha, manifest.sha),
                                     manifest, manifest, 2, 2)
        try:
            raw = MSGPackSerializer.dumps({**honest, **mutate})
        except (TypeError, ValueError, OverflowError):
            return
    meta = check_state_metadata(raw, "run", FINGERPRINT, _LAYOUTS, _CHUNKS)
    if isinstance(meta, dict):
        assert meta["run"] == "run" and meta["fp"] == FINGERPRINT and meta["np"] == 2 and meta["no"] == 2
        assert meta["pc"] == meta["mc"] == manifest.chunks  # a manifest accepted is the one tied to its digest


@FUZZ
@given(values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=0, max_size=8),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.float64]))
def test_check_part_accepts_only_finite_parts_of_the_expected_layout(values: list[float],
                                                                    dtype: torch.dtype) -> None:
    part = torch.tensor(values, dtype=dtype) if values else torch.zeros(0, dtype=dtype)
    problem = check_part(part, torch.Size([4]), torch.float32)
    ok = len(values) == 4 and dtype == torch.float32 and all(math.isfinite(v) for v in values)
    assert (problem is None) == ok, (values, dtype, problem)


@FUZZ
@given(text=st.text(max_size=200))
def test_allowed_peers_file_reads_or_names_the_line(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = Path(tmp_path_factory.mktemp("allowed")) / "peers.txt"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        ids = read_allowed_peers(str(path))
    except ValueError as e:
        assert str(e).startswith("allowed_peers:")
        return
    assert ids and all(PeerID.from_base58(i).to_base58() == i for i in ids)


def test_records_expiring_past_a_day_are_junk_and_attributed() -> None:
    from p2p_diloco.swarm.records import MAX_RECORD_TTL_S

    good = dict(epoch=1, inner_step=2, steps_per_s=1.0, samples_per_s=1.0, tokens_per_s=1.0,
                fingerprint=FINGERPRINT, time=1.0, client_mode=False, phase_s=0.0, protocol=PROTOCOL_VERSION)
    assert isinstance(_parse_progress(SIGNED, ValueWithExpiration(good, 86400.0), now=0.0), PeerProgress)
    for parse, value in ((_parse_progress, good), (_parse_checksum, "a" * 64)):
        far = parse(SIGNED, ValueWithExpiration(value, MAX_RECORD_TTL_S + 1.0), now=0.0)
        assert isinstance(far, Rejection) and far.kind == "malformed" and far.owner == KEY_PEER.to_base58()
