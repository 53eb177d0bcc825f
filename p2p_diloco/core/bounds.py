"""How large a reducer's averaged part may honestly be (network-free): the check on what reducers send back.

Senders are screened at the reducer (``core.robust``), but the reducer itself is just another peer: a hostile
one can send its groupmates any values for the span it reduces, e.g. a part scaled by 1e6, which one outer
step would write into every member's model. Every member can bound an honest reducer's output from public
facts alone:

1. each member announces the L2 norm of its fresh and of its late pseudo-gradient with its weights, before
   the group forms (``swarm.group.MemberInfo``); a claim far above the group's (per unit of weight) is
   clipped to ``factor`` times the lower median, as the norm screen would clip it (:func:`clip_claims`);
2. with error feedback it also announces what its residual adds to its next parts (``carried``,
   ``core.codecs.ErrorFeedback.carried_norm``: the residual as the codec selects it, e.g. its chunked top-k
   norm), signed with the same metadata (``swarm.claims``); a part then sends at most ``gain * (s * |g| +
   carried)`` (:func:`fresh_limits`);
3. reducers clip each sender's pre-scaled parts so that, summed over a span, their norm stays within that
   sender's limit ``L_k`` (:func:`clip_to_budget`), so a sender that understates its norms cannot push an
   honest reducer over the bound;
4. mean, trimmed mean and centered clipping all return a vector no longer than ``sqrt(sum_k |y_k|^2)`` of
   their inputs ``y_k`` (the trimmed mean and the median coordinate by coordinate, centered clipping because
   each iteration is a convex step from a point inside that ball), and the reducer then rescales by at most
   :func:`rescale_bound`, and encodes the result with the reply codec, which never goes through error
   feedback. So an honest reducer's output over any span of one region is no longer than
   ``reply_gain * rescale_bound * sqrt(sum_k L_k^2)`` (:func:`output_bound`).

Every member computes the same bound from the same gathered metadata and receives the same bytes from an
honest reducer, so every honest member reaches the same verdict on it. The bound limits the damage of a
hostile reducer to about ``sqrt(n)`` times the largest plausible announced part; values that are wrong but
inside it (a flipped sign, a 2x scale) are not detected.

Tolerance (:class:`NormTolerance`). Lossy codecs can raise a vector's norm when they round (E3M0 by up to
1/3 per value): :func:`norm_tolerance` covers that exactly (``plain``). Error feedback adds last round's
unsent values to this round's, and a sparse sender's residual, in a steady state, sends up to
``1/sqrt(density)`` times its pseudo-gradient's norm, more when replies drop its entries. The announced
``carried`` norm covers that, so limits follow what each member says it sends, and a hostile reducer may send
about as many announced totals as under fp32: 2.42 against 2.004 with 4 equal members, 1.21x (the part's and
the reply's codec gains). The announcement is a claim: each member's total is clipped against the group's like
the norms (:func:`fresh_limits`), so a hostile member gains what an inflated norm claim gains under fp32.
``float(tolerance)``, the codec's worst case with error feedback (17.6 at 64/4096), is what the bound was
before members announced; it now only says that the codec carries a residual.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

CODEC_NORM_GAIN = {"none": 1.0, "fp16": 1.0 + 2.0**-10, "int8": 1.1, "4bit": 1.45, "2bit": 1.1, "topk": 1.1,
                   "topk-sign": 1.1}
"""How much each codec's round trip can raise a vector's L2 norm, with margin: fp16 rounds to 11 bits; int8 moves
each value by at most absmax/254 (at most 4.5% of a block's norm with 128 values); E3M0 rounds up by at most
1/3 (plus up to absmax/256 for the smallest values and 0.8% for the bf16 scale). 2bit, like the sparse codecs,
never raises a block's norm beyond the rounding of its levels (each is the mean of the magnitudes it stands for).
The sparse codecs never raise
a chunk's norm beyond the bf16 rounding of their levels (each level is a mean of the magnitudes it stands
for), and a reducer answers with the same codec (the aggregate's own top-k); int8's gain still covers the
union reply of earlier releases (``core.sparse.SparseAverageCodec``)."""
ERROR_FEEDBACK_SLACK = 2.0
"""Factor allowed on top of a codec's gain when error feedback adds last round's residual to the values."""
FLOAT_SLACK = 1.001
"""Room for float32 rounding in sums and rescaling."""


def norm_tolerance(codec: str, error_feedback: bool, density: float = 1.0) -> float:
    """The factor by which a sent vector may exceed its announced norm, for a codec of ``CODEC_NORM_GAIN``.

    ``density`` is the share of values a sparse codec sends per round (k / chunk size). With error feedback a
    sparse sender's residual holds what earlier rounds did not send, and in a steady state it sends about as
    much mass per round as comes in, concentrated on ``density`` of the values: up to ``1/sqrt(density)``
    times the L2 norm of the same mass spread out (8x at 64 of 4096). That factor is allowed on top, so the
    bound on a reducer's output is that much looser with a sparse codec."""
    if codec not in CODEC_NORM_GAIN:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODEC_NORM_GAIN)}")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    feedback = ERROR_FEEDBACK_SLACK / math.sqrt(density) if error_feedback else 1.0
    return FLOAT_SLACK * CODEC_NORM_GAIN[codec] * feedback


class NormTolerance(float):
    """A codec's norm tolerances: as a float, the senders' worst-case factor on the fresh region
    (:func:`norm_tolerance`, with error feedback where the codec uses it: above ``plain`` exactly when senders
    carry a residual, whose norm they announce, :func:`fresh_limits`); ``plain``: the codec's gain on what is
    sent (``plain * (s * claim + carried)`` for fresh parts, ``plain * s * claim`` for the late work, sent
    without error feedback); ``reply``: the factor on a reducer's reply, which is encoded once and never fed
    back. Make one with :meth:`of`."""

    plain: float
    reply: float

    def __new__(cls, sender: float, plain: float, reply: float) -> NormTolerance:
        if not 1.0 <= plain <= sender or not 1.0 <= reply:
            raise ValueError(f"tolerances must be >= 1 with plain <= sender, got {sender!r}, {plain!r}, {reply!r}")
        tolerance = super().__new__(cls, sender)
        tolerance.plain, tolerance.reply = float(plain), float(reply)
        return tolerance

    def __getnewargs__(self) -> tuple[float, float, float]:  # type: ignore[override]
        return float(self), self.plain, self.reply

    @classmethod
    def of(cls, codec: str, error_feedback: bool, density: float = 1.0) -> NormTolerance:
        """The tolerances of a codec of ``CODEC_NORM_GAIN``; arguments as for :func:`norm_tolerance`. A sparse
        reducer replies with its aggregate's own top-k (same gain as the parts)."""
        plain = norm_tolerance(codec, False)
        return cls(norm_tolerance(codec, error_feedback, density), plain, plain)


def plain_tolerance(tolerance: float) -> float:
    """The factor for parts sent without error feedback: ``tolerance.plain`` for a :class:`NormTolerance`,
    else ``tolerance`` itself (a bare float is taken as a codec without error feedback)."""
    return tolerance.plain if isinstance(tolerance, NormTolerance) else float(tolerance)


def reply_tolerance(tolerance: float) -> float:
    """The factor on a reducer's reply: ``tolerance.reply`` for a :class:`NormTolerance`, else ``tolerance``."""
    return tolerance.reply if isinstance(tolerance, NormTolerance) else float(tolerance)


def l2_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of several tensors taken as one vector, accumulated in float64: what a member announces."""
    return math.sqrt(math.fsum(float(torch.linalg.vector_norm(t.double())) ** 2 for t in tensors))


def clip_claims(claims: Sequence[float], weights: Sequence[float], factor: float) -> list[float]:
    """Claims with those above ``factor`` times the lower median (per unit of weight) clipped to that value.

    ``claims[k]`` is member ``k``'s announced norm and ``weights[k]`` the weight it carries; members with zero
    weight carry nothing and keep a claim of 0. A peer that trained more moves further, so claims are compared
    per unit of weight, as ``core.robust.norm_outliers`` compares parts. ``factor <= 0`` clips nothing.
    """
    clipped = [float(c) if w > 0 else 0.0 for c, w in zip(claims, weights, strict=True)]
    if factor <= 0:
        return clipped
    ratios = sorted(c / w for c, w in zip(clipped, weights, strict=True) if w > 0)
    if len(ratios) < 2:
        return clipped
    cap = factor * ratios[(len(ratios) - 1) // 2]  # the lower median: one inflated claim cannot raise it
    return [min(c, cap * w) if w > 0 else 0.0 for c, w in zip(clipped, weights, strict=True)]


def fresh_limits(prescaled: Sequence[float], carried: Sequence[float], weights: Sequence[float], factor: float,
                 tolerance: float) -> list[float]:
    """Per sender, the most its pre-scaled fresh parts may weigh (L2, all parts of the region together).

    ``prescaled[k]`` is ``s_k * c_k``: the sender's scale times its clipped norm claim (``GroupPlan.
    sender_limits`` with tolerance 1); ``carried[k]`` what it announced its residual adds
    (``ErrorFeedback.carried_norm``); ``weights`` its fresh weight. Its parts then weigh at most ``plain *
    (s_k c_k + carried_k)``. The totals are claims, clipped to ``factor`` times the group's lower median per
    unit of weight (:func:`clip_claims`) as the norms are, so a member cannot announce its way past what the
    others announce; a member without fresh work sends zeros, and with a codec without error feedback
    (``float(tolerance) == plain``) nothing is carried and announcements are ignored. Not capped by the
    codec's worst case: with ``decay = 1`` honest residuals outgrow it (the replies' top-k delivers ``k`` of
    a chunk for the whole group, so aligned senders' residuals grow to about ``n / sqrt(density)`` times
    their parts)."""
    plain = plain_tolerance(tolerance)
    feedback = float(tolerance) > plain
    totals = []
    for base, extra, weight in zip(prescaled, carried, weights, strict=True):
        extra = float(extra) if feedback and math.isfinite(extra) and extra > 0 and weight > 0 else 0.0
        totals.append(float(base) + extra)
    return [plain * total for total in clip_claims(totals, weights, factor)]


def rescale_bound(sender_weights: Sequence[float]) -> float:
    """The largest factor ``core.robust.rescale_factor`` can return for any set of accepted senders.

    ``(a / n) * (W / W_a)`` is largest when the accepted set holds every zero-weight sender and the lightest
    senders with weight; the best prefix of the weights in ascending order is that set.
    """
    n = len(sender_weights)
    positive = sorted(w for w in sender_weights if w > 0)
    if not positive:
        return 1.0
    total, zeros = math.fsum(positive), n - len(positive)
    best, prefix = 1.0, 0.0
    for count, weight in enumerate(positive, start=1):
        prefix += weight
        best = max(best, (zeros + count) / n * total / prefix)
    return best


def output_bound(limits: Sequence[float], sender_weights: Sequence[float], tolerance: float) -> float:
    """The largest L2 norm an honest reducer's output can have over its span of one region.

    ``limits`` are the senders' limits ``L_k`` in that region (pre-scaled, their tolerance included), and
    ``tolerance`` the codec's: only its reply factor (:func:`reply_tolerance`) applies here, as the reducer
    encodes its output once more without error feedback; the senders' allowance is already in ``limits``.
    """
    reply = reply_tolerance(tolerance)
    return reply * rescale_bound(sender_weights) * math.sqrt(math.fsum(limit * limit for limit in limits))


def clip_to_budget(part: torch.Tensor, spent: float, limit: float) -> tuple[torch.Tensor, float, bool]:
    """Scale ``part`` down so that the squared norm spent so far plus its own stays within ``limit ** 2``.

    Returns the (possibly scaled) part, the new squared norm spent, and whether it was clipped.
    """
    square = float(torch.linalg.vector_norm(part.double())) ** 2
    room = max(limit * limit - spent, 0.0)
    if square <= room:
        return part, spent + square, False
    factor = math.sqrt(room / square) if square > 0 else 0.0
    return (part.double() * factor).to(part.dtype), spent + room, True
