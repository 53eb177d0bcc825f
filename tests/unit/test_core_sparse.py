"""Sparse codecs (core.sparse): exact sizes, what is kept, error-feedback accounting, hostile parts."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
import torch

from p2p_diloco.core.codecs import ErrorFeedback, get_codec
from p2p_diloco.core.sparse import SparseAverageCodec, SparsePartError, TopKCodec, _pack_bits


def _data(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def test_sizes_are_exact_with_every_count_level_index_and_padding_counted():
    # 10000 values: chunks of 4096, 4096 and 1808, 64 entries each = 192 entries.
    x = _data(10_000)
    # per chunk 1 count byte + 2 bf16 levels; 192 * 12 bits of offsets; 192 * 2 bits of codes
    assert len(TopKCodec().encode(x)) == 3 * (1 + 4) + 288 + 48 == 351
    # signs only: 1 bf16 scale per chunk, 1 bit per value
    assert len(TopKCodec(signs_only=True).encode(x)) == 3 * (1 + 2) + 288 + 24 == 321
    assert TopKCodec().encoded_nbytes(10_000) == 351
    # k > 255: two count bytes per chunk; 3 entries of 10 bits = 30 bits -> 4 bytes, codes 6 bits -> 1 byte
    assert len(TopKCodec(1024, 300).encode(_data(1024))) == 2 + 4 + -(-300 * 10 // 8) + -(-300 * 2 // 8)
    # 4096 fp32 values are 16384 bytes: 64 of 4096 is 1/140 of fp32
    assert 16384 / len(TopKCodec().encode(_data(4096))) == pytest.approx(16384 / 117)


def test_zero_chunks_send_no_entries():
    x = torch.zeros(8192)
    x[5000] = 3.0
    data = TopKCodec().encode(x)
    assert len(data) == 2 * 5 + 2 + 1  # one entry: 12 bits -> 2 bytes, 2 bits -> 1 byte
    assert torch.equal(TopKCodec().decode(data, x.shape), x)


@pytest.mark.parametrize("signs_only", [False, True])
def test_keeps_the_top_k_of_each_chunk_with_their_signs_and_never_raises_the_norm(signs_only):
    codec = TopKCodec(256, 8, signs_only=signs_only)
    x = _data(1000, seed=3)
    y = codec.roundtrip(x)
    for start in range(0, 1000, 256):
        chunk, out = x[start:start + 256], y[start:start + 256]
        top = set(chunk.abs().topk(min(8, chunk.numel())).indices.tolist())
        assert set(torch.nonzero(out).flatten().tolist()) == top
        assert torch.equal(torch.sign(out[list(top)]), torch.sign(chunk[list(top)]))
        assert len(set(out[list(top)].abs().tolist())) <= (1 if signs_only else 2)
        assert float(out.norm()) <= float(chunk.norm()) * (1 + 2**-8)


def test_two_bit_levels_fit_better_than_signs():
    x = _data(4096 * 16, seed=5)
    kept = TopKCodec().roundtrip(x) != 0
    err2 = float((TopKCodec().roundtrip(x) - x)[kept].norm() / x[kept].norm())
    err1 = float((TopKCodec(signs_only=True).roundtrip(x) - x)[kept].norm() / x[kept].norm())
    assert err2 < 0.08 < err1 < 0.15


@pytest.mark.parametrize("decay", [1.0, 0.95])
def test_error_feedback_accounting_is_exact_per_chunk(decay):
    codec = TopKCodec(512, 16)
    feedback = ErrorFeedback(codec, decay=decay)
    old = torch.zeros(3000)
    for rnd in range(4):
        x = _data(3000, seed=10 + rnd)
        data = feedback.encode("part", x)
        sent = codec.decode(data, x.shape)
        new = feedback.residual("part")
        expected = x.clone().add_(old, alpha=decay)  # as the encoder adds it
        unsent = sent == 0
        # where nothing was sent the residual is the input plus the decayed old residual, bit for bit
        assert torch.equal(new[unsent], expected[unsent])
        # where a value was sent, sent + residual is it to one fp32 rounding
        assert torch.allclose((sent + new)[~unsent], expected[~unsent], rtol=2**-23, atol=0)
        for start in range(0, 3000, 512):  # and so per chunk, in float64
            s = slice(start, start + 512)
            assert (sent[s].double() + new[s].double()).sum() == pytest.approx(float(expected[s].double().sum()),
                                                                              abs=1e-5)
        old = new.clone()
    feedback.reset("part")  # a rejected part: its residual is not sent again
    assert feedback.residual("part") is None


def test_error_feedback_sends_everything_eventually():
    # 4 of 64 values a round: what was not sent waits in the residual, which stays bounded
    codec = TopKCodec(64, 4)
    feedback = ErrorFeedback(codec)
    x = _data(64, seed=2)
    total = torch.zeros(64, dtype=torch.float64)
    largest = 0.0
    for rnd in range(1, 201):
        total += codec.decode(feedback.encode(0, x), x.shape).double()
        residual = feedback.residual(0).double()
        # telescoping: everything sent plus what still waits is everything that came in
        assert torch.allclose(total + residual, rnd * x.double(), atol=1e-3)
        largest = max(largest, float(residual.abs().max()))
    assert largest < 64 / 4 * 2 * float(x.abs().max())
    assert float((total / 200 - x.double()).abs().max()) < largest / 200 + 1e-6


def test_bad_parameters_are_refused():
    for chunk, k in [(100, 4), (8, 2), (1 << 17, 4), (64, 0), (64, 65)]:
        with pytest.raises(ValueError):
            TopKCodec(chunk, k)
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedback(TopKCodec(), decay=1.5)


# --- hostile parts: a 16-value chunk size, k = 4 (4-bit offsets), one chunk of 16 values ---------------------

def _part(counts, levels, offsets, codes, *, chunk=16, k=4) -> bytes:
    """A topk part written by hand: counts, bf16 level pairs, offsets, 2-bit codes."""
    cw = "<u1" if k <= 255 else "<u2"
    level_bits = b"".join(struct.pack("<H", b) for b in levels)
    return (np.asarray(counts, dtype=cw).tobytes() + level_bits
            + _pack_bits(np.asarray(offsets, dtype=np.int64), chunk.bit_length() - 1)
            + _pack_bits(np.asarray(codes, dtype=np.int64), 2))


ONE, TWO = 0x3F80, 0x4000  # bf16 1.0 and 2.0


def test_a_hand_written_part_decodes():
    out = TopKCodec(16, 4).decode(_part([3], [ONE, TWO], [1, 5, 9], [0, 1, 2]), (16,))
    expected = torch.zeros(16)
    expected[[1, 5, 9]] = torch.tensor([1.0, -1.0, 2.0])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("payload, reason", [
    (_part([3], [ONE, TWO], [1, 5, 5], [0, 1, 2]), "repeated index"),
    (_part([3], [ONE, TWO], [5, 1, 9], [0, 1, 2]), "out of order"),
    (_part([5], [ONE, TWO], [1, 2, 3, 4, 5], [0] * 5), "more than k entries"),
    (_part([3], [0x7FC0, TWO], [1, 5, 9], [0, 1, 2]), "NaN or infinite scale"),
    (_part([3], [ONE, 0x7F80], [1, 5, 9], [0, 1, 2]), "NaN or infinite scale"),
    (_part([3], [ONE, 0xC000], [1, 5, 9], [0, 1, 2]), "negative scale"),
    (_part([3], [ONE, TWO], [1, 5, 9], [0, 1, 2]) + b"\0", "declared size disagrees"),
    (_part([3], [ONE, TWO], [1, 5, 9], [0, 1, 2])[:-1], "declared size disagrees"),
    (_part([2], [ONE, TWO], [1, 5, 9], [0, 1, 2]), "declared size disagrees|padding"),
    (b"\x01", "declared size disagrees"),
])
def test_hostile_parts_are_rejected_with_their_reason(payload, reason):
    with pytest.raises(SparsePartError, match=reason):
        TopKCodec(16, 4).decode(payload, (16,))


def test_out_of_range_in_a_short_chunk():
    # offsets are log2(chunk) bits, so only a chunk shorter than the chunk size can be overrun
    with pytest.raises(SparsePartError, match="index out of range"):
        TopKCodec(16, 4).decode(_part([3], [ONE, TWO], [1, 5, 13], [0, 1, 2]), (12,))


def test_out_of_range_in_a_short_last_chunk():
    # 20 values: chunks of 16 and 4; offset 4 in the second chunk is past its end
    data = (np.asarray([1, 1], dtype="<u1").tobytes() + struct.pack("<4H", ONE, TWO, ONE, TWO)
            + _pack_bits(np.asarray([0, 4]), 4) + _pack_bits(np.asarray([0, 0]), 2))
    with pytest.raises(SparsePartError, match="index out of range"):
        TopKCodec(16, 4).decode(data, (20,))


def test_non_zero_padding_is_rejected():
    data = bytearray(_part([1], [ONE, TWO], [3], [0]))
    data[-1] |= 0x80  # a padding bit of the codes
    with pytest.raises(SparsePartError, match="padding"):
        TopKCodec(16, 4).decode(bytes(data), (16,))


# --- the reducer's reply ---------------------------------------------------------------------------------

@pytest.mark.parametrize("senders", [1, 2, 8, 64])
def test_the_reply_is_the_aggregates_own_top_k_at_a_parts_size(senders):
    codec = TopKCodec(256, 8, signs_only=senders == 2)
    parts = [codec.roundtrip(_data(2000, seed=s)) for s in range(senders)]
    aggregate = sum(parts) / senders
    reply = codec.reply_codec
    assert isinstance(reply, TopKCodec) and (reply.chunk_size, reply.k, reply.signs_only) == (256, 8, False)
    data = reply.encode(aggregate)
    out = reply.decode(data, aggregate.shape)
    assert len(data) == reply.encoded_nbytes(2000) == TopKCodec(256, 8).encoded_nbytes(2000)  # 8 per chunk
    assert not bool(((out != 0) & (aggregate == 0)).any())  # nothing outside the union
    for start in range(0, 2000, 256):  # the kept entries are the chunk's largest aggregate magnitudes
        a, o = aggregate[start:start + 256], out[start:start + 256]
        assert int((o != 0).sum()) == min(8, int((a != 0).sum()))
        if (o != 0).any():
            assert float(a[o != 0].abs().min()) >= float(a[o == 0].abs().max())
    assert torch.equal(reply.decode(bytes(data), aggregate.shape), out)  # every member decodes the same


def test_credit_undelivered_returns_exactly_the_dropped_aggregate_per_chunk():
    codec, n = TopKCodec(256, 8), 4
    feedbacks = [ErrorFeedback(codec, decay=0.95) for _ in range(n)]
    inputs = [_data(1000, seed=10 + i) for i in range(n)]
    sent = [codec.decode(f.encode("w", x), x.shape) for f, x in zip(feedbacks, inputs, strict=True)]
    before = [f.residual("w").clone() for f in feedbacks]
    aggregate = sum(sent) / n
    reply = codec.reply_codec.roundtrip(aggregate)
    credited = [f.credit_undelivered("w", s, reply) for f, s in zip(feedbacks, sent, strict=True)]
    dropped = (reply == 0) & (aggregate != 0)
    assert 0 < int(dropped.sum()) < int((aggregate != 0).sum())
    for f, s, b, c in zip(feedbacks, sent, before, credited, strict=True):
        # per value: new residual = old residual + what we sent where the reply carried nothing back
        assert torch.equal(f.residual("w"), torch.where(reply == 0, b + s, b))
        assert c == int(((reply == 0) & (s != 0)).sum())
    # summed over the senders, exactly the group's dropped aggregate (times n) comes back, chunk by chunk
    back = sum(f.residual("w") - b for f, b in zip(feedbacks, before, strict=True))
    for start in range(0, 1000, 256):
        s = slice(start, start + 256)
        torch.testing.assert_close(back[s], (n * aggregate * dropped)[s], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="the reply has"):
        feedbacks[0].credit_undelivered("w", sent[0], reply[:10])
    # a residual that was reset (our part was rejected) is not credited by a caller; a fresh key starts at 0
    feedbacks[0].reset("w")
    feedbacks[0].credit_undelivered("new", sent[0], reply)
    assert torch.equal(feedbacks[0].residual("new"), torch.where(reply == 0, sent[0], torch.zeros(1000)))


@pytest.mark.parametrize("senders", [1, 2, 8, 64])
def test_the_union_reply_carries_the_union_within_int8_rounding(senders):
    """``SparseAverageCodec``, the reply this codec sent before (kept decodable; BENCHMARKS compares both)."""
    codec = TopKCodec(256, 8)
    parts = [codec.roundtrip(_data(2000, seed=s)) for s in range(senders)]
    aggregate = sum(parts) / senders
    reply = SparseAverageCodec(256)
    data = reply.encode(aggregate)
    out = reply.decode(data, aggregate.shape)
    assert not bool(((out != 0) & (aggregate == 0)).any())  # nothing outside the union
    for start in range(0, 2000, 256):
        s = slice(start, start + 256)
        assert float((out[s] - aggregate[s]).abs().max()) <= float(aggregate[s].abs().max()) / 254 * 1.01
    entries = int((aggregate != 0).sum())
    assert len(data) == reply.nbytes_for(2000, entries)
    assert len(data) == 1 + 4 * 8 + min(-(-entries * 8 // 8), 2000 // 8) + entries
    assert data[0] == (1 if 250 < entries else 0)  # the bitmap once offsets would be larger


def test_hostile_replies_are_rejected():
    reply = SparseAverageCodec(16)
    good = reply.encode(torch.tensor([0.0] * 3 + [1.0] + [0.0] * 12))
    reply.decode(good, (16,))
    with pytest.raises(SparsePartError, match="declared size"):
        reply.decode(good + b"\0", (16,))
    bad = bytearray(good)
    bad[0] = 7
    with pytest.raises(SparsePartError, match="position coding"):
        reply.decode(bytes(bad), (16,))
    bad = bytearray(good)
    bad[3:5] = struct.pack("<H", 0x7F80)
    with pytest.raises(SparsePartError, match="NaN or infinite"):
        reply.decode(bytes(bad), (16,))
    bad = bytearray(good)
    bad[-1] = 0x80  # int8 -128
    with pytest.raises(SparsePartError, match="-128"):
        reply.decode(bytes(bad), (16,))


def test_get_codec_names_the_sparse_codecs():
    assert isinstance(get_codec("topk"), TopKCodec) and get_codec("topk").k == 64
    assert get_codec("topk-sign", chunk_size=1024, k=8).signs_only
    assert isinstance(get_codec("topk").reply_codec, TopKCodec) and get_codec("topk").reply_codec.k == 64
    assert get_codec("4bit").reply_codec.name == "4bit"


# --- at the reducer: a hostile part is refused whole, with the decoder's reason ------------------------------

# 20 values: chunks of 16 and 4; offset 4 in the second chunk is past its end (offsets are log2(chunk) bits, so
# only a short last chunk can be overrun)
_OVERRUN = (np.asarray([1, 1], dtype="<u1").tobytes() + struct.pack("<4H", ONE, TWO, ONE, TWO)
            + _pack_bits(np.asarray([0, 4]), 4) + _pack_bits(np.asarray([0, 0]), 2))


@pytest.mark.parametrize("numel, payload, reason", [
    (16, _part([3], [ONE, TWO], [1, 5, 5], [0, 1, 2]), "repeated index"),
    (16, _part([5], [ONE, TWO], [1, 2, 3, 4, 5], [0] * 5), "more than k entries"),
    (16, _part([3], [0x7FC0, TWO], [1, 5, 9], [0, 1, 2]), "NaN or infinite scale"),
    (16, _part([3], [ONE, TWO], [1, 5, 9], [0, 1, 2]) + b"\0", "declared size disagrees"),
    (20, _OVERRUN, "index out of range"),
])
def test_the_reducer_refuses_hostile_sparse_parts_with_their_reason(numel, payload, reason):
    from hivemind.compression import serialization
    from hivemind.proto import runtime_pb2

    from p2p_diloco.swarm.hivemind_codecs import HIVEMIND_SLOT, CodecCompression, install, uninstall
    from p2p_diloco.swarm.runner import decode_part

    compression = CodecCompression("topk", chunk_size=16, k=4)
    previous = install(compression)
    try:
        x = torch.zeros(numel)
        good = compression.compress(x + _data(numel), serialization.CompressionInfo.from_tensor(x, key=0))
        part, problem = decode_part(good, (numel,), compression.compression_type)
        assert problem is None and int((part != 0).sum()) == 4 * -(-numel // 16)  # k = 4 of each chunk
        hostile = runtime_pb2.Tensor()
        hostile.CopyFrom(good)
        hostile.buffer = good.buffer[:8] + payload  # the adapter's header, then the hand-written part
        part, problem = decode_part(hostile, (numel,), compression.compression_type)
        assert part.numel() == 0 and problem is not None and "rejected by its decoder" in problem
        assert re.search(reason, problem), problem
    finally:
        uninstall(previous)
    assert serialization._BASE_COMPRESSION_TYPES[HIVEMIND_SLOT] is previous
