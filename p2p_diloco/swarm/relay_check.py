"""A relay host checks its own relay at start, and restarts its p2p daemon until the right relay answers.

Why. hivemind's p2p daemon registers two circuit relays on the same protocol when it relays for others: one
with the limits we configure (4 GiB and 30 minutes per relayed connection, started once the host counts as
public) and one with libp2p's defaults (128 KiB and 2 minutes, started unconditionally with ``-relay``).
Whichever registers last answers every reservation and every relayed connection for the daemon's lifetime,
and the order is a race inside the daemon (``swarm.relay``, point 3). When the default one wins, every
relayed all-reduce stream is reset after 128 KiB and peers behind NAT never average (seen in about 3 of 10
relayed test swarms, and reproduced on loopback: 2 of 4 fresh daemons). No daemon flag reaches the default
relay, but the winner is fixed once the daemon is up, so a fresh daemon is a fresh draw.

The draw is not fair, and which way it leans depends on the machine: our relay is registered by a goroutine
woken at the host's creation, the default one by the daemon's main goroutine a few milliseconds later, so with
several OS threads for goroutines the woken one runs at once and the default one registers last and wins
(measured: 10 of 10 fresh daemons on a 2-core machine; 32 of 32 starts on the CI machine, where a node that
restarted until it drew ours never did). A relay host's daemon therefore runs with one such thread
(``GOMAXPROCS=1``, :func:`one_go_thread`): the woken goroutine waits until the main one blocks, which it does
only after registering the default relay, so ours registers last (measured: 30 of 30 fresh daemons on an idle
2-core machine, 18 of 20 with three busy loops on its two cores). The check and restart below catch the rest.
One thread relays about 240 MB/s (a 512 MiB relayed stream in 2.2 s, daemon starts included, on loopback with both ends on the same 2-core machine),
far more than a home uplink sends.

How. Two throwaway p2p daemons on this host play a peer behind NAT and a peer dialling it: the first reserves
a slot on our relay and has no address of its own (so the only way to it is the circuit), the second dials
it through the circuit and sends :data:`PAYLOAD_BYTES` (more than the default limit). All bytes arrive: the
configured relay answered. The stream is reset: the default one did, and the caller starts a new daemon
(:func:`start_relay_dht`). Everything runs over hivemind's own daemons and streams; a check takes about
1-3 s on a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import hivemind
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import P2P

from p2p_diloco.swarm import relay
from p2p_diloco.swarm.config import SwarmConfig
from p2p_diloco.swarm.dht import SwarmStartError, start_dht, visible_maddrs

logger = logging.getLogger(__name__)

DEFAULT_RELAY_LIMIT_BYTES = 1 << 17
"""libp2p's default data limit per relayed connection and direction (128 KiB)."""
PAYLOAD_BYTES = 4 * DEFAULT_RELAY_LIMIT_BYTES
"""What the check sends through the circuit: well past the default limit, small enough to cost nothing."""
HANDLER = "p2p_diloco.relay_check"
READ_CHUNK = 1 << 16


class RelayVerdict(enum.Enum):
    """What a relay check found."""

    PASSED = "passed"
    """A relayed stream carried the payload, or more of it than the default relay ever carries: the configured
    relay answers."""
    RESET = "reset"
    """The relayed stream was cut before the payload arrived: libp2p's default relay answers."""
    UNREACHABLE = "unreachable"
    """No relayed connection could be made within the time limit (not something a restart fixes)."""


@dataclass(frozen=True)
class RelayCheck:
    verdict: RelayVerdict
    received: int
    """Payload bytes that crossed the relay."""
    detail: str
    seconds: float


def local_dial_address(maddrs: Iterable[str]) -> str | None:
    """The relay's own TCP address to dial from this host: loopback if it listens there, else its first."""
    tcp = [m for m in maddrs if "/tcp/" in m and "/p2p-circuit" not in m and m.startswith(("/ip4/", "/ip6/"))]
    loopback = [m for m in tcp if m.startswith(("/ip4/127.", "/ip6/::1/"))]
    return (loopback or tcp or [None])[0]


async def _check(relay_maddr: str, timeout_s: float) -> RelayCheck:
    started = time.monotonic()
    deadline = started + timeout_s
    relay.install()  # static relays only: the throwaway client reserves with ours at once
    daemons: list[P2P] = []
    received = 0
    done = asyncio.get_running_loop().create_future()

    async def handler(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        try:
            while received < PAYLOAD_BYTES:
                chunk = await reader.read(READ_CHUNK)
                if not chunk:
                    break
                received += len(chunk)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if not done.done():
                done.set_result(received)
            writer.close()

    def result(verdict: RelayVerdict, detail: str) -> RelayCheck:
        return RelayCheck(verdict, received, detail, time.monotonic() - started)

    try:
        # behind NAT, as a volunteer: no address of its own, a slot on our relay
        client, error = await _start_daemon(
            deadline, "the relay", initial_peers=[relay_maddr], host_maddrs=[], no_listen=True, use_relay=True,
            use_auto_relay=True, force_reachability="private", trusted_relays=[relay_maddr], auto_nat=False)
        if client is None:
            return result(RelayVerdict.UNREACHABLE, f"could not reach the relay: {error}")
        daemons.append(client)
        await client.add_binary_stream_handler(HANDLER, handler)
        circuit = f"{relay_maddr}/p2p-circuit/p2p/{client.peer_id.to_base58()}"
        dialer, error = await _start_daemon(deadline, "the circuit", initial_peers=[circuit], host_maddrs=[],
                                            no_listen=True, use_relay=True, auto_nat=False)
        if dialer is None:
            return result(RelayVerdict.UNREACHABLE, f"could not dial through the relay: {error}")
        daemons.append(dialer)
        try:
            _, _, writer = await dialer.call_binary_stream_handler(client.peer_id, HANDLER)
            for offset in range(0, PAYLOAD_BYTES, READ_CHUNK):
                writer.write(bytes(min(READ_CHUNK, PAYLOAD_BYTES - offset)))
                await writer.drain()
            await asyncio.wait_for(asyncio.shield(done), max(0.1, deadline - time.monotonic()))
            writer.close()
        except (ConnectionError, OSError, asyncio.TimeoutError) as e:
            return result(*stream_verdict(received, e))
        return result(*stream_verdict(received, None))
    except Exception as e:  # a daemon that did not start, a relay that refused the reservation
        return result(RelayVerdict.UNREACHABLE, f"{type(e).__name__}: {e}"[:300])
    finally:
        for daemon in daemons:
            try:
                await daemon.shutdown()
            except Exception:  # a daemon already gone
                logger.debug("relay check: shutting down a throwaway daemon failed", exc_info=True)


def stream_verdict(received: int, error: BaseException | None) -> tuple[RelayVerdict, str]:
    """The verdict on a relayed stream that ended (``error``: how, ``None`` if cleanly) after ``received``
    payload bytes. Past :data:`DEFAULT_RELAY_LIMIT_BYTES` the default relay cannot have carried it (its limit
    counts the circuit's framing too), so a stream that stalled there on a loaded host is our relay, slow: a
    restart would only draw the race again. At or below it, the stream was cut: the default relay answered."""
    how = f": {error!r}" if error is not None else ""
    if received >= PAYLOAD_BYTES:
        return RelayVerdict.PASSED, "the whole payload arrived"
    if received > DEFAULT_RELAY_LIMIT_BYTES:
        return RelayVerdict.PASSED, (f"{received} bytes arrived, past libp2p's default relay limit of "
                                     f"{DEFAULT_RELAY_LIMIT_BYTES}, before the stream ended{how}")
    return RelayVerdict.RESET, f"the relayed stream ended after {received} bytes{how}"


START_TRIES = 40
"""Most throwaway daemons the check starts for one connection (each bounded by the check's deadline too)."""
RETRY_S = 0.2


async def _start_daemon(deadline: float, what: str, **options: Any) -> tuple[P2P | None, str]:
    """A throwaway p2p daemon connected to its ``initial_peers``, started again until it connects, at most
    ``START_TRIES`` times and until ``deadline``; ``(None, last error)`` if it never did.

    Why again: what it dials may not answer yet, and neither is worth a verdict. The relay's own daemon has just
    started (seen on the home-network testbed: "failed to connect to bootstrap peers" 0.1 s after the node
    came up, the check said unreachable, and the node ran on with a relay nobody had checked, which turned out
    to be libp2p's default: every relayed all-reduce stream was reset); a circuit exists only once the client's
    reservation is made."""
    last_error = "no attempt"
    for _ in range(START_TRIES):
        if time.monotonic() >= deadline:
            break
        try:
            return await P2P.create(startup_timeout=max(1.0, deadline - time.monotonic()), **options), ""
        except Exception as e:  # noqa: BLE001 - the daemon reports every failure to connect as one error type
            last_error = repr(e)[:200]
            logger.debug("relay check: %s does not answer yet (%s); trying again", what, last_error)
            await asyncio.sleep(RETRY_S)
    return None, last_error


def check_relay(relay_maddr: str, timeout_s: float = 20.0) -> RelayCheck:
    """Check the relay at ``relay_maddr`` (a full multiaddr with ``/p2p/<id>``) with a relayed stream past
    libp2p's default limit. Bounded by ``timeout_s``; never raises.

    Call it where no other thread of this process forks meanwhile (as :func:`start_relay_dht` does, after its
    DHT process started): a process forked while the check starts a throwaway daemon inherits the pipe through
    which ``subprocess.Popen`` learns that the daemon started, and Popen then blocks until that process exits,
    beyond any time limit (seen in a test that started the relay's DHT beside a check on a thread)."""
    try:
        return asyncio.run(asyncio.wait_for(_check(relay_maddr, timeout_s), timeout_s + 10.0))
    except Exception as e:
        return RelayCheck(RelayVerdict.UNREACHABLE, 0, f"{type(e).__name__}: {e}"[:300], timeout_s)


UNREACHABLE_CHECKS = 3
"""Checks of one daemon while the verdict is :attr:`RelayVerdict.UNREACHABLE`. On a loaded host the throwaway
daemons may not connect within a check's time; a node that accepted that verdict at once ran on unchecked, and
with libp2p's default relay answering (most fresh daemons on the home-network testbed) every relayed round
reset. A host that truly cannot dial itself costs ``UNREACHABLE_CHECKS`` timeouts at start, then runs on with
a warning."""


GO_THREADS_ENV = "GOMAXPROCS"
"""The Go runtime's variable for how many OS threads run goroutines at once; the daemon reads it at start."""


@contextlib.contextmanager
def one_go_thread() -> Iterator[None]:
    """Start p2p daemons inside this block with one OS thread for goroutines (see the module's docstring).

    hivemind starts its daemon with a copy of this process's environment (``P2P.create``; the DHT's child
    process inherits it at fork), so the variable is set here and restored on exit. Only a relay host's daemon
    needs it; other daemons keep the Go default (one thread per core)."""
    saved = os.environ.get(GO_THREADS_ENV)
    os.environ[GO_THREADS_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(GO_THREADS_ENV, None)
        else:
            os.environ[GO_THREADS_ENV] = saved


@dataclass(frozen=True)
class RelayStartup:
    """What :func:`start_relay_dht` did: the DHT it left running and the check of every daemon it started."""

    dht: hivemind.DHT
    checks: tuple[RelayCheck, ...]
    """The last check of each daemon started, in order: every one but the last said
    :attr:`RelayVerdict.RESET` (a restart). Empty when the host does not relay (nothing was checked)."""
    limit: int
    """Most daemon starts allowed (``attempts``)."""

    @property
    def check(self) -> RelayCheck | None:
        """The check of the daemon that runs; ``None`` when nothing was checked."""
        return self.checks[-1] if self.checks else None

    @property
    def starts(self) -> int:
        """Daemons started to check the relay (0: not checked)."""
        return len(self.checks)


def start_relay_dht(
    cfg: SwarmConfig, record_validators: Iterable[RecordValidatorBase] = (), attempts: int = 32,
    timeout_s: float = 10.0,
) -> RelayStartup:
    """``start_dht`` for a host that relays (``cfg.relay_service``), with the relay checked at start.

    While the check finds libp2p's default relay answering (:attr:`RelayVerdict.RESET`), the DHT is shut
    down and started again with the same identity file and addresses (so the same join address when
    ``cfg.identity_path`` and a fixed port are given, as ``run_bootstrap`` requires), at most ``attempts`` times
    in all (each fresh daemon is an independent draw; each daemon runs with one goroutine thread, which makes
    our relay win most draws: :func:`one_go_thread`). A check that could not reach the relay is repeated on the
    same daemon (``UNREACHABLE_CHECKS``). Every start is logged with its verdict and, for a restart, why; the
    result counts them. Raises ``SwarmStartError`` as ``start_dht`` does.
    """
    validators = list(record_validators)
    if not (cfg.relay_service and cfg.use_relay):
        return RelayStartup(start_dht(cfg, validators), (), 0)
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    checks: list[RelayCheck] = []
    for attempt in range(1, attempts + 1):
        with one_go_thread():
            dht = start_dht(cfg, validators)
        address = local_dial_address(visible_maddrs(dht))
        if address is None:
            check = RelayCheck(RelayVerdict.UNREACHABLE, 0, "no TCP address of this host to dial", 0.0)
        else:
            check = check_relay(address, timeout_s)
            for _ in range(UNREACHABLE_CHECKS - 1):
                if check.verdict is not RelayVerdict.UNREACHABLE:
                    break
                logger.warning("Relay check: no relayed connection within %.0f s (%s); checking again", timeout_s,
                               check.detail)
                check = check_relay(address, timeout_s)
        checks.append(check)
        restart = check.verdict is RelayVerdict.RESET and attempt < attempts
        why = "; restarting the p2p daemon: libp2p's default relay answers" if restart else ""
        logger.log(logging.INFO if check.verdict is RelayVerdict.PASSED else logging.WARNING,
                   "Relay check, daemon start %d of at most %d: %s in %.1f s (%s)%s", attempt, attempts,
                   check.verdict.value, check.seconds, check.detail, why)
        if check.verdict is not RelayVerdict.RESET:
            log = logger.info if check.verdict is RelayVerdict.PASSED else logger.warning
            log("Relay check %s after %d daemon start(s) (%.1f s): %s", check.verdict.value, attempt,
                check.seconds, check.detail)
            return RelayStartup(dht, tuple(checks), attempts)
        if restart:
            dht.shutdown()
    logger.error("Relay check: the relay still resets relayed streams after %d daemon starts; peers behind NAT "
                 "that rely on it will not average. Restart this node, or give those peers a forwarded port",
                 attempts)
    return RelayStartup(dht, tuple(checks), attempts)


__all__ = ["RelayCheck", "RelayStartup", "RelayVerdict", "SwarmStartError", "check_relay", "local_dial_address",
           "one_go_thread", "start_relay_dht", "stream_verdict", "PAYLOAD_BYTES", "UNREACHABLE_CHECKS",
           "DEFAULT_RELAY_LIMIT_BYTES"]
