"""Settings of the swarm layer: addresses, identity, group sizes and every network deadline.

The defaults suit volunteers on home links (tens of Mbit/s, 20-200 ms round trips). On loopback, as in the
tests, every time can be divided by about ten. Each field says how to choose its value.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.config import RUN_ID_RULE, is_run_id
from p2p_diloco.core.robust import AGGREGATION_CHOICES, default_aggregation

MULTIADDR_EXAMPLE = "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."
_MAX_ADDRESSES = 64


def parse_multiaddr(text: str, *, require_peer_id: bool, what: str) -> Multiaddr:
    """Parse one multiaddr with hivemind's parser; raise ``ValueError`` naming ``what`` and showing an example.

    ``require_peer_id`` demands the trailing ``/p2p/<peer id>`` part that initial peers need: without it the
    daemon cannot authenticate whom it dials.
    """
    hint = (
        f"expected something like {MULTIADDR_EXAMPLE}"
        if require_peer_id
        else "expected e.g. /ip4/0.0.0.0/tcp/31337"
    )
    if not isinstance(text, str) or not text:
        raise ValueError(f"{what}: {text!r} is not a multiaddr string; {hint}")
    try:
        maddr = Multiaddr(text)
    except Exception as e:
        raise ValueError(f"{what}: cannot parse {text!r} ({e}); {hint}") from None
    if require_peer_id:
        if "p2p" not in maddr:
            raise ValueError(f"{what}: {text!r} has no /p2p/<peer id> part; {hint}")
        try:
            PeerID.from_base58(maddr["p2p"])
        except Exception as e:
            raise ValueError(f"{what}: {text!r} has an invalid peer id ({e}); {hint}") from None
    return maddr


def _check_addresses(
    name: str, values: list[str], *, require_peer_id: bool, nonzero_port: bool = False
) -> None:
    if not isinstance(values, list):
        raise ValueError(f"{name} must be a list of multiaddr strings, got {type(values).__name__}")
    if len(values) > _MAX_ADDRESSES:
        raise ValueError(f"{name} holds {len(values)} addresses; at most {_MAX_ADDRESSES} are allowed")
    for i, text in enumerate(values):
        maddr = parse_multiaddr(text, require_peer_id=require_peer_id, what=f"{name}[{i}]")
        if nonzero_port and any(proto in maddr and maddr[proto] == "0" for proto in ("tcp", "udp")):
            raise ValueError(f"{name}[{i}]: {text!r} must name an explicit port (port 0 cannot be announced)")


def read_allowed_peers(path: str, what: str = "allowed_peers") -> frozenset[str]:
    """The base58 peer ids listed in ``path`` (one per line, blank lines and '#' comments ignored); errors
    name the setting ``what`` the file was given for."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{what} must be a file path, got {path!r}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ValueError(
            f"{what}: cannot read {path} ({reason}); give a file with one peer id per line"
        ) from None
    ids = set()
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            ids.add(PeerID.from_base58(entry).to_base58())
        except Exception:
            raise ValueError(
                f"{what}: {path} line {number}: {entry[:60]!r} is not a peer id (expected e.g. 12D3KooW...)"
            ) from None
    if not ids:
        flag = "--" + what.replace("_", "-")
        raise ValueError(f"{what}: {path} lists no peer id; add one per line or drop {flag}")
    return frozenset(ids)


def _check_key_private(path: str) -> None:
    """Refuse an existing identity key that other users can read (checked again when the DHT starts)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing: it will be created with mode 0600
    if stat.S_ISREG(mode) and mode & 0o077:
        raise ValueError(
            f"identity_path: key {path} is readable by other users (mode {oct(mode & 0o777)}); anyone who reads "
            f"it can impersonate this peer. Fix it with: chmod 600 {path}"
        )


def _check_range(name: str, value: float, low: float, high: float, *, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name} must be within [{low}, {high}], got {value!r}")


@dataclass
class SwarmConfig:
    """How this peer joins the swarm and how long it waits for others at each stage of a round."""

    run_id: str = field(default="p2p_diloco", metadata={"cli": False})
    """Name of the training run; prefixes every DHT key, so runs sharing a DHT never mix. 1-64 characters of
    letters, digits, '_' and '-'. Every peer of one run must use the same value."""

    initial_peers: list[str] = field(default_factory=list)
    """Multiaddrs of peers already in the swarm, e.g. ``/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...``; empty only
    for the very first peer (or a bootstrap node). Give two or three so one offline peer does not stop a
    join."""

    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    """Where to listen: ``/tcp/0`` picks a free port, a fixed port (e.g. 31337) is needed when you forward it
    on your router, and ``/ip4/127.0.0.1/tcp/0`` stays on this machine."""

    announce_maddrs: list[str] = field(default_factory=list)
    """Addresses others should dial when they differ from what the host sees (port forwarding, public IP),
    each with an explicit port. Leave empty to announce what the daemon detects."""

    identity_path: str | None = None
    """Private key file that fixes this peer's id across restarts (created with mode 0600 if missing); keep it
    secret, since whoever holds it can impersonate the peer. ``None`` makes a new random id on every start."""

    client_mode: bool = False
    """Set when this peer cannot accept incoming connections (NAT without port forwarding): it still trains
    and sends its parts to full peers, but aggregates and serves nothing. A client cannot start a swarm: it
    needs initial peers and a full peer online (peers/README.md#4-behind-nat-three-choices)."""

    use_relay: bool = True
    """Let libp2p circuit relays carry traffic to peers behind NAT. Keep on unless every peer is reachable."""

    use_auto_relay: bool = False
    """Behind NAT without port forwarding: reserve a slot on the relays among ``initial_peers`` and announce
    an address through them, so others can dial this peer. Every byte then crosses a relay's link: prefer a
    forwarded port where you can (peers/README.md#4-behind-nat-three-choices)."""

    relay_service: bool = False
    """Relay for peers behind NAT, only on a host with a public address such as a bootstrap node
    (``run_bootstrap`` sets it from its ``use_relay``). Each relayed peer's traffic crosses this host's link
    twice (bootstrap/README.md#9-relaying-for-volunteers-behind-nat-what-it-costs)."""

    nat_port_map: bool | None = None
    """Ask the home router (UPnP / NAT-PMP) to forward the listening port. ``None`` enables it unless every host
    address is loopback, where it is useless and would only send discovery packets to the local network."""

    target_group_size: int = 32
    """Largest group one round forms, 2-1024: set it at or above the number of peers you expect, so that a
    round is one swarm-wide average (more peers split into groups whose averages differ, and the minority
    resyncs). hivemind recommends powers of two."""

    min_group_size: int = 2
    """Fewest peers (this one included) a round needs, 2-1024; a smaller group is skipped rather than averaged.
    Raise it to make each round average over more data at the cost of more skipped rounds."""

    matchmaking_time_s: float = 15.0
    """The longest a group leader waits for stragglers before it starts the round, 0.5-600 s (sooner once
    every due peer joined). Choose about the spread of peers' arrival times plus a few DHT round trips: 15 s
    on home links, 2 s on loopback (peers/README.md#deadlines-and-group-sizes)."""

    adaptive_deadlines: bool = True
    """Learn each round's matchmaking window and all-reduce deadline from the times this peer observed (median
    plus 4 MADs over the last 9 rounds), capped by the fixed flags. ``False`` uses the fixed flags every
    round, to reproduce an old run (peers/README.md#deadlines-and-group-sizes)."""

    matchmaking_timeout_s: float = 60.0
    """Total time to look for a group before the round is skipped, 1-3600 s: it must exceed
    ``matchmaking_time_s``, and about 3-4x it lets a peer retry with another leader. The wait for the round to
    begin lasts ``2 * request_timeout_s`` longer (peers/README.md#deadlines-and-group-sizes)."""

    request_timeout_s: float = 5.0
    """How long to wait for a potential leader's answer during matchmaking, 0.1-600 s, below
    ``matchmaking_time_s``: about 10x the round-trip time. Followers wait ``2 *`` this beyond hivemind's own
    limit for their leader to begin the round (peers/README.md#deadlines-and-group-sizes)."""

    allreduce_timeout_s: float = 600.0
    """Deadline for the all-reduce once the group is formed, 1-86400 s; a round past it is skipped. Set it to
    about 2x the expected ``2*(N-1)/N * S * 8 / B`` for S bytes of pseudo-gradients on an upload of B bit/s
    (150M fp32 parameters over 20 Mbit/s: about 480 s for the transfer alone)."""

    next_chunk_timeout_s: float = 30.0
    """A groupmate silent this long in an all-reduce or a state download counts as failed, 0.1-3600 s: cover
    one part on the slowest link plus stalls (512 KiB at 1 Mbit/s: about 4 s). Keep ``allreduce_timeout_s``
    above about 5x it (peers/README.md#deadlines-and-group-sizes)."""

    part_size_bytes: int = 2**19
    """All-reduce messages carry parts of at most this many bytes, 1 KiB-64 MiB. hivemind's 512 KiB default
    is good for home links; smaller parts detect faults sooner but cost more per-message overhead."""

    bandwidth_mbps: float | None = None
    """This peer's upload bandwidth in Mbit/s, used to give faster peers a larger share of the reduction in a
    private swarm (``allowed_peers``); among strangers a bandwidth is an unverifiable claim, and every full
    member reduces an equal share (``group.balancing_bandwidths``). ``None`` assumes the group's average; 0
    makes this peer aggregate nothing."""

    state_download_timeout_s: float = 600.0
    """Deadline for downloading the model and outer-optimizer state from one donor, 1-86400 s. About 2x
    (state bytes * 8 / your download bit/s); state is 2-3x the model size."""

    declare_state_period_s: float = 30.0
    """A peer that shares state re-announces itself in the DHT this often, 1-3600 s. Shorter makes new donors
    visible sooner at the cost of more DHT traffic."""

    progress_ttl_s: float = 120.0
    """Lifetime of a published progress record, 1-86400 s. Republish at least every half of it; a peer that
    stops publishing drops out of the swarm's view (epoch, speeds) after this long."""

    solo_after_s: float = 600.0
    """How long a peer that has seen others of its run waits, seeing none, before it steps alone, 0-86400 s;
    until then it skips rounds, which keeps a partition from splitting the swarm. Set a few rounds: longer
    than a router restart, short enough that a lone volunteer still progresses
    (peers/README.md#deadlines-and-group-sizes)."""

    checksum_ttl_s: float = 1800.0
    """Lifetime of a published per-epoch parameter checksum, 1-86400 s. Keep it longer than a few rounds so
    joiners can verify a downloaded state against the epoch it claims."""

    startup_timeout_s: float = 30.0
    """Bound on starting the p2p daemon and reaching the initial peers, 1-600 s. Include a TCP connect over a
    slow link: 30 s on home links, 10 s on loopback."""

    dht_wait_timeout_s: float = 5.0
    """A DHT request unanswered for this long counts as lost, 0.1-120 s. About 10x the round-trip time."""

    shutdown_timeout_s: float = 5.0
    """Grace period for background processes to stop before they are terminated, 0.1-120 s."""

    aggregation: Literal["auto", "mean", "trimmed-mean", "centered-clip"] = "auto"
    """How reducers combine parts: ``mean`` (exact; trusted swarms), ``centered-clip`` (bounds a hostile peer)
    or ``trimmed-mean``; ``auto`` picks ``centered-clip`` in an open swarm with a sparse codec, else ``mean``.
    Every peer of a run should use the same value (peers/README.md#open-swarms-trust-and-admission)."""

    allowed_peers: str | None = None
    """File of peer ids (base58, one per line, '#' comments) allowed to average with this peer and download
    its state, enforced on the averaging and state RPCs: a private swarm. Every member should list every
    member, itself included; ``None`` admits anyone."""

    trusted_peers: str | None = None
    """File of peer ids (base58, one per line, '#' comments) whose epochs, checksums and states this peer
    trusts without having averaged with them: a run's organisers. ``None`` builds trust from rounds only
    (peers/README.md#open-swarms-trust-and-admission)."""

    max_round_weight: float | None = None
    """Largest weight (samples) a member may claim for one round; larger claims are refused and banned, and
    this peer never claims more. Default: 4 rounds of ``batch_size x local_steps``, which every peer of a run
    must share (peers/README.md#open-swarms-trust-and-admission)."""

    weight_outlier_ratio: float = 1000.0
    """A member claiming more than this many times the group's lower-median weight is left out of the round,
    1-1e12 (not banned: the median is made of other members' claims, which Sybils with tiny claims control;
    ``max_round_weight`` is the cap that bans). DyLU gives slow peers fewer steps, so honest weights differ
    by a few x; keep it well above that."""

    norm_outlier_factor: float = 20.0
    """A reducer rejects (and bans) a sender whose part of the pseudo-gradient is longer than this many times
    the group's median norm (groups of 3 or more), 0 to disable. Honest norms scale with weight and local
    steps and differ by a few x; 20 catches scaled attacks while leaving honest peers alone."""

    def __post_init__(self) -> None:
        if not is_run_id(self.run_id):
            raise ValueError(f"run_id must be {RUN_ID_RULE}, got {self.run_id!r}")
        _check_addresses("initial_peers", self.initial_peers, require_peer_id=True)
        _check_addresses("host_maddrs", self.host_maddrs, require_peer_id=False)
        if not self.host_maddrs:
            raise ValueError("host_maddrs must hold at least one address, e.g. /ip4/0.0.0.0/tcp/0")
        _check_addresses("announce_maddrs", self.announce_maddrs, require_peer_id=False, nonzero_port=True)
        if self.identity_path is not None and (
            not isinstance(self.identity_path, str) or not self.identity_path
        ):
            raise ValueError(
                f"identity_path must be a non-empty path string or None, got {self.identity_path!r}"
            )
        if self.identity_path is not None:
            _check_key_private(self.identity_path)
        for name in ("client_mode", "use_relay", "use_auto_relay", "relay_service", "adaptive_deadlines"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.use_auto_relay and not self.use_relay:
            raise ValueError("use_auto_relay needs use_relay: turn use_relay on, or use_auto_relay off")
        if self.use_auto_relay and self.relay_service:
            raise ValueError("use_auto_relay (this host is behind NAT) and relay_service (this host is public) "
                             "contradict each other: keep the one that is true")
        if self.relay_service and not self.use_relay:
            raise ValueError("relay_service needs use_relay: turn use_relay on, or relay_service off")
        if self.nat_port_map is not None and not isinstance(self.nat_port_map, bool):
            raise ValueError(f"nat_port_map must be true, false or None, got {self.nat_port_map!r}")

        _check_range("target_group_size", self.target_group_size, 2, 1024, integer=True)
        _check_range("min_group_size", self.min_group_size, 2, 1024, integer=True)
        if self.min_group_size > self.target_group_size:
            raise ValueError(
                f"min_group_size ({self.min_group_size}) must not exceed target_group_size ({self.target_group_size})"
            )
        _check_range("matchmaking_time_s", self.matchmaking_time_s, 0.5, 600)
        _check_range("matchmaking_timeout_s", self.matchmaking_timeout_s, 1, 3600)
        _check_range("request_timeout_s", self.request_timeout_s, 0.1, 600)
        if self.matchmaking_timeout_s <= self.matchmaking_time_s:
            raise ValueError(
                f"matchmaking_timeout_s ({self.matchmaking_timeout_s}) must exceed matchmaking_time_s "
                f"({self.matchmaking_time_s})"
            )
        if self.request_timeout_s >= self.matchmaking_time_s:
            raise ValueError(
                f"request_timeout_s ({self.request_timeout_s}) must be below matchmaking_time_s "
                f"({self.matchmaking_time_s})"
            )
        _check_range("allreduce_timeout_s", self.allreduce_timeout_s, 1, 86400)
        _check_range("next_chunk_timeout_s", self.next_chunk_timeout_s, 0.1, 3600)
        if self.next_chunk_timeout_s * 2 >= self.allreduce_timeout_s:
            raise ValueError(
                f"next_chunk_timeout_s ({self.next_chunk_timeout_s}) must be below half of allreduce_timeout_s "
                f"({self.allreduce_timeout_s}) so a silent peer is detected before the round's deadline"
            )
        _check_range("part_size_bytes", self.part_size_bytes, 1024, 64 * 2**20, integer=True)
        if self.bandwidth_mbps is not None:
            _check_range("bandwidth_mbps", self.bandwidth_mbps, 0, 1e6)
        _check_range("state_download_timeout_s", self.state_download_timeout_s, 1, 86400)
        _check_range("declare_state_period_s", self.declare_state_period_s, 1, 3600)
        _check_range("progress_ttl_s", self.progress_ttl_s, 1, 86400)
        _check_range("checksum_ttl_s", self.checksum_ttl_s, 1, 86400)
        _check_range("solo_after_s", self.solo_after_s, 0, 86400)
        _check_range("startup_timeout_s", self.startup_timeout_s, 1, 600)
        _check_range("dht_wait_timeout_s", self.dht_wait_timeout_s, 0.1, 120)
        _check_range("shutdown_timeout_s", self.shutdown_timeout_s, 0.1, 120)
        if self.aggregation not in AGGREGATION_CHOICES:
            raise ValueError(
                f"aggregation must be one of {', '.join(AGGREGATION_CHOICES)}, got {self.aggregation!r}"
            )
        if self.allowed_peers is not None:
            read_allowed_peers(self.allowed_peers)
        if self.trusted_peers is not None:
            read_allowed_peers(self.trusted_peers, "trusted_peers")
        if self.max_round_weight is not None:
            _check_range("max_round_weight", self.max_round_weight, 1, 1e12)
        _check_range("weight_outlier_ratio", self.weight_outlier_ratio, 1, 1e12)
        _check_range("norm_outlier_factor", self.norm_outlier_factor, 0, 1e12)
        if 0 < self.norm_outlier_factor < 2:
            raise ValueError(
                f"norm_outlier_factor must be 0 (off) or at least 2, got {self.norm_outlier_factor!r}; "
                "below that, honest peers would be rejected"
            )

    def aggregation_for(self, *, sparse: bool) -> str:
        """The rule the reducers run (``core.robust.default_aggregation``): ``aggregation``, with ``auto``
        resolved for this swarm (open without ``allowed_peers``) and codec (``sparse``: top-k parts)."""
        return default_aggregation(self.aggregation, open_run=self.allowed_peers is None, sparse=sparse)

    @classmethod
    def for_loopback(cls, **overrides: object) -> SwarmConfig:
        """Settings for peers on one machine (tests, demos): loopback addresses and deadlines about 10x shorter."""
        values: dict[str, object] = dict(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            use_relay=False,
            matchmaking_time_s=2.0,
            matchmaking_timeout_s=15.0,
            request_timeout_s=1.0,
            allreduce_timeout_s=30.0,
            next_chunk_timeout_s=5.0,
            state_download_timeout_s=30.0,
            declare_state_period_s=5.0,
            startup_timeout_s=15.0,
            dht_wait_timeout_s=3.0,
        )
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
