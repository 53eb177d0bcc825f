"""The averager's buffer layout: the whole model, or one Streaming DiLoCo fragment a round (swarm.buffer_layout)."""

from __future__ import annotations

import math

import pytest
import torch
from averager_process import process_for_tests

from p2p_diloco.core.fragments import assign_fragments
from p2p_diloco.swarm.buffer_layout import BufferLayout
from p2p_diloco.swarm.hivemind_codecs import CodecCompression

NAMES = ["embed.weight", "layers.0.attn.weight", "layers.0.mlp.weight", "layers.1.attn.weight",
         "layers.1.mlp.weight", "layers.2.attn.weight", "layers.2.mlp.weight", "layers.3.attn.weight",
         "layers.3.mlp.weight", "norm.weight"]
SHAPES = [(16, 8), (8, 8), (8, 16), (8, 8), (8, 16), (8, 8), (8, 16), (8, 8), (8, 16), (8,)]


def _layout(fragments: int) -> BufferLayout:
    groups = assign_fragments(NAMES, [math.prod(s) for s in SHAPES], fragments)
    return BufferLayout([(s, torch.float32) for s in SHAPES], groups if fragments > 1 else None)


def test_the_whole_model_keeps_one_buffer_per_parameter_and_the_epoch_as_round_number() -> None:
    layout = _layout(1)
    buffers = layout.make_buffers()
    assert not layout.flat and layout.tag == ""  # the averager's prefix of a run without fragments, unchanged
    assert [tuple(b.shape) for b in buffers] == SHAPES
    assert layout.views(buffers) == buffers or all(v is b for v, b in zip(layout.views(buffers), buffers, strict=True))
    assert [layout.round_number(e) for e in range(4)] == [0, 1, 2, 3]


def test_fragments_share_one_flat_buffer_of_the_largest_fragment() -> None:
    layout = _layout(4)
    total = sum(math.prod(s) for s in SHAPES)
    (flat,) = layout.make_buffers()
    assert flat.numel() == max(layout.numels) < total / 2  # the largest fragment, not the model
    assert sum(layout.numels) == total
    for f in range(4):
        views = layout.views([flat], f)
        assert [(tuple(v.shape), v.dtype) for v in views] == layout.layout(f)
        # laid out back to back from the start of the flat buffer, each its own storage range
        assert all(v.data_ptr() == flat.data_ptr() + 4 * sum(w.numel() for w in views[:i]) for i, v in enumerate(views))
        for v in views:
            v.fill_(f + 1)
        assert float(flat[: layout.numels[f]].min()) == f + 1
    # each fragment round has a number of its own, and the numbers of one fragment are F apart
    numbers = {layout.round_number(e, f) for e in range(5) for f in range(4)}
    assert len(numbers) == 20 and layout.round_number(3, 2) == 14
    # peers with another F or another assignment meet under another prefix
    assert layout.tag.startswith("_F4x") and layout.tag != _layout(2).tag


def test_bad_layouts_and_tensors_are_named() -> None:
    shapes = [((4,), torch.float32), ((2, 3), torch.float32)]
    with pytest.raises(ValueError, match="exactly once"):
        BufferLayout(shapes, [[0], [0]])
    with pytest.raises(ValueError, match="at least one parameter"):
        BufferLayout(shapes, [[0, 1], []])
    with pytest.raises(ValueError, match="one dtype"):
        BufferLayout([((4,), torch.float32), ((2,), torch.float16)], [[0], [1]])
    layout = BufferLayout(shapes, [[1], [0]])
    with pytest.raises(ValueError, match=r"fragment must be an integer in \[0, 2\)"):
        layout.round_number(0, 2)
    with pytest.raises(ValueError, match="fragment 0 of the template 1"):
        layout.check("fresh", [torch.zeros(4), torch.zeros(2, 3)], 0)
    with pytest.raises(ValueError, match=r"fresh\[0\] is \(4,\)"):
        layout.check("fresh", [torch.zeros(4)], 0)
    with pytest.raises(ValueError, match="NaN or infinite"):
        layout.check("fresh", [torch.full((4,), math.inf)], 1)
    layout.check("fresh", [torch.zeros(2, 3)], 0)


def test_each_fragment_rounds_with_its_own_codec_and_residuals() -> None:
    """Error-feedback residuals are keyed by tensor index and part, which fragments share: each fragment gets its
    own copy of the codec, made before any residual, with error feedback over its own fresh tensors."""
    base = CodecCompression("topk", error_feedback=True, chunk_size=64, k=4)
    base.feedback_tensors = 3
    process = process_for_tests(layout=BufferLayout(
        [((4,), torch.float32), ((8,), torch.float32), ((2,), torch.float32)], [[0, 2], [1]]))
    kwargs = {"compression": base, "part_size_bytes": 1024}
    first, second = (process.rounds._codec(kwargs, f)["compression"] for f in (0, 1))
    assert first is base and second is not base and second.error_feedback is not base.error_feedback
    assert (first.feedback_tensors, second.feedback_tensors) == (2, 1)
    assert process.rounds._codec(kwargs, 1)["compression"] is second  # kept for the run
    assert process.rounds._codec(kwargs, 1)["part_size_bytes"] == 1024
    # without fragments: the averager's own codec, untouched
    whole = process_for_tests()
    assert whole.rounds._codec(kwargs, 0) is kwargs
