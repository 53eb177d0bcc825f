"""Pseudo-gradient codecs: sizes, error bounds, malformed input, error feedback."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.core.codecs import (
    CODEC_NAMES,
    E3M0Codec,
    ErrorFeedback,
    Float16Codec,
    Int8Codec,
    TwoLevelCodec,
    get_codec,
    max_abs_error_bound,
)
from p2p_diloco.core.sparse import SPARSE_CODEC_NAMES

NUMELS = [0, 1, 2, 127, 128, 129, 1000, 4097]


def _randn(numel: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale


def _expected_nbytes(name: str, numel: int, block: int) -> int:
    blocks = -(-numel // block)
    if name in SPARSE_CODEC_NAMES:  # chunks of 4096 keeping 64 (random data has no zeros)
        chunks = -(-numel // 4096)
        entries = sum(min(64, numel - 4096 * c) for c in range(chunks))
        value_bits, levels = (2, 2) if name == "topk" else (1, 1)
        return chunks * (1 + 2 * levels) + -(-entries * 12 // 8) + -(-entries * value_bits // 8)
    return {
        "none": 4 * numel,
        "fp16": 2 * numel,
        "int8": 2 * blocks + numel,
        "4bit": 2 * blocks + (numel + 1) // 2,
        "2bit": 4 * blocks + (numel + 3) // 4,
    }[name]


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("block", [64, 128])
def test_encoded_size_is_exact(name: str, block: int) -> None:
    codec = get_codec(name, block_size=block)
    for numel in NUMELS:
        data = codec.encode(_randn(numel, seed=numel))
        assert len(data) == codec.encoded_nbytes(numel) == _expected_nbytes(name, numel, block)
        assert codec.decode(data, (numel,)).shape == (numel,)


def test_bits_per_value() -> None:
    bits = {name: get_codec(name).bits_per_value() for name in CODEC_NAMES}
    assert bits == {"none": 32.0, "fp16": 16.0, "int8": 8.125, "4bit": 4.125, "2bit": 2.25,
                    "topk": 117 * 8 / 4096, "topk-sign": 107 * 8 / 4096}
    assert get_codec("4bit", block_size=64).bits_per_value() == 4.25
    assert get_codec("2bit", block_size=64).bits_per_value() == 2.5
    n = 1 << 20
    ratio = get_codec("4bit").encoded_nbytes(n) / get_codec("none").encoded_nbytes(n)
    assert 0.125 < ratio < 0.13


def test_lossless_fp32_and_shape_preserved() -> None:
    x = _randn(60).reshape(3, 4, 5)
    y = get_codec("none").roundtrip(x)
    assert y.shape == (3, 4, 5) and y.dtype == torch.float32
    assert torch.equal(x, y)


def test_fp16_relative_error() -> None:
    x = _randn(10_000, scale=3.0)
    y = Float16Codec().roundtrip(x)
    relative = ((y - x).abs() / x.abs()).max().item()
    assert relative <= 2.0**-11 + 1e-9
    assert torch.all((y - x).abs() <= max_abs_error_bound(Float16Codec(), x))


def test_fp16_clamps_to_its_range() -> None:
    y = Float16Codec().roundtrip(torch.tensor([1e6, -1e6]))
    assert torch.equal(y, torch.tensor([65504.0, -65504.0]))


@pytest.mark.parametrize("scale", [1e-30, 1e-4, 1.0, 1e30])
@pytest.mark.parametrize("block", [64, 128])
def test_int8_error_within_half_step_per_block(scale: float, block: int) -> None:
    numel = 3 * block + 17
    x = _randn(numel, seed=1, scale=scale)
    codec = Int8Codec(block)
    y = codec.roundtrip(x)
    for start in range(0, numel, block):
        xb, yb = x[start : start + block], y[start : start + block]
        bound = xb.abs().max() / 127 / 2 * (1 + 2.0**-7)  # bf16 scale rounded up: at most 2^-7 coarser
        assert (yb - xb).abs().max() <= bound


@pytest.mark.parametrize("scale", [1e-30, 1e-4, 1.0, 1e30])
def test_4bit_error_bound_per_block(scale: float) -> None:
    block = 128
    x = _randn(5 * block + 3, seed=2, scale=scale)
    codec = E3M0Codec(block)
    y = codec.roundtrip(x)
    for start in range(0, x.numel(), block):
        xb, yb = x[start : start + block], y[start : start + block]
        absmax = xb.abs().max() * (1 + 2.0**-7)
        bound = torch.maximum(xb.abs() / 3, absmax / 128)
        assert torch.all((yb - xb).abs() <= bound * (1 + 1e-6))
    # Signs are kept wherever the value is not rounded to zero.
    nonzero = y != 0
    assert torch.equal(torch.sign(y[nonzero]), torch.sign(x[nonzero]))
    assert torch.all((y - x).abs() <= max_abs_error_bound(codec, x) * (1 + 1e-6))


def test_4bit_levels_are_exact() -> None:
    levels = torch.tensor([1.0, -0.5, 0.25, -0.125, 2.0**-4, 2.0**-5, -(2.0**-6), 0.0])
    assert torch.equal(E3M0Codec(8).roundtrip(levels), levels)


@pytest.mark.parametrize("scale", [1e-30, 1e-4, 1.0, 1e30])
def test_2bit_keeps_signs_and_never_lengthens_a_block(scale: float) -> None:
    block = 128
    x = _randn(5 * block + 3, seed=2, scale=scale)
    codec = TwoLevelCodec(block)
    y = codec.roundtrip(x)
    assert torch.all((y - x).abs() <= max_abs_error_bound(codec, x) * (1 + 1e-6))
    norm = torch.linalg.vector_norm  # in float64 below: at 1e-30 the squares underflow fp32
    for start in range(0, x.numel(), block):
        xb, yb = x[start : start + block].double(), y[start : start + block].double()
        assert norm(yb) <= norm(xb) * (1 + 2.0**-7)
        assert len(set(yb.abs().tolist())) <= 2  # two levels per block
    nonzero = (y != 0) & (x != 0)
    assert torch.equal(torch.sign(y[nonzero]), torch.sign(x[nonzero]))
    # the levels fit: better than one scale for the whole block (sign x mean magnitude)
    one_level = torch.cat([torch.sign(b) * b.abs().mean() for b in x.split(block)])
    assert norm((y - x).double()) < 0.9 * norm((one_level - x).double())


def test_2bit_levels_are_exact() -> None:
    x = torch.tensor([0.5, -0.5, 2.0, -2.0, 0.5, 2.0, -0.5, -2.0])
    assert torch.equal(TwoLevelCodec(8).roundtrip(x), x)


def test_zero_blocks_and_low_precision_inputs() -> None:
    x = torch.zeros(300)
    x[200:] = _randn(100)
    for name in ("int8", "4bit", "2bit"):
        y = get_codec(name).roundtrip(x)
        assert torch.count_nonzero(y[:128]) == 0
        half = get_codec(name).roundtrip(x.to(torch.bfloat16))
        assert half.dtype == torch.float32


# --- malformed input -----------------------------------------------------------------------


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_wrong_length_is_rejected(name: str) -> None:
    codec = get_codec(name)
    data = codec.encode(_randn(300))
    for bad in (data[:-1], data + b"\x00", b""):
        with pytest.raises(ValueError, match="bytes"):
            codec.decode(bad, (300,))
    if name not in SPARSE_CODEC_NAMES:  # a sparse part's size follows from its counts, not from the shape:
        with pytest.raises(ValueError, match="bytes"):  # the wire checks the shape first (wire_part_problem)
            codec.decode(data, (301,))
    with pytest.raises(ValueError, match="shape"):
        codec.decode(data, (-300,))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_non_finite_input_is_refused(name: str) -> None:
    codec = get_codec(name)
    for value in (math.nan, math.inf):
        with pytest.raises(ValueError, match="NaN or infinite"):
            codec.encode(torch.tensor([1.0, value]))
    with pytest.raises(ValueError, match="floating"):
        codec.encode(torch.arange(4))


def test_non_finite_payloads_are_rejected() -> None:
    with pytest.raises(ValueError, match="NaN or infinite"):
        get_codec("none").decode(struct.pack("<2f", 1.0, math.nan), (2,))
    with pytest.raises(ValueError, match="NaN or infinite"):
        get_codec("fp16").decode(struct.pack("<2e", 1.0, math.inf), (2,))


@pytest.mark.parametrize("name", ["int8", "4bit", "2bit"])
@pytest.mark.parametrize(
    ("scale_bits", "match"), [(0x7FC0, "non-finite"), (0x7F80, "non-finite"), (0xBF80, "negative")]
)
def test_bad_block_scales_are_rejected(name: str, scale_bits: int, match: str) -> None:
    codec = get_codec(name, block_size=8)
    data = bytearray(codec.encode(_randn(16)))
    data[2:4] = struct.pack("<H", scale_bits)
    with pytest.raises(ValueError, match=match):
        codec.decode(bytes(data), (16,))


def test_unused_codes_are_rejected() -> None:
    int8 = Int8Codec(8)
    data = bytearray(int8.encode(_randn(8)))
    data[2] = 0x80  # int8 -128
    with pytest.raises(ValueError, match="-128"):
        int8.decode(bytes(data), (8,))

    fourbit = E3M0Codec(8)
    data = bytearray(fourbit.encode(_randn(8)))
    data[2] = 0x08  # negative zero in the low nibble
    with pytest.raises(ValueError, match="-0"):
        fourbit.decode(bytes(data), (8,))

    data = bytearray(fourbit.encode(_randn(7)))
    data[-1] |= 0x30  # padding nibble of an odd-length tensor
    with pytest.raises(ValueError, match="padding"):
        fourbit.decode(bytes(data), (7,))

    twobit = TwoLevelCodec(8)
    data = bytearray(twobit.encode(_randn(7)))
    data[-1] |= 0x40  # the padding code of a 7-value tensor
    with pytest.raises(ValueError, match="padding"):
        twobit.decode(bytes(data), (7,))
    data = bytearray(twobit.encode(_randn(8)))
    data[0:4] = struct.pack("<2H", 0x4000, 0x3F80)  # low level 2.0 above high level 1.0
    with pytest.raises(ValueError, match="low level exceeds"):
        twobit.decode(bytes(data), (8,))


def test_registry_validation() -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("int4")
    for block in (0, -1, 1 << 17):
        with pytest.raises(ValueError, match="block_size"):
            get_codec("int8", block_size=block)
    assert isinstance(get_codec("4bit", 64), E3M0Codec) and get_codec("4bit", 64).block_size == 64


# --- error feedback ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int8", "4bit", "2bit"])
def test_error_feedback_tracks_the_true_sum(name: str) -> None:
    codec = get_codec(name, block_size=64)
    feedback = ErrorFeedback(codec)
    base = _randn(512, seed=3)
    true_sum = torch.zeros(512)
    ef_sum = torch.zeros(512)
    plain_sum = torch.zeros(512)
    for step in range(200):
        x = base + 0.05 * _randn(512, seed=100 + step)
        true_sum += x
        ef_sum += codec.decode(feedback.encode("w", x), x.shape)
        plain_sum += codec.roundtrip(x)
    ef_error = (ef_sum - true_sum).abs().max().item()
    plain_error = (plain_sum - true_sum).abs().max().item()
    # With feedback the gap is what is still owed: one round's residual, not 200 rounds' bias. 2bit's two
    # magnitudes per block owe more (a value far below its block's low level waits several rounds): 3.4x the
    # largest value here, steady from the first 20 rounds to the last 50 (4bit: 0.3x)
    assert torch.allclose(ef_sum + feedback.residual("w"), true_sum, atol=1e-3)
    assert ef_error <= base.abs().max().item() * (4.0 if name == "2bit" else 1.0)
    assert plain_error > 10 * ef_error


def test_error_feedback_keys_and_shape_change() -> None:
    feedback = ErrorFeedback(get_codec("4bit"))
    feedback.encode("a", _randn(100))
    feedback.encode(("b", 0), _randn(50))
    assert len(feedback) == 2 and feedback.residual("a").shape == (100,)
    feedback.encode("a", _randn(30))  # shape changed: starts over
    assert feedback.residual("a").shape == (30,)
    feedback.reset("a")
    assert feedback.residual("a") is None and len(feedback) == 1
    feedback.reset()
    assert len(feedback) == 0


@settings(max_examples=60, deadline=None, database=None)
@given(
    values=st.lists(
        st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32),
        min_size=0,
        max_size=300,
    ),
    name=st.sampled_from(["int8", "4bit", "2bit"]),
    block=st.sampled_from([1, 7, 64, 128]),
)
def test_blocked_codecs_hold_their_bounds_on_any_input(values: list[float], name: str, block: int) -> None:
    codec = get_codec(name, block_size=block)
    x = torch.tensor(values, dtype=torch.float32)
    data = codec.encode(x)
    assert len(data) == codec.encoded_nbytes(x.numel())
    y = codec.decode(data, x.shape)
    if x.numel():
        assert torch.all((y - x).abs() <= max_abs_error_bound(codec, x) * (1 + 1e-6) + 1e-45)
