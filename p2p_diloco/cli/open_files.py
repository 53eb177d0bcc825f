"""The open-files limit of a peer or bootstrap process: raised at start, checked by the preflight.

Every stream another peer opens to this one costs this process a file descriptor (hivemind relays each
stream from its p2p daemon over a socket of its own), and a stream is held for as long as the other side
keeps it open without finishing its request. That wait is inside hivemind's stream handler, before the
project's per-peer stream caps run, so nothing here can cut it short (``docs/threat_model.md``, held
streams). Measured (``benchmarks/held_streams.py``): one identity holding about 1000 streams exhausted a donor
at the 1024 descriptors a default shell gives, after which it accepted no stream, honest or not. The cheap
bound is the limit itself: the soft limit is raised to the hard one (the most an unprivileged process may
have, often 2^19 or more), so the same attacker needs hundreds of thousands of streams, each costing it a
descriptor of its own too. The p2p daemon raises its own limit the same way at start (the Go runtime does).

Children (the DHT and averager processes, the p2p daemons) inherit the limit, so this runs first.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2p_diloco.cli.doctor_report import Check

__all__ = ["LOW_OPEN_FILES", "check_open_files", "open_files_limit", "raise_open_files_limit"]

logger = logging.getLogger(__name__)

LOW_OPEN_FILES = 8192
"""Below this many descriptors a peer is warned (``run_peer doctor`` and at start): a few thousand held streams
from one identity could then stop it accepting any stream."""


def open_files_limit() -> tuple[int, int] | None:
    """``(soft, hard)`` open-files limit of this process; ``None`` where the platform has no such limit."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def raise_open_files_limit() -> tuple[int, int] | None:
    """Raise the soft open-files limit to the hard one; returns ``(before, after)`` soft limits, or ``None``
    where there is no limit to raise. Never raises: a refusal leaves the limit as it was, logged."""
    limits = open_files_limit()
    if limits is None:
        return None
    import resource

    soft, hard = limits
    target = hard
    if target == resource.RLIM_INFINITY or target < 0:
        target = max(soft, 1 << 20)  # "unlimited" hard limits are refused as a soft value by some kernels
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            logger.warning("Could not raise the open-files limit from %d to %d (%s); each stream another peer holds "
                           "open costs one, so raise it yourself: ulimit -n %d", soft, target, e, target)
            return soft, soft
    after = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if after != resource.RLIM_INFINITY and after < LOW_OPEN_FILES:
        logger.warning("This process may open only %d files; each stream another peer holds open costs one, so a "
                       "few thousand held streams would stop this peer accepting any. Raise the hard limit "
                       "(ulimit -Hn as root, or LimitNOFILE= in a systemd unit) to %d or more",
                       after, LOW_OPEN_FILES)
    return soft, after


def check_open_files() -> Check:
    """The preflight's line on the limit a peer will run with (the hard one, which it raises its soft one to)."""
    from p2p_diloco.cli.doctor_report import Check

    limits = open_files_limit()
    if limits is None:
        return Check("open files", "ok", "no open-files limit on this platform")
    import resource

    hard = limits[1]
    if hard == resource.RLIM_INFINITY or hard >= LOW_OPEN_FILES:
        shown = "unlimited" if hard == resource.RLIM_INFINITY else f"{hard:,}"
        return Check("open files", "ok", f"a peer raises its limit to {shown} descriptors (one per stream held open)")
    return Check("open files", "warn",
                 f"at most {hard:,} open files: a few thousand streams held open by one identity would stop this "
                 "peer accepting any", f"raise the hard limit to {LOW_OPEN_FILES} or more (ulimit -Hn as root, "
                 "LimitNOFILE= in a systemd unit, --ulimit nofile= for docker run)")
