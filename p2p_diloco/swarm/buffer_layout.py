"""How the averager's shared buffer holds a round's pseudo-gradient: the whole model, or one fragment at a time.

Plain DiLoCo averages the whole model every round: the buffer is one tensor per parameter, shaped like it.
Streaming DiLoCo (``core.fragments``) averages one fragment of the model per round, and only one fragment is in
flight at a time (its delay τ is at most H/F steps), so the buffer needs to hold only the largest fragment: one
flat tensor of that many values, into which each round's fragment is laid out as views, one per parameter of
the fragment, in the fragment's order. At F = 4 that is 1 byte per parameter of the model instead of 4
(docs/architecture.md, "Memory").

Peers must agree on the layout to average: the fragment assignment (``core.fragments.assign_fragments``, the
same rule on every peer, so the same model gives the same layout) goes into the averager's prefix
(:attr:`BufferLayout.tag`), so peers with another F or assignment never even meet; and a round of fragment f
at that fragment's epoch e meets under its own key and announces its own number, ``e·F + f``
(:meth:`BufferLayout.round_number`), which members compare before planning (``access.epoch_mismatch``,
``group.plan_group``) exactly as they compare epochs without fragments (where the number is the epoch).

Chosen over one averager per fragment: that would keep F averager processes and F buffers that add up to the
whole model, and F searches per peer on the DHT; here one process and 4/F bytes per parameter.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from p2p_diloco.core.fragments import round_number

__all__ = ["BufferLayout"]

Shape = tuple[int, ...]


class BufferLayout:
    """The averager's buffer layout; see the module docstring.

    Args:
        layout: shape and dtype of every parameter's pseudo-gradient, in the run's fixed order.
        fragments: the parameter indices of each fragment (``core.fragments.assign_fragments``); ``None`` or one
            fragment: the whole model each round. With more, every parameter must be in exactly one fragment
            and all must share one floating dtype (the flat buffer's).

    Raises:
        ValueError: an empty layout, a parameter in no fragment or in two, an empty fragment, mixed dtypes.
    """

    def __init__(self, layout: Sequence[tuple[Shape, torch.dtype]],
                 fragments: Sequence[Sequence[int]] | None = None) -> None:
        self.params = [(tuple(int(d) for d in shape), dtype) for shape, dtype in layout]
        if not self.params:
            raise ValueError("the layout must hold at least one tensor")
        groups = [list(range(len(self.params)))] if fragments is None else [list(g) for g in fragments]
        if not groups or any(not group for group in groups):
            raise ValueError("every fragment must hold at least one parameter")
        if sorted(i for group in groups for i in group) != list(range(len(self.params))):
            raise ValueError(f"fragments must name each of the {len(self.params)} parameters exactly once")
        self.groups = groups
        self.count = len(groups)
        if self.flat:
            dtypes = {dtype for _, dtype in self.params}
            if len(dtypes) != 1:
                raise ValueError(f"fragments need one dtype for the shared buffer, got {sorted(map(str, dtypes))}")
            self.dtype = dtypes.pop()
        self.numels = [sum(math.prod(self.params[i][0]) for i in group) for group in groups]
        """Values in each fragment."""

    @classmethod
    def of(cls, template: Sequence[torch.Tensor], fragments: Sequence[Sequence[int]] | None = None) -> BufferLayout:
        """The layout of tensors shaped like ``template``."""
        return cls([(tuple(t.shape), t.dtype) for t in template], fragments)

    @property
    def flat(self) -> bool:
        """Whether rounds average one fragment at a time (a flat buffer), not the whole model."""
        return self.count > 1

    @property
    def tag(self) -> str:
        """What the averager's prefix gets beside the run and model: empty for the whole model (the prefix of a
        run without fragments, unchanged), else F and a digest of the assignment and shapes."""
        if not self.flat:
            return ""
        digest = hashlib.sha256(repr((self.groups, [shape for shape, _ in self.params])).encode()).hexdigest()
        return f"_F{self.count}x{digest[:12]}"

    def check_fragment(self, fragment: int) -> int:
        if isinstance(fragment, bool) or not isinstance(fragment, int) or not 0 <= fragment < self.count:
            raise ValueError(f"fragment must be an integer in [0, {self.count}), got {fragment!r}")
        return fragment

    def layout(self, fragment: int = 0) -> list[tuple[Shape, torch.dtype]]:
        """Shapes and dtypes of ``fragment``'s pseudo-gradient tensors, in its order."""
        return [self.params[i] for i in self.groups[self.check_fragment(fragment)]]

    def round_number(self, epoch: int, fragment: int = 0) -> int:
        """The number a round of ``fragment`` at that fragment's ``epoch`` meets and announces: e·F + f (the
        epoch itself without fragments), one number per fragment round; ``ValueError`` past ``EPOCH_LIMIT``."""
        return round_number(int(epoch), self.check_fragment(fragment), self.count)

    def make_buffers(self) -> list[torch.Tensor]:
        """The buffers hivemind's averager shares with its process: one zero tensor per parameter (whole model),
        or one flat zero tensor as large as the largest fragment."""
        if not self.flat:
            return [torch.zeros(shape, dtype=dtype) for shape, dtype in self.params]
        return [torch.zeros(max(self.numels), dtype=self.dtype)]

    def views(self, buffers: Sequence[torch.Tensor], fragment: int = 0) -> list[torch.Tensor]:
        """``fragment``'s tensors inside ``buffers`` (:meth:`make_buffers`'s, or hivemind's shared copies of
        them): the buffers themselves for the whole model, else views of the flat buffer's first values."""
        if not self.flat:
            return list(buffers[: len(self.params)])
        flat, out, offset = buffers[0], [], 0
        for shape, _ in self.layout(fragment):
            size = math.prod(shape)
            out.append(flat[offset: offset + size].view(shape))
            offset += size
        return out

    def check(self, name: str, tensors: Sequence[torch.Tensor], fragment: int = 0) -> None:
        """``ValueError`` naming what is wrong when ``tensors`` are not ``fragment``'s shapes and dtypes or hold
        NaN or infinite values."""
        layout = self.layout(fragment)
        if len(tensors) != len(layout):
            where = f"fragment {fragment} of the template" if self.flat else "the template"
            raise ValueError(f"{name} holds {len(tensors)} tensors, {where} {len(layout)}")
        for i, (tensor, (shape, dtype)) in enumerate(zip(tensors, layout, strict=True)):
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(f"{name}[{i}] is {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}")
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{name}[{i}] holds NaN or infinite values")
