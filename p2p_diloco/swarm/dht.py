"""Start this peer's hivemind DHT (and its p2p daemon) with one clear error when anything goes wrong.

Every failure a volunteer can hit at start-up (a mistyped address, an offline bootstrap peer, a port already
taken, a daemon that cannot run, an exposed key file) becomes a single ``SwarmStartError`` whose message says
what to change.

Every node has an identity key it can sign DHT records with (``signing.RecordGuard``): the one in
``identity_path``, or, without one, a fresh key written (mode 0600) into a private temporary folder that is
removed again once the p2p daemon has read it, so the key lives on in memory only.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterable

import hivemind
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from p2p_diloco.swarm import relay
from p2p_diloco.swarm.config import MULTIADDR_EXAMPLE, SwarmConfig, parse_multiaddr
from p2p_diloco.swarm.signing import RecordGuard, load_identity_key, register_signer

logger = logging.getLogger(__name__)

_MAX_IDENTITY_BYTES = 64 * 1024


class SwarmStartError(RuntimeError):
    """This peer could not join the swarm; the message says why and what to change."""


def ensure_identity(path: str) -> str:
    """Make sure ``path`` holds a private key readable only by its owner; create one (mode 0600) if missing.

    hivemind would create the key itself, but it writes the file with the default umask and only then
    restricts it, leaving a moment where the secret is world-readable. Here the file is created with
    ``O_EXCL`` and mode 0600 from the start, with hivemind's own key generator. Returns the base58 peer id.
    """
    if os.path.lexists(path):
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise SwarmStartError(f"identity_path {path} is not a regular file")
        if info.st_mode & 0o077:
            raise SwarmStartError(
                f"identity key {path} is readable by other users (mode {oct(info.st_mode & 0o777)}); "
                f"anyone who reads it can impersonate this peer. Fix it with: chmod 600 {path}"
            )
        if info.st_size > _MAX_IDENTITY_BYTES:
            raise SwarmStartError(f"identity key {path} is {info.st_size} bytes, too large to be a key file")
        with open(path, "rb") as f:
            data = f.read()
        try:
            return PeerID.from_identity(data).to_base58()
        except Exception as e:
            raise SwarmStartError(
                f"identity key {path} is not a valid libp2p private key ({e}); move it away to create a new one"
            ) from None

    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise SwarmStartError(f"cannot create identity key {path}: directory {directory} does not exist")
    key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
    data = key.SerializeToString()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask could only have removed bits, this states the intent exactly
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    peer_id = PeerID.from_identity(data).to_base58()
    logger.info("Created identity key %s for peer %s", path, peer_id)
    return peer_id


def _is_loopback_only(maddrs: list[str]) -> bool:
    for text in maddrs:
        maddr = parse_multiaddr(text, require_peer_id=False, what="host_maddrs")
        if "ip4" in maddr:
            if not maddr["ip4"].startswith("127."):
                return False
        elif "ip6" in maddr:
            if maddr["ip6"] != "::1":
                return False
        else:
            return False
    return True


def _check_ports_free(maddrs: list[str]) -> None:
    """Refuse a fixed TCP port that something already listens on.

    The daemon binds with SO_REUSEPORT, so a second peer started on the same port would silently share it
    with the first (each getting a random half of the incoming connections) instead of failing. A plain bind
    with SO_REUSEADDR fails exactly when a listener holds the port, while tolerating TIME_WAIT leftovers.
    """
    for text in maddrs:
        maddr = parse_multiaddr(text, require_peer_id=False, what="host_maddrs")
        if "tcp" not in maddr or maddr["tcp"] == "0":
            continue
        if "ip4" in maddr:
            family, host = socket.AF_INET, maddr["ip4"]
        elif "ip6" in maddr:
            family, host = socket.AF_INET6, maddr["ip6"]
        else:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, int(maddr["tcp"])))
            except OSError as e:
                raise SwarmStartError(
                    f"cannot listen on {text}: the port is already in use (another peer or program holds it; "
                    f"{e.strerror}). Choose a free port, or /tcp/0 to let the system pick one"
                ) from None


def _explain(error: BaseException, cfg: SwarmConfig) -> str:
    text = str(error)
    lowered = text.lower()
    if "address already in use" in lowered or "failed to listen" in lowered:
        return (
            f"cannot listen on {', '.join(cfg.host_maddrs)}: the port is already in use (another peer or "
            f"program holds it). Choose a free port, or /tcp/0 to let the system pick one. Daemon said: {text}"
        )
    if "bootstrap" in lowered or "initial_peers" in lowered or "failed to connect" in lowered:
        return (
            f"none of the initial peers responded: {', '.join(cfg.initial_peers)}. Check that the address and "
            f"peer id are current (they change when a peer restarts without identity_path), that the peer is "
            f"running, and that no firewall blocks the port. Details: {text}"
        )
    if "multiaddr" in lowered:
        return (
            f"an address was rejected by the p2p daemon ({text}); expected something like {MULTIADDR_EXAMPLE}"
        )
    if "identity" in lowered and "taken" in lowered:
        return (
            f"another running peer already uses the identity in {cfg.identity_path}; give each peer its own "
            f"identity_path. Details: {text}"
        )
    if "p2pd" in lowered or "daemon" in lowered:
        return (
            f"the p2p daemon (p2pd, shipped with hivemind) did not start: {text}. Reinstall hivemind for this "
            f"platform, and check that /tmp is writable (the daemon's control sockets live there)"
        )
    return f"could not start the DHT: {type(error).__name__}: {text}"


def _stop(dht: hivemind.DHT, timeout: float) -> None:
    if dht.is_alive():
        dht.terminate()
        dht.join(timeout)
    if dht.is_alive():
        dht.kill()
        dht.join(timeout)


def _signing_key(path: str) -> RSAPrivateKey:
    with open(path, "rb") as f:
        data = f.read()
    try:
        return load_identity_key(data)
    except ValueError as e:
        raise SwarmStartError(f"identity key {path}: {e}; move it away to create a new one") from None


def start_dht(cfg: SwarmConfig, record_validators: Iterable[RecordValidatorBase] = ()) -> hivemind.DHT:
    """Start a DHT node for ``cfg`` and return it once it has reached at least one initial peer.

    The node runs a ``signing.RecordGuard`` from its first moment: it signs this node's records with its
    identity key and drops unsigned, forged, oversized or (with ``records.run_validator``) malformed
    records on receipt. Raises ``SwarmStartError`` for an unparsable address, initial peers that do not
    answer within ``cfg.startup_timeout_s`` (hivemind's ``ensure_bootstrap_success``), an occupied port, a
    daemon that does not start, or an identity key that other users can read or that is not RSA. Call
    ``dht.shutdown()`` when done.
    """
    for name, values, need_id in (
        ("initial_peers", cfg.initial_peers, True),
        ("host_maddrs", cfg.host_maddrs, False),
        ("announce_maddrs", cfg.announce_maddrs, False),
    ):
        for i, text in enumerate(values):
            try:
                parse_multiaddr(text, require_peer_id=need_id, what=f"{name}[{i}]")
            except ValueError as e:
                raise SwarmStartError(str(e)) from None
    _check_ports_free(cfg.host_maddrs)
    scratch = None if cfg.identity_path is not None else tempfile.mkdtemp(prefix="p2p-diloco-identity-")
    try:
        identity_path = cfg.identity_path or os.path.join(scratch, "identity.key")
        ensure_identity(identity_path)
        key = _signing_key(identity_path)
        dht = _start(
            cfg, identity_path, [RecordGuard(key), *record_validators], fresh_key=scratch is not None
        )
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    try:
        register_signer(dht, key)
    except ValueError as e:
        _stop(dht, cfg.shutdown_timeout_s)
        raise SwarmStartError(f"the p2p daemon does not run with the identity key: {e}") from None
    logger.info("DHT started as peer %s; reachable at %s", dht.peer_id, " ".join(visible_maddrs(dht)))
    return dht


def _start(
    cfg: SwarmConfig, identity_path: str, validators: list[RecordValidatorBase], fresh_key: bool
) -> hivemind.DHT:
    loopback = _is_loopback_only(cfg.host_maddrs) and not cfg.announce_maddrs
    nat_port_map = cfg.nat_port_map if cfg.nat_port_map is not None else not loopback
    dht = hivemind.DHT(
        initial_peers=list(cfg.initial_peers) or None,
        start=False,
        record_validators=validators,
        shutdown_timeout=cfg.shutdown_timeout_s,
        client_mode=cfg.client_mode,
        host_maddrs=list(cfg.host_maddrs),
        announce_maddrs=list(cfg.announce_maddrs) or None,
        identity_path=identity_path,
        # hivemind checks an existing identity with a throwaway daemon whose UPnP cannot be turned off;
        # on loopback there is nobody else to collide with, and nobody else can hold a key made just now.
        check_if_identity_free=not loopback and not fresh_key,
        use_relay=cfg.use_relay,
        use_auto_relay=cfg.use_auto_relay,
        **relay.daemon_kwargs(cfg),
        nat_port_map=nat_port_map,
        startup_timeout=cfg.startup_timeout_s,
        wait_timeout=cfg.dht_wait_timeout_s,
        bootstrap_timeout=cfg.dht_wait_timeout_s,
        ensure_bootstrap_success=True,
    )
    try:
        # the daemon's start-up, the bootstrap ping and hivemind's own steps each have their own bound;
        # this outer bound covers all of them together
        dht.run_in_background(await_ready=True, timeout=2 * cfg.startup_timeout_s + cfg.dht_wait_timeout_s)
    except TimeoutError:
        _stop(dht, cfg.shutdown_timeout_s)
        raise SwarmStartError(
            f"the DHT did not start within {2 * cfg.startup_timeout_s + cfg.dht_wait_timeout_s:.0f} s; "
            f"the initial peers ({', '.join(cfg.initial_peers) or 'none'}) may be unreachable or very slow. "
            f"Raise startup_timeout_s on slow links"
        ) from None
    except Exception as e:
        _stop(dht, cfg.shutdown_timeout_s)
        raise SwarmStartError(_explain(e, cfg)) from e
    return dht


def visible_maddrs(dht: hivemind.DHT, latest: bool = False) -> list[str]:
    """The full multiaddrs (with ``/p2p/<peer id>``) under which other peers can reach ``dht``."""
    return [str(maddr) for maddr in dht.get_visible_maddrs(latest=latest)]
