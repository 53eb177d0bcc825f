"""One peer's outer state, driven identically by the simulator and by the swarm.

A round, as both see it::

    state.begin(params)                       # model starts from the anchors θ(t-1)
    ... H inner steps on params ...
    delta = state.pseudo_gradient(params)     # Δ = θ(t-1) − θ_local
    sent  = state.encode(delta)               # what the wire carries (codec + error feedback)
    ... averaging: in-process sum (simulator) or hivemind all-reduce (swarm) -> RoundAggregate ...
    state.apply(aggregate, params)            # outer step on the anchors; params = θ(t)

The anchors are fp32 copies kept apart from the model so the inner optimizer can use any precision,
and so the pseudo-gradient is exact. Everything here is pure tensor math; the network lives in
``p2p_diloco.swarm``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from p2p_diloco.core.codecs import ErrorFeedback, get_codec
from p2p_diloco.core.delayed import RoundAggregate, StalenessPolicy, apply_round
from p2p_diloco.core.eager import EagerOuterStep
from p2p_diloco.core.evidence import EPOCH_LIMIT, plausible_epoch
from p2p_diloco.core.outer import MOMENTUM_KEY_PREFIX, OuterOptimizer, make_anchors
from p2p_diloco.core.pseudograd import pseudo_gradient

logger = logging.getLogger(__name__)

ANCHOR_KEY_PREFIX = "param."


class OuterState:
    """Anchors θ(t), the outer optimizer, the codec with optional error feedback, and the epoch.

    Args:
        params: the model's parameters (read once, to shape the anchors).
        lr, momentum: the outer optimizer (momentum 0 with lr 1 is FedAvg).
        policy: how late work is folded in (see :mod:`p2p_diloco.core.delayed`).
        codec: pseudo-gradient codec name (one of ``core.codecs.CODEC_NAMES``).
        error_feedback: carry the codec's rounding error into the next round's pseudo-gradient.
        error_feedback_decay: factor on the carried error (``OuterConfig.error_feedback_decay``).
        chunk_size, k: the sparse codecs' chunk size and values kept per chunk.
        device: where anchors and momentum live; ``"cpu"`` saves GPU memory at the cost of one
            host-device copy per round.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        *,
        lr: float = 0.7,
        momentum: float = 0.9,
        policy: StalenessPolicy | None = None,
        codec: str = "none",
        error_feedback: bool = False,
        error_feedback_decay: float = 1.0,
        chunk_size: int | None = None,
        k: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.anchors = make_anchors(params, device)
        self.outer = OuterOptimizer(self.anchors, lr=lr, momentum=momentum)
        self.policy = policy or StalenessPolicy()
        self.codec = get_codec(codec, chunk_size=chunk_size, k=k)
        self.feedback = (ErrorFeedback(self.codec, error_feedback_decay) if error_feedback and codec != "none"
                         else None)
        self.eager = EagerOuterStep()
        self.epoch = 0
        self._delta: list[Tensor] | None = None

    @property
    def numel(self) -> int:
        return sum(a.numel() for a in self.anchors)

    def encoded_nbytes(self) -> int:
        """Bytes one full pseudo-gradient takes on the wire with this codec."""
        return sum(self.codec.encoded_nbytes(a.numel()) for a in self.anchors)

    @torch.no_grad()
    def begin(self, params: Sequence[Tensor]) -> None:
        """Start a round: the model's parameters become the anchors."""
        self.outer.copy_to(params)

    @torch.no_grad()
    def pseudo_gradient(self, params: Sequence[Tensor], out: list[Tensor] | None = None) -> list[Tensor]:
        """Δ = anchors − params, into ``out`` (e.g. the averager's shared buffer) when given, otherwise into
        buffers reused across rounds (copy it to keep it)."""
        if out is not None:
            return pseudo_gradient(self.anchors, params, out=out)
        self._delta = pseudo_gradient(self.anchors, params, out=self._delta)
        return self._delta

    @torch.no_grad()
    def encode(self, delta: Sequence[Tensor]) -> tuple[list[Tensor], int]:
        """What a receiver decodes from ``delta``, and the bytes sent, through codec and error feedback."""
        decoded: list[Tensor] = []
        nbytes = 0
        for index, t in enumerate(delta):
            data = self.feedback.encode(index, t) if self.feedback is not None else self.codec.encode(t)
            nbytes += len(data)
            decoded.append(self.codec.decode(data, t.shape).to(t.device))
        return decoded, nbytes

    @torch.no_grad()
    def apply(self, aggregate: RoundAggregate, params: Sequence[Tensor] | None = None,
              keep_local: float = 0.0) -> None:
        """The round's outer step on the anchors (see :func:`apply_round`), then params = anchors.

        ``keep_local`` (α, Streaming DiLoCo's merge, ``core.fragments``): params ← α·params + (1 − α)·anchors
        instead, keeping part of the local work done while the all-reduce ran; 0 is the plain copy."""
        apply_round(self.outer, aggregate)
        self.epoch += 1
        if params is None:
            return
        if keep_local == 0.0:
            self.outer.copy_to(params)
            return
        for param, anchor in zip(params, self.anchors, strict=True):
            # lerp(global, local, α) = α·local + (1 − α)·global, in fp32 whatever the weights' dtype.
            merged = torch.lerp(anchor.to(param.device), param.detach().to(torch.float32), keep_local)
            param.copy_(merged)

    @torch.no_grad()
    def apply_eager(
        self,
        own_fresh: Sequence[Tensor],
        prev_group_avg: Sequence[Tensor] | None,
        group_size: int,
        params: Sequence[Tensor] | None = None,
        own_share: float | None = None,
    ) -> None:
        """The eager outer step (own term fresh, the others' one round old); see :mod:`.eager`."""
        self.eager.step(self.outer, own_fresh, prev_group_avg, group_size, own_share=own_share)
        self.epoch += 1
        if params is not None:
            self.outer.copy_to(params)

    def state_tensors(self, *, copy: bool = True) -> dict[str, Tensor]:
        """Anchors (``param.{i}``), momentum and eager state as CPU tensors, for safetensors.

        ``copy=False`` returns the live CPU tensors themselves (anchors and momentum live on the CPU in a
        swarm peer): no model-sized copy, but the caller must finish with them before the next change (the
        background checkpoint writer does, see ``peer.resume``)."""
        if not copy and all(a.device.type == "cpu" for a in self.anchors):
            out = {f"{ANCHOR_KEY_PREFIX}{i}": a.detach() for i, a in enumerate(self.anchors)}
            for i, buffer in enumerate(self.outer.momentum_buffers()):
                if buffer is not None:
                    out[f"{MOMENTUM_KEY_PREFIX}{i}"] = buffer.detach()
            out.update(self.eager.state_tensors())
            return out
        out = {f"{ANCHOR_KEY_PREFIX}{i}": a.detach().to("cpu", copy=True) for i, a in enumerate(self.anchors)}
        out.update(self.outer.state_tensors())
        out.update(self.eager.state_tensors())
        return out

    @torch.no_grad()
    def load_state_tensors(self, tensors: Mapping[str, Tensor], epoch: int, *, take: bool = False) -> None:
        """Replace anchors, momentum and eager state (from a checkpoint or a verified download).

        Validates everything before changing anything. Error-feedback residuals are dropped: they
        belong to the pseudo-gradients of the state we are leaving.
        """
        anchors = []
        for i, a in enumerate(self.anchors):
            t = tensors.get(f"{ANCHOR_KEY_PREFIX}{i}")
            if t is None:
                raise ValueError(f"state lacks {ANCHOR_KEY_PREFIX}{i}")
            if t.shape != a.shape or t.dtype != torch.float32:
                raise ValueError(
                    f"{ANCHOR_KEY_PREFIX}{i}: {t.dtype} {tuple(t.shape)}, expected float32 {tuple(a.shape)}"
                )
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{ANCHOR_KEY_PREFIX}{i}: holds NaN or infinite values")
            anchors.append(t)
        extra = len([k for k in tensors if k.startswith(ANCHOR_KEY_PREFIX)]) - len(self.anchors)
        if extra:
            raise ValueError(f"state has {extra} more parameter tensors than this model")
        if not plausible_epoch(epoch):
            raise ValueError(f"epoch must be an integer within [0, {EPOCH_LIMIT}], got {epoch!r}")
        # Validate the optimizer parts first (no copies), so a bad state changes nothing.
        self.outer.load_state_tensors(tensors, validate_only=True)
        EagerOuterStep().load_state_tensors(tensors, like=self.anchors)
        for a, t in zip(self.anchors, anchors, strict=True):
            a.copy_(t)
        self.outer.load_state_tensors(tensors, take=take)
        self.eager.load_state_tensors(tensors, like=self.anchors)
        if self.feedback is not None:
            self.feedback.reset()
        self.epoch = epoch
