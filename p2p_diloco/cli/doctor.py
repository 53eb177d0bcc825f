"""``run_peer doctor``: check, before an evening is spent, whether this machine can join the swarm.

It takes exactly the flags of ``run_peer`` (same parser, same config file, same environment) and reports,
each with a fix:

- the installed versions of the key packages, and any that break the declared requirements of hivemind or
  p2p_diloco (the usual protobuf clash);
- the device and dtype training will use;
- free memory and disk against what the model needs;
- whether the p2p daemon starts on the given addresses (a real hivemind DHT, as ``run_peer`` starts it), and
  the ports it got;
- whether the averager starts and publishes state as ``run_peer``'s does, in this peer's mode (client mode
  included: such a peer serves no state);
- whether each initial peer answers, one by one, and, through one that does, who trains the run and
  whether their model is ours (a mismatch makes ``run_peer`` refuse to start), and for a client-mode peer
  whether a full peer is there to average through;
- whether other peers can dial this one, or it needs ``--client-mode`` or a relay.

Exit code 0 when joining would work (warnings included), 1 when it would fail, 2 for a usage error.
Nothing here trains or joins matchmaking: the DHT node answers pings only while the checks run. The local
checks (device, memory, disk) live in :mod:`p2p_diloco.cli.doctor_resources`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.metadata
import ipaddress
import logging
import sys
from collections.abc import Iterable, Sequence

from p2p_diloco.cli.common import make_parser, parse_config, setup_logging
from p2p_diloco.cli.doctor_report import Check
from p2p_diloco.cli.doctor_resources import check_device, check_resources, model_fingerprint_of

logger = logging.getLogger(__name__)
PROG = "run_peer doctor"

PACKAGES = ("torch", "hivemind", "transformers", "datasets", "protobuf", "grpcio", "safetensors",
            "prometheus-client", "numpy")
"""Shown in the report; their versions are what a bug report needs first."""

REQUIREMENT_OWNERS = ("hivemind", "p2p-diloco")
"""Whose declared requirements are checked against what is installed (protobuf and grpcio clashes show up
as a broken requirement of hivemind long before they show up as a crash)."""


# ----------------------------------------------------------------------------------------------- packages


def unmet_requirements(owner_requirements: dict[str, list[str]], installed: dict[str, str]) -> list[str]:
    """Requirements (``"hivemind needs protobuf>=5.29.0, found protobuf 4.25.3"``) that the installed versions break.

    ``owner_requirements`` maps a package to its requirement strings as ``importlib.metadata.requires``
    gives them; ``installed`` maps normalized package names to versions. Extras are not checked; a
    requirement whose package is absent is reported as missing.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version

    problems = []
    for owner, requirements in owner_requirements.items():
        for text in requirements:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            version = installed.get(canonicalize_name(req.name))
            if version is None:
                problems.append(f"{owner} needs {req}, which is not installed")
                continue
            try:
                ok = req.specifier.contains(Version(version), prereleases=True)
            except InvalidVersion:
                continue
            if not ok:
                problems.append(f"{owner} needs {req}, found {req.name} {version}")
    return problems


def check_packages() -> Check:
    from packaging.utils import canonicalize_name

    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()
                 if d.metadata["Name"]}
    shown = ", ".join(f"{p} {installed.get(canonicalize_name(p), 'missing')}" for p in PACKAGES)
    requirements = {}
    for owner in REQUIREMENT_OWNERS:
        try:
            requirements[owner] = importlib.metadata.requires(owner) or []
        except importlib.metadata.PackageNotFoundError:
            requirements[owner] = []
    problems = unmet_requirements(requirements, installed)
    if problems:
        return Check("packages", "fail", f"{shown}; " + "; ".join(problems),
                     "reinstall into a fresh virtual environment: bash scripts/setup.sh (or pip install -e . "
                     "there), so pip resolves versions that fit together")
    return Check("packages", "ok", shown)


# ------------------------------------------------------------------------------------------------ network


def _host(maddr_text: str) -> tuple[str, str] | None:
    """(protocol, value) of the address part of a multiaddr: ip4/ip6 or a dns name."""
    from hivemind.utils.multiaddr import Multiaddr

    try:
        maddr = Multiaddr(maddr_text)
    except Exception:
        return None
    for proto in ("ip4", "ip6", "dns", "dns4", "dns6", "dnsaddr"):
        if proto in maddr:
            return proto, maddr[proto]
    return None


def classify_reachability(visible: Sequence[str], initial_peers: Sequence[str], client_mode: bool,
                          relay_asked: bool = False) -> Check:
    """Can the other peers dial this one? Judged from the addresses the daemon announces.

    Peers of a group dial each other during every all-reduce, so a peer that announces only private
    addresses while the swarm lives on the internet stalls others' rounds: it must run in client mode
    (others need not dial it) or become reachable (port forwarding or a relay). ``relay_asked``: the peer
    runs with ``use_auto_relay`` and ``visible`` holds what a daemon with its initial peers as relays
    announced (:func:`relayed_addresses`).
    """
    from p2p_diloco.swarm.reach import is_public

    if client_mode:
        return Check("reachability", "ok", "client mode: nobody needs to dial this peer; it averages with "
                                           "others but does not aggregate parts for them or serve state")
    relayed = [a for a in visible if "/p2p-circuit" in a]
    if relayed:
        return Check("reachability", "ok", f"reachable through a relay: {relayed[0]}; every byte to and from "
                                           "this peer crosses the relay's link (a forwarded port is faster)")
    if relay_asked:
        return Check("reachability", "fail", "asked for a relay (--use-auto-relay), but no initial peer granted "
                                             "one: other peers cannot dial this one",
                     "the bootstrap nodes relay unless run with --use-relay false: ask their operator; "
                     "meanwhile pass --client-mode true, or forward a TCP port and pass --announce-maddrs")
    public = [a for a in visible if is_public(a)]
    if public:
        return Check("reachability", "ok", f"announces public address(es) {', '.join(public[:3])}; other peers "
                                           "reach it if that TCP port is open in the firewall")
    shown = ", ".join(visible[:3]) or "none"
    remote = [p for p in initial_peers if is_public(p)]
    nat_fix = ("this peer is behind NAT or a firewall. Either pass --client-mode (you still train and "
               "average), or forward a TCP port on your router and pass --host-maddrs /ip4/0.0.0.0/tcp/PORT "
               "--announce-maddrs /ip4/YOUR_PUBLIC_IP/tcp/PORT, or pass --use-auto-relay true to be "
               "reached through a relay")
    if remote:
        return Check("reachability", "fail", f"only private addresses ({shown}) while the swarm is on the "
                                             "internet: other peers cannot dial this one", nat_fix)
    if not initial_peers:
        return Check("reachability", "warn", f"only private addresses ({shown}): a swarm started here is "
                                             "reachable from this network only", nat_fix)
    return Check("reachability", "ok", f"local swarm: the initial peers and this peer ({shown}) share a "
                                       "network")


async def _probe(maddr_text: str, connect_timeout: float, _dht: object, node) -> tuple[str, str]:
    """Runs inside the DHT process: dial one initial peer, then ping its DHT as hivemind's bootstrap does.

    The ping is validated like ``run_peer``'s first one: the remote peer's clock must agree with ours.
    """
    from hivemind.dht.protocol import ValidationError
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    maddr = Multiaddr(maddr_text)
    peer_id = PeerID.from_base58(maddr["p2p"])
    try:
        # hivemind's P2P wrapper has no public dial; its daemon client's connect is what bootstrap uses
        await asyncio.wait_for(node.p2p._client.connect(peer_id, [maddr.decapsulate(Multiaddr(f"/p2p/{maddr['p2p']}"))]), connect_timeout)
    except asyncio.TimeoutError:
        return "timeout", ""
    except Exception as e:
        return "unreachable", " ".join(str(e).split())[:300]
    try:
        answer = await node.protocol.call_ping(peer_id, validate=True, strict=True)
    except ValidationError as e:
        return "rejected", str(e)
    return ("ok", "") if answer is not None else ("silent", "")


def _peer_check(maddr: str, outcome: str, info: str, connect_timeout: float, wait_timeout: float) -> Check:
    name = f"initial peer {maddr}"
    if outcome == "ok":
        return Check(name, "ok", "answered")
    if outcome == "timeout":
        return Check(name, "fail", f"no connection within {connect_timeout:g} s",
                     "check the address; a firewall may drop the packets, or the link is slow "
                     "(raise --startup-timeout-s)")
    if outcome == "unreachable":
        return Check(name, "fail", f"cannot connect ({info})",
                     "is that peer running? Its address and peer id change when it restarts without "
                     "--identity-path; ask its operator for the current line")
    if outcome == "silent":
        return Check(name, "fail", f"connected, but its DHT did not answer within {wait_timeout:g} s",
                     "it may be overloaded or another program; raise --dht-wait-timeout-s on slow links")
    fix = ("synchronise this machine's clock (enable NTP)" if "time" in info
           else "pass --client-mode, or make this peer reachable (see the reachability line)")
    return Check(name, "fail", f"answered but refused this peer: {info}", fix)


def _probe_config(swarm, maddr: str):
    """A throwaway client-mode node that dials only ``maddr``.

    One daemon per address, because a daemon that has reached a peer once reuses that connection (and the
    peer's other known addresses) for every later dial: a stale address listed after a working one of the
    same peer would look alive.
    """
    host = _host(maddr)
    loopback = host is not None and host[0] in ("ip4", "ip6") and ipaddress.ip_address(host[1]).is_loopback
    listen = ("/ip6/::1/tcp/0" if host[0] == "ip6" else "/ip4/127.0.0.1/tcp/0") if loopback else (
        "/ip6/::/tcp/0" if host is not None and host[0] == "ip6" else "/ip4/0.0.0.0/tcp/0")
    return dataclasses.replace(swarm, initial_peers=[], host_maddrs=[listen], announce_maddrs=[],
                               identity_path=None, client_mode=True, nat_port_map=False)


def probe_initial_peer(swarm, maddr: str) -> tuple[Check, list | None, dict[int, int]]:
    """Dial ``maddr`` from a throwaway node; when it answers, also read the run's progress records through it,
    and look for peers of the run under other protocol versions' names (``swarm.protocol``).

    Returns the check, the records (``None`` when the peer did not answer or the read failed) and ``{version:
    peers}`` of other versions.
    """
    from p2p_diloco.swarm.dht import SwarmStartError, start_dht
    from p2p_diloco.swarm.records import fetch_progress, other_versions

    try:
        dht = start_dht(_probe_config(swarm, maddr))
    except SwarmStartError as e:
        return Check(f"initial peer {maddr}", "fail", f"not checked, a probe daemon did not start: {e}"), None, {}
    records, versions = None, {}
    try:
        probe = functools.partial(_probe, maddr, swarm.startup_timeout_s)
        # the probe bounds its dial and its ping; this bound only guards against a wedged DHT process
        bound = swarm.startup_timeout_s + swarm.dht_wait_timeout_s + 30
        try:
            outcome, info = dht.run_coroutine(probe, return_future=True).result(timeout=bound)
        except TimeoutError:
            outcome, info = "timeout", ""
        if outcome == "ok":
            try:
                records = fetch_progress(dht, swarm.run_id)
                versions = other_versions(dht, swarm.run_id)
            except Exception as e:  # the peer answered a ping; a failed read only costs the swarm line
                logger.warning("Could not read the run's progress through %s: %s", maddr, e)
    finally:
        dht.shutdown()
    return _peer_check(maddr, outcome, info, swarm.startup_timeout_s, swarm.dht_wait_timeout_s), records, versions


def classify_versions(versions: dict[int, int], records: Sequence, run_id: str) -> Check | None:
    """A version mismatch: peers of this run that publish under another protocol version's names (another
    release). They and this peer would not see each other (each side averages among its own, nobody is
    banned): a fail when nobody of our version is there, else a warning."""
    if not versions:
        return None
    from p2p_diloco.swarm.protocol import PROTOCOL_VERSION

    found = ", ".join(f"{n} peer(s) on protocol version {v}" for v, n in sorted(versions.items()))
    status = "warn" if records else "fail"
    return Check("protocol version", status,
                 f"run {run_id!r} has {found}; this release speaks version {PROTOCOL_VERSION}, so run_peer would "
                 f"not see them{'' if records else ' and train alone'}",
                 "install the release the run's organisers name (pip install -U p2p_diloco, or their tag), "
                 "on this machine or on theirs")


def classify_swarm(records: Sequence, run_id: str, fingerprint: str | None, client_mode: bool = False) -> Check:
    """What the run looks like from here: who trains it, at which epoch, and whether our model matches.

    ``fingerprint`` is ours (``None`` when it cannot be known without loading weights). A run whose peers
    all train another model refuses this peer at start, as ``SwarmSession`` does. A client-mode peer also
    needs a full peer of our model online: only full peers reduce parts and serve state.
    """
    if not records:
        return Check("swarm", "warn", f"no peer of run {run_id!r} has published progress recently: this peer "
                                      "would train alone until others come",
                     "if the run should be active, check --run-id against the organisers' line")
    epoch = max(r.epoch for r in records)
    seen = f"{len(records)} peer(s) of run {run_id!r}, newest epoch {epoch}"
    if fingerprint is not None and all(r.fingerprint != fingerprint for r in records):
        theirs = ", ".join(sorted({r.fingerprint for r in records}))
        return Check("swarm", "fail", f"{seen}; they train a model with fingerprint {theirs}, ours is "
                                      f"{fingerprint}, so run_peer would refuse to start",
                     "use the run's --model, --seq-len and --tokenizer, or another --run-id for a separate run")
    full = [r for r in records if not r.client_mode and (fingerprint is None or r.fingerprint == fingerprint)]
    if client_mode and not full:
        return Check("swarm", "warn", f"{seen}, but none of them is a full peer of our model: a client-mode peer "
                                      "averages only in a group with one (it sends its parts to full peers, "
                                      "which reduce them) and downloads state only from one, so it would "
                                      "train alone until one comes",
                     "start when the run's full peers are online, or make this peer reachable (see the "
                     "reachability line) and drop --client-mode")
    if fingerprint is None:
        return Check("swarm", "ok", seen)
    mode = f", {len(full)} of them full peers to average through" if client_mode else ""
    return Check("swarm", "ok", f"{seen}; same model as ours ({fingerprint}){mode}")


def check_averager(swarm, dht, fingerprint: str | None) -> Check:
    """Start the averager as ``run_peer`` does, in this configuration's mode, and publish a state as a peer
    does after each round; then stop it. This is ``run_peer``'s own start-up, not a guess about it."""
    import torch

    from p2p_diloco.swarm.averager import RoundAverager
    from p2p_diloco.swarm.state_server import StateServer

    template = [torch.zeros(16)]
    try:
        averager = RoundAverager(template, dht, swarm, fingerprint=fingerprint or "0" * 16)
    except Exception as e:
        return Check("averager", "fail", f"did not start: {type(e).__name__}: {e}",
                     "run the doctor with --verbose and report the log with the flags you used")
    try:
        StateServer(averager).publish(template, template, 0)
        serving = averager.allow_state_sharing
        # A full peer's announcement must reach the DHT; waiting for it also keeps the averager alive until
        # the DHT process has taken its request (a request left behind by a stopped averager crashes it).
        announced = serving and _announced(averager, timeout=swarm.dht_wait_timeout_s)
    except Exception as e:
        return Check("averager", "fail", f"cannot publish its state: {type(e).__name__}: {e}",
                     "run the doctor with --verbose and report the log with the flags you used")
    finally:
        averager.shutdown()
    if swarm.client_mode:
        if serving:
            return Check("averager", "fail", "client mode, yet it offers its state to joiners, who cannot dial it",
                         "report this with the flags you used")
        return Check("averager", "ok", "client mode: started; it sends its parts to full peers, which reduce "
                                       "them, downloads state from them, and serves none")
    if not announced:
        return Check("averager", "warn", f"started, but its state announcement did not reach the DHT within "
                                         f"{swarm.dht_wait_timeout_s:g} s, so joiners would not find it",
                     "the machine may be overloaded; raise --dht-wait-timeout-s")
    return Check("averager", "ok", "started; it reduces a share of each round and serves its state to joiners")


def _announced(averager, timeout: float) -> bool:
    """Whether ``averager``'s offer to serve state is visible in its DHT, polled for up to ``timeout`` s."""
    import time

    key, me = f"{averager.prefix}.all_averagers", averager.peer_id.to_bytes()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = averager.dht.get(key, latest=True)
        if found is not None and isinstance(found.value, dict) and me in found.value:
            return True
        time.sleep(0.1)
    return False


def relayed_addresses(swarm, wait_s: float) -> list[str]:
    """What a throwaway daemon that asks the initial peers for a relay announces, polled up to ``wait_s``
    seconds for a ``/p2p-circuit`` address (a relay that works grants one within a second or two)."""
    import time

    from p2p_diloco.swarm.dht import SwarmStartError, start_dht, visible_maddrs

    try:
        dht = start_dht(dataclasses.replace(swarm, host_maddrs=["/ip4/0.0.0.0/tcp/0"], announce_maddrs=[],
                                            identity_path=None, client_mode=False, nat_port_map=False))
    except SwarmStartError as e:
        logger.warning("No relay probe: %s", e)
        return []
    try:
        deadline, visible = time.monotonic() + wait_s, []
        while time.monotonic() < deadline:
            visible = visible_maddrs(dht, latest=True)
            if any("/p2p-circuit" in a for a in visible):
                break
            time.sleep(0.5)
        return visible
    finally:
        dht.shutdown()


def _listening(maddrs: Sequence[str]) -> str:
    """The addresses the daemon really listens on (ports chosen for ``/tcp/0`` included), without /p2p/ID."""
    shown = sorted({a.split("/p2p/")[0] for a in maddrs if "/p2p-circuit" not in a})
    return ", ".join(shown) or "no address"


def check_network(cfg, fingerprint: str | None = None) -> list[Check]:
    """Start the daemon as ``run_peer`` would (minus the initial peers), then probe each initial peer."""
    try:
        from p2p_diloco.swarm.dht import SwarmStartError, start_dht, visible_maddrs
    except Exception as e:  # a protobuf/grpcio clash breaks hivemind's generated modules at import
        return [Check("p2p daemon", "fail", f"hivemind cannot be imported: {type(e).__name__}: {e}",
                      "reinstall into a fresh virtual environment: rm -rf .venv && bash scripts/setup.sh")]

    try:
        dht = start_dht(dataclasses.replace(cfg.swarm, initial_peers=[]))
    except (SwarmStartError, OSError) as e:
        # OSError: the identity key cannot be written (a read-only folder, e.g. inside a container)
        detail = str(e) if isinstance(e, SwarmStartError) else f"cannot create the identity key: {e}"
        return [Check("p2p daemon", "fail", detail, "" if isinstance(e, SwarmStartError) else
                      "choose an --identity-path in a folder you can write to"),
                Check("initial peers", "warn", "not checked: the daemon did not start")]
    try:
        visible = visible_maddrs(dht, latest=True)
        checks = [Check("p2p daemon", "ok", f"started as {dht.peer_id}, listening on {_listening(visible)}"),
                  check_averager(cfg.swarm, dht, fingerprint)]
        relay_asked = cfg.swarm.use_auto_relay and bool(cfg.swarm.initial_peers) and not cfg.swarm.client_mode
    finally:
        dht.shutdown()
    if relay_asked:
        visible = relayed_addresses(cfg.swarm, wait_s=min(15.0, cfg.swarm.startup_timeout_s))
    reachability = classify_reachability(visible, cfg.swarm.initial_peers, cfg.swarm.client_mode, relay_asked)
    probed = [probe_initial_peer(cfg.swarm, maddr) for maddr in cfg.swarm.initial_peers]
    peers = [check for check, _, _ in probed]
    if peers and not any(c.status == "ok" for c in peers):
        checks += peers
        checks.append(Check("initial peers", "fail", "none of the initial peers answered, so run_peer would "
                                                     "stop at start", "fix one of the lines above"))
    elif peers:
        # hivemind needs one answering initial peer; the others only add redundancy
        checks += [dataclasses.replace(c, status="warn") if c.status == "fail" else c for c in peers]
        records = next((r for _, r, _ in probed if r is not None), None)
        if records is not None:
            checks.append(classify_swarm(records, cfg.run.run_id, fingerprint, cfg.swarm.client_mode))
            versions = next((v for _, r, v in probed if r is not None), {})
            mismatch = classify_versions(versions, records, cfg.run.run_id)
            if mismatch is not None:
                checks.append(mismatch)
    else:
        checks.append(Check("initial peers", "ok", "none given: this peer would start a new swarm"))
    return checks + [reachability]


# ---------------------------------------------------------------------------------------------------- CLI


def report(checks: Iterable[Check]) -> tuple[list[str], int]:
    """The report's lines and the number of failures."""
    lines, failures = [], 0
    for c in checks:
        failures += c.status == "fail"
        lines.append(f"[{c.status.upper() if c.status == 'fail' else c.status:4}] {c.name}: {c.detail}")
        if c.fix and c.status != "ok":
            lines.append(f"       fix: {c.fix}")
    return lines, failures


def main(argv: Sequence[str] | None = None) -> int:
    from p2p_diloco.peer.config import PeerConfig

    parser = make_parser(PROG, "Check whether this machine can join the swarm, before training. Takes the "
                               "same flags as run_peer; exit code 0 when joining would work.", PeerConfig)
    cfg, args = parse_config(parser, PeerConfig, argv)
    setup_logging(args.verbose)
    if not args.verbose:
        # the report says what the daemons did; their start-up lines would only interleave with it
        logging.getLogger("p2p_diloco.swarm.dht").setLevel(logging.WARNING)
    print(f"{PROG}: checking how this machine would join run {cfg.run.run_id!r}", flush=True)
    checks = [check_packages()]
    device_check, device = check_device(cfg.inner.device, cfg.inner.precision)
    checks.append(device_check)
    checks += check_resources(cfg, device)
    for line in report(checks)[0]:
        print(line, flush=True)
    try:
        fingerprint = model_fingerprint_of(cfg)
    except Exception:  # the model line above already says why the model cannot be built
        fingerprint = None
    network = check_network(cfg, fingerprint)
    for line in report(network)[0]:
        print(line, flush=True)
    failures = report(checks + network)[1]
    if failures:
        print(f"result: joining would fail ({failures} problem{'s' if failures > 1 else ''}); fix the lines "
              "marked FAIL and run the doctor again", flush=True)
        return 1
    print("result: ready to join; start training with the same flags: run_peer ...", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
