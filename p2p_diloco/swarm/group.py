"""What a formed group agrees on before its all-reduce: who takes part, the tensor layout and the scales.

Every member receives the same gathered metadata (hivemind's matchmaking ``gather``), in the same order, and
runs the same deterministic ``plan_group`` on it, so all members reach the same plan without talking again.

Normalisation. The group computes two linear aggregates over its compatible members:

- fresh mean  ``F = sum_i w_i * D_i / W``  with ``W = sum_i w_i`` over members carrying fresh work;
- stale term  ``S = sum_j s_j * E_j / W``  over members carrying stale work, ``s_j`` being the effective
  weight the caller chose for that contribution (e.g. a staleness discount times its sample count).

Both are obtained from ONE plain mean with hivemind weight 1: member ``k`` of the ``n`` members pre-scales its
fresh buffer by ``n * w_k / W`` and its stale buffer by ``n * s_k / W`` (zeros when it carries none), so the
mean ``(1/n) sum_k`` is exactly ``F`` and ``S``. hivemind's per-peer weights cannot express this: one weight
applies to a peer's whole vector, while here the fresh and stale parts need different weights and the stale
part is normalised by the FRESH total. Uniform weights also make an incomplete reduction detectable, as the
expected denominator of every part is exactly ``n``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hivemind.averaging.allreduce import AveragingMode
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.config import is_run_id
from p2p_diloco.core.bounds import clip_claims, plain_tolerance
from p2p_diloco.core.delayed import RoundStats, fold_scales, group_stats
from p2p_diloco.core.fragments import ROUND_LIMIT
from p2p_diloco.core.robust import screen_weights

GATHER_VERSION = 2
MAX_WEIGHT = 1e12
DEFAULT_MAX_ROUND_WEIGHT = 1e8
"""``SwarmConfig.max_round_weight`` of a bare swarm (a peer derives it from its training configuration)."""
MAX_NORM = 1e30
MAX_STALENESS = 10**6
_MAX_GATHER_BYTES = 4096
FINGERPRINT_PATTERN = re.compile(r"^[0-9a-f]{8,64}$")
_KEYS = frozenset({"v", "run", "fp", "ep", "w", "sw", "st", "f", "s", "n", "sn"})


@dataclass(frozen=True)
class MemberInfo:
    """What one member announces to its group for a round."""

    run_id: str
    fingerprint: str
    epoch: int
    """The round's number: its epoch, or with Streaming DiLoCo's fragments the fragment round's e·F + f
    (``buffer_layout.BufferLayout.round_number``). Members compare it before anything else of the round."""
    weight: float
    """Weight of its fresh pseudo-gradient (e.g. samples or tokens processed); 0 when it carries none."""
    stale_weight: float
    """Effective weight of its stale pseudo-gradient, chosen by the caller; 0 when it carries none."""
    staleness: int
    """How many epochs old its stale contribution is (0 when it carries none)."""
    has_fresh: bool
    has_stale: bool
    norm: float = 0.0
    """L2 norm of its fresh pseudo-gradient; reducers hold what it sends to this (``core.bounds``)."""
    stale_norm: float = 0.0
    """L2 norm of its stale pseudo-gradient, before the caller's weight."""

    @classmethod
    def for_round(
        cls,
        run_id: str,
        fingerprint: str,
        epoch: int,
        weight: float,
        stale_weight: float,
        staleness: int,
        carries_fresh: bool,
        carries_stale: bool,
        *,
        norm: float,
        stale_norm: float,
    ) -> MemberInfo:
        """This peer's announcement, from the caller's arguments; ``ValueError`` names a bad one. A zero
        weight means "no such work": the contribution is then announced (and sent) as absent."""
        for name, value, high in (
            ("weight", weight, MAX_WEIGHT),
            ("stale_weight", stale_weight, MAX_WEIGHT),
            ("norm", norm, MAX_NORM),
            ("stale_norm", stale_norm, MAX_NORM),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if not 0 <= value <= high:
                raise ValueError(f"{name} must be within [0, {high}], got {value!r}")
        for name, value, high in (("staleness", staleness, MAX_STALENESS), ("epoch", epoch, ROUND_LIMIT)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
                raise ValueError(f"{name} must be an integer within [0, {high}], got {value!r}")
        has_fresh, has_stale = carries_fresh and weight > 0, carries_stale and stale_weight > 0
        return cls(
            run_id=run_id,
            fingerprint=fingerprint,
            epoch=epoch,
            weight=float(weight) if has_fresh else 0.0,
            stale_weight=float(stale_weight) if has_stale else 0.0,
            staleness=staleness if has_stale else 0,
            has_fresh=has_fresh,
            has_stale=has_stale,
            norm=float(norm) if has_fresh else 0.0,
            stale_norm=float(stale_norm) if has_stale else 0.0,
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": GATHER_VERSION,
            "run": self.run_id,
            "fp": self.fingerprint,
            "ep": self.epoch,
            "w": float(self.weight),
            "sw": float(self.stale_weight),
            "st": self.staleness,
            "f": self.has_fresh,
            "s": self.has_stale,
            "n": float(self.norm),
            "sn": float(self.stale_norm),
        }

    @classmethod
    def from_wire(cls, obj: Any) -> MemberInfo:
        """Validate a received metadata dict; ``ValueError`` says what is wrong."""
        if not isinstance(obj, dict) or set(obj) != _KEYS:
            raise ValueError("metadata is not a dictionary with the expected fields")
        if obj["v"] != GATHER_VERSION or isinstance(obj["v"], bool):
            raise ValueError(f"unsupported metadata version {obj['v']!r}")
        run_id, fingerprint = obj["run"], obj["fp"]
        if not is_run_id(run_id):
            raise ValueError("invalid run id")
        if not isinstance(fingerprint, str) or not FINGERPRINT_PATTERN.fullmatch(fingerprint):
            raise ValueError("invalid model fingerprint")
        for key, high in (("ep", ROUND_LIMIT), ("st", MAX_STALENESS)):
            value = obj[key]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
                raise ValueError(f"field {key!r} must be an integer within [0, {high}]")
        for key, high in (("w", MAX_WEIGHT), ("sw", MAX_WEIGHT), ("n", MAX_NORM), ("sn", MAX_NORM)):
            value = obj[key]
            if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value):
                raise ValueError(f"field {key!r} must be a finite float")
            if not 0.0 <= value <= high:
                raise ValueError(f"field {key!r} must be within [0, {high}]")
        if not isinstance(obj["f"], bool) or not isinstance(obj["s"], bool):
            raise ValueError("flags must be booleans")
        info = cls(run_id, fingerprint, obj["ep"], obj["w"], obj["sw"], obj["st"], obj["f"], obj["s"],
                   obj["n"], obj["sn"])
        if info.has_fresh != (info.weight > 0) or info.has_stale != (info.stale_weight > 0):
            raise ValueError("work flags disagree with the weights")
        if (not info.has_fresh and info.norm) or (not info.has_stale and info.stale_norm):
            raise ValueError("a norm is announced for work that is absent")
        return info


@dataclass(frozen=True)
class GroupPlan:
    """The outcome of ``plan_group``: identical on every compatible member."""

    peer_ids: tuple[PeerID, ...]
    """Compatible members in the group's order; the all-reduce runs over exactly these."""
    members: tuple[MemberInfo, ...]
    bandwidths: tuple[float | None, ...]
    modes: tuple[AveragingMode, ...]
    refused: tuple[tuple[str, str], ...]
    """``(peer id, reason)`` for every member left out (other run, model or epoch, malformed metadata)."""
    with_stale: bool
    """Whether the all-reduce layout carries the stale buffers after the fresh ones."""
    fresh_weight_total: float
    skip_reason: str | None
    rejected: tuple[tuple[str, str], ...] = ()
    """``(peer id, reason)`` for members refused as hostile or unauthorised (implausible weight, not in the
    allowed list); also listed in ``refused``. The caller bans them for the run."""

    def local_scales(self, peer_id: PeerID) -> tuple[float, float]:
        """Factors by which ``peer_id`` multiplies its fresh and stale buffers before the plain mean."""
        info = self.members[self.peer_ids.index(peer_id)]
        return fold_scales(info.weight if info.has_fresh else 0.0, info.stale_weight if info.has_stale else 0.0,
                           self.stats())

    def stats(self) -> RoundStats:
        """The group's totals (``W_f``, ``D``) as the core computes them (``core.delayed.group_stats``)."""
        return group_stats(self.fresh_weights(), [m.stale_weight if m.has_stale else 0.0 for m in self.members],
                           [m.staleness if m.has_stale else 0 for m in self.members])

    def fresh_weights(self) -> list[float]:
        """Each member's fresh weight, 0 for members without fresh work: the reducers' ``sender_weights``."""
        return [m.weight if m.has_fresh else 0.0 for m in self.members]

    def screen_weights(self) -> list[tuple[float, float]]:
        """Per member, what the reducers' norm screen divides its fresh and late-work parts by
        (``core.robust.screen_weights``)."""
        return [screen_weights(m.weight if m.has_fresh else 0.0, m.stale_weight if m.has_stale else 0.0)
                for m in self.members]

    def sender_limits(self, factor: float, tolerance: float) -> list[tuple[float, float]]:
        """Per member, the most its pre-scaled fresh and stale parts may weigh in L2 norm, all parts of one
        region together: its announced norms (clipped, ``core.bounds.clip_claims``) times its scales and the
        codec's ``tolerance`` (``core.bounds.NormTolerance``: the late work, sent without error feedback, gets
        its ``plain`` factor). Reducers clip senders to these; members bound reducers' outputs by them."""
        plain = plain_tolerance(tolerance)
        fresh = clip_claims([m.norm for m in self.members], self.fresh_weights(), factor)
        stale = clip_claims(
            [m.stale_norm for m in self.members],
            [m.stale_weight if m.has_stale else 0.0 for m in self.members],
            factor,
        )
        limits = []
        for peer_id, fresh_claim, stale_claim in zip(self.peer_ids, fresh, stale, strict=True):
            fresh_scale, stale_scale = self.local_scales(peer_id)
            limits.append((float(tolerance) * fresh_scale * fresh_claim, plain * stale_scale * stale_claim))
        return limits


def encode_gather(bandwidth: float | None, mode: AveragingMode, info: MemberInfo) -> bytes:
    """hivemind's gather envelope ``[bandwidth, mode, user bytes]`` carrying ``info``."""
    return MSGPackSerializer.dumps([bandwidth, mode.value, MSGPackSerializer.dumps(info.to_wire())])


def decode_gather(raw: Any) -> tuple[float | None, AveragingMode, MemberInfo]:
    """Parse and validate one member's gathered bytes; ``ValueError`` on anything unexpected."""
    if not isinstance(raw, bytes) or len(raw) > _MAX_GATHER_BYTES:
        raise ValueError("gathered metadata is not bytes of a sane size")
    try:
        envelope = MSGPackSerializer.loads(raw)
    except Exception:
        raise ValueError("gathered metadata is not valid msgpack") from None
    if not isinstance(envelope, (list, tuple)) or len(envelope) != 3:
        raise ValueError("gathered metadata is not hivemind's [bandwidth, mode, data] envelope")
    bandwidth, mode_id, user_bytes = envelope
    if bandwidth is not None and (
        isinstance(bandwidth, bool)
        or not isinstance(bandwidth, (int, float))
        or not math.isfinite(bandwidth)
        or bandwidth < 0
    ):
        raise ValueError("invalid bandwidth")
    if mode_id not in (AveragingMode.NODE.value, AveragingMode.CLIENT.value) or isinstance(mode_id, bool):
        raise ValueError(f"unsupported averaging mode {mode_id!r}")
    if not isinstance(user_bytes, bytes):
        raise ValueError("member data is not bytes")
    try:
        user = MSGPackSerializer.loads(user_bytes)
    except Exception:
        raise ValueError("member data is not valid msgpack") from None
    return (
        (None if bandwidth is None else float(bandwidth)),
        AveragingMode(mode_id),
        MemberInfo.from_wire(user),
    )


def balancing_bandwidths(bandwidths: Sequence[float | None], *, private: bool) -> list[float | None]:
    """The bandwidths hivemind's load balancing gets: the announced ones in a private swarm, else none.

    Load balancing gives each member a share of the vector to reduce by its bandwidth, and a bandwidth is
    only a claim. hivemind's linear program is extreme: ``load_balance_peers(n, [20, 10, 10])`` already hands
    the first member the whole vector, so it reduces every part of every member (and a reducer's output is
    bounded, not checked exactly). Among strangers every full member therefore reduces an equal share
    (``None``: hivemind spreads evenly; clients keep 0). Among ``allowed_peers`` claims are trusted and used.
    """
    if private:
        return list(bandwidths)
    return [0.0 if b == 0.0 else None for b in bandwidths]


def implausible_weights(
    infos: Sequence[MemberInfo], max_weight: float, ratio: float
) -> dict[int, str]:
    """Members whose claimed weights nobody could have processed: index -> reason.

    A claim is implausible above ``max_weight`` (a run-wide cap) or above ``ratio`` times the lower median of
    the group's positive claims (so one inflated claim cannot raise the median it is compared with).
    """
    found: dict[int, str] = {}
    for i, info in enumerate(infos):
        claim = max(info.weight, info.stale_weight)
        if claim > max_weight:
            found[i] = f"claimed weight {claim:.3g} exceeds max_round_weight {max_weight:.3g}"
    claims = sorted(max(i.weight, i.stale_weight) for i in infos if max(i.weight, i.stale_weight) > 0)
    if len(claims) >= 2:
        median = claims[(len(claims) - 1) // 2]
        for i, info in enumerate(infos):
            claim = max(info.weight, info.stale_weight)
            if i not in found and claim > ratio * median:
                found[i] = f"claimed weight {claim:.3g} is over {ratio:g}x the group's median {median:.3g}"
    return found


def plan_group(
    peer_ids: Sequence[PeerID],
    gathered: Sequence[bytes | str],
    me: PeerID,
    *,
    min_group_size: int,
    max_weight: float = MAX_WEIGHT,
    weight_ratio: float = math.inf,
    allowed: frozenset[str] | None = None,
) -> GroupPlan:
    """Decide who averages with whom and in which layout, from the group's gathered metadata.

    ``gathered`` holds each member's verified metadata (``claims.open_gathered``) or why it was refused. A
    member is compatible when its metadata parses and it announces our run id, model fingerprint and
    epoch; the others are refused (never average tensors of a different model or round). Because every
    compatible member compares against the same values, they all compute the same subset, and the all-reduce
    proceeds over it; a refused member, comparing against its own values, ends up in a different subset.
    Members outside ``allowed`` and members claiming implausible weights (``implausible_weights``) are
    refused too; those outside ``allowed`` or over ``max_weight`` are listed in ``rejected`` (to be banned).
    Every member must use the same ``max_weight``, ``weight_ratio`` and ``allowed`` for the plans to agree.
    """
    if len(peer_ids) != len(gathered) or me not in peer_ids:
        raise ValueError("group description is inconsistent")
    decoded: list[tuple[float | None, AveragingMode, MemberInfo] | str] = []
    for raw in gathered:
        if isinstance(raw, str):  # refused before planning (claims.open_gathered: unsigned, forged)
            decoded.append(raw)
            continue
        try:
            decoded.append(decode_gather(raw))
        except ValueError as e:
            decoded.append(str(e))
    mine = decoded[list(peer_ids).index(me)]
    if isinstance(mine, str):
        raise ValueError(f"own metadata does not parse: {mine}")
    my_info = mine[2]

    keep_ids, keep, refused, rejected = [], [], [], []
    for peer_id, entry in zip(peer_ids, decoded, strict=True):
        if isinstance(entry, str):
            refused.append((peer_id.to_base58(), f"malformed metadata: {entry}"))
            continue
        info = entry[2]
        if allowed is not None and peer_id.to_base58() not in allowed:
            refused.append((peer_id.to_base58(), "not in allowed_peers"))
            rejected.append(refused[-1])
        elif info.run_id != my_info.run_id:
            refused.append(
                (peer_id.to_base58(), f"run id {info.run_id!r} differs from ours {my_info.run_id!r}")
            )
        elif info.fingerprint != my_info.fingerprint:
            refused.append(
                (
                    peer_id.to_base58(),
                    f"model fingerprint {info.fingerprint} differs from ours {my_info.fingerprint}",
                )
            )
        elif info.epoch != my_info.epoch:
            refused.append((peer_id.to_base58(), f"epoch {info.epoch} differs from ours {my_info.epoch}"))
        else:
            keep_ids.append(peer_id)
            keep.append(entry)

    implausible = implausible_weights([info for _, _, info in keep], max_weight, weight_ratio)
    for index in sorted(implausible):
        refused.append((keep_ids[index].to_base58(), implausible[index]))
        info = keep[index][2]
        if max(info.weight, info.stale_weight) > max_weight:
            # Banned only over the run-wide cap, which no honest peer exceeds (it caps its own claims). The
            # median rule compares with the group's other claims, which Sybils control (a few claiming tiny
            # weights would get an honest peer banned for the run): it only leaves the claim out of this round.
            rejected.append(refused[-1])
    keep_ids = [p for i, p in enumerate(keep_ids) if i not in implausible]
    keep = [e for i, e in enumerate(keep) if i not in implausible]

    fresh_total = math.fsum(info.weight for _, _, info in keep if info.has_fresh)
    skip_reason = None
    if me not in keep_ids:
        skip_reason = "this peer was refused by its own group: " + next(
            (reason for peer, reason in refused if peer == me.to_base58()), "incompatible"
        )
    elif len(keep_ids) < min_group_size:
        skip_reason = f"only {len(keep_ids)} compatible member(s), fewer than min_group_size={min_group_size}"
    elif all(mode == AveragingMode.CLIENT for _, mode, _ in keep):
        skip_reason = "every compatible member is a client; nobody can aggregate"
    elif not fresh_total > 0:
        skip_reason = "no compatible member carries fresh work"
    elif not all(
        math.isfinite(len(keep) * max(info.weight, info.stale_weight) / fresh_total) for _, _, info in keep
    ):
        skip_reason = "weights span too many orders of magnitude to normalise"
    return GroupPlan(
        peer_ids=tuple(keep_ids),
        members=tuple(info for _, _, info in keep),
        bandwidths=tuple(bandwidth for bandwidth, _, _ in keep),
        modes=tuple(mode for _, mode, _ in keep),
        refused=tuple(refused),
        with_stale=any(info.has_stale for _, _, info in keep),
        fresh_weight_total=fresh_total,
        skip_reason=skip_reason,
        rejected=tuple(rejected),
    )
