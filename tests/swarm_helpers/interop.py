"""Interoperability of our DHT with a plain ``hivemind-dht`` node; writes a JSON report.

Usage: python tests/swarm_helpers/interop.py OUT.json

Meant to run inside a private network namespace (``unshare -n``): the stock CLI turns on UPnP port mapping,
which would otherwise send discovery packets to the local network; in the namespace only loopback exists.

1. our DHT A starts and stores a record;
2. ``hivemind-dht`` bootstraps from A (our DHT bootstraps a plain node);
3. our DHT B bootstraps from the plain node only (a plain node bootstraps ours) and reads A's record.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from hivemind.utils import get_dht_time

from p2p_diloco.swarm.config import SwarmConfig
from p2p_diloco.swarm.dht import start_dht, visible_maddrs

MADDR_RE = re.compile(r"--initial_peers (/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)")


def main() -> None:
    out_path = Path(sys.argv[1])
    report: dict[str, object] = {}
    cli = Path(sys.executable).with_name("hivemind-dht")
    first = start_dht(SwarmConfig.for_loopback(run_id="interop"))
    first.store("interop_key", "hello", expiration_time=get_dht_time() + 120)
    log_path = out_path.with_suffix(".cli.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(cli), "--host_maddrs", "/ip4/127.0.0.1/tcp/0", "--initial_peers", *visible_maddrs(first)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, NO_COLOR="1"),
        )
    try:
        cli_maddr = None
        deadline = time.monotonic() + 30
        while cli_maddr is None and time.monotonic() < deadline and proc.poll() is None:
            match = MADDR_RE.search(re.sub(r"\x1b\[[0-9;]*m", "", log_path.read_text(errors="replace")))
            cli_maddr = match.group(1) if match else None
            time.sleep(0.1)
        report["cli_started"] = cli_maddr is not None
        report["cli_alive"] = proc.poll() is None
        if cli_maddr is not None:
            second = start_dht(SwarmConfig.for_loopback(run_id="interop", initial_peers=[cli_maddr]))
            found = None
            deadline = time.monotonic() + 20
            while found is None and time.monotonic() < deadline:
                found = second.get("interop_key", latest=True)
                if found is None:
                    time.sleep(0.2)
            report["value_via_cli_node"] = None if found is None else found.value
            second.shutdown()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        report["cli_log_tail"] = log_path.read_text(errors="replace")[-1500:]
        first.shutdown()
        out_path.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
