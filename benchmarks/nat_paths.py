"""Round and all-reduce time per way in (direct, forwarded, relayed, client), and what a relay costs the
bootstrap node's link: 4 peers in the home-network testbed (benchmarks/testbed.py with ``homes``), every
link limited to ``--rate-mbit``; run as root::

    sudo python -m benchmarks.nat_paths --rate-mbit 20 --out benchmarks/results/nat_paths.json

Paths: ``direct`` (4 public peers), ``forwarded`` (4 home peers, each with a forwarded port it announces,
relays off), ``relayed`` (4 home peers through the bootstrap node's relay), ``client`` (1 public full peer, 3
home peers in client mode). Per path: the median over the peers' rounds in which all 4 averaged together of
the all-reduce time and of the round time (from one round's row to the next in a peer's log), and the bytes
the bootstrap node's link carried per such round, both directions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks.testbed import Testbed, install_signal_teardown, missing_requirements, start_swarm, wait_peers
from p2p_diloco.peer.runlog import read_records

PEERS = 4
FAST = ["--matchmaking-time-s", "3", "--matchmaking-timeout-s", "15", "--allreduce-timeout-s", "60",
        "--next-chunk-timeout-s", "10", "--request-timeout-s", "2", "--state-download-timeout-s", "60",
        "--startup-timeout-s", "20", "--progress-ttl-s", "30", "--batch-size", "4", "--seq-len", "64",
        "--inner-lr", "2e-3", "--warmup-steps", "5", "--eval-every", "0", "--local-steps", "10",
        "--min-local-steps", "10", "--target-group-size", "8", "--run-id", "natb"]


def _setup(path: str, bed_hosts: int) -> tuple[tuple[int, ...], bool, dict[int, list[str]]]:
    peers = range(1, bed_hosts)
    if path == "direct":
        return (), False, {}
    if path == "relayed":
        return tuple(peers), True, {i: ["--use-auto-relay", "true"] for i in peers}
    if path == "client":
        return tuple(peers)[1:], True, {i: ["--client-mode", "true"] for i in tuple(peers)[1:]}
    if path == "forwarded":
        return tuple(peers), False, {}
    raise ValueError(path)


def run_path(path: str, rate_mbit: float, model: str, rounds: int, out: Path) -> dict:
    homes, relay, extra = _setup(path, PEERS + 1)
    with Testbed(PEERS + 1, rate_mbit, homes=homes, prefix=f"nb{path[:3]}") as bed:
        if path == "forwarded":
            for i in homes:
                port = 31400 + i
                bed.forward_port(i, port)
                extra[i] = ["--host-maddrs", f"/ip4/{bed.host_ip(i)}/tcp/{port}",
                            "--announce-maddrs", f"/ip4/{bed.ip(i)}/tcp/{port}"]
        procs = start_swarm(bed, out / path, PEERS, [*FAST, "--model", model, "--max-rounds", str(rounds)],
                            relay=relay, peer_extra=extra)
        codes = wait_peers(procs, 120 + rounds * 120)
        boot_rx, boot_tx = bed.link_bytes(0)
    rows = {}
    for name in procs:
        if name != "bootstrap":
            rows[name] = read_records(out / path / f"{name}.jsonl", "round")
    whole = defaultdict(int)
    for rs in rows.values():
        for r in rs:
            if r["outcome"] in ("averaged", "folded_late") and r["group_size"] == PEERS:
                whole[r["new_epoch"]] += 1
    epochs = {e for e, n in whole.items() if n == PEERS}
    allreduce, round_s = [], []
    for rs in rows.values():
        for prev, r in zip(rs, rs[1:], strict=False):
            if r["new_epoch"] in epochs and r["outcome"] == "averaged":
                round_s.append(r["time"] - prev["time"])
        allreduce += [r["allreduce_seconds"] for r in rs if r["new_epoch"] in epochs and r["outcome"] == "averaged"]
    return {"path": path, "rate_mbit": rate_mbit, "model": model, "peers": PEERS, "exit_codes": codes,
            "whole_rounds": len(epochs), "rounds_run": rounds,
            "allreduce_s_median": statistics.median(allreduce) if allreduce else None,
            "round_s_median": statistics.median(round_s) if round_s else None,
            "bytes_sent_per_peer_round": statistics.median(r["bytes_sent"] for rs in rows.values() for r in rs
                                                           if r["new_epoch"] in epochs) if epochs else None,
            "bootstrap_bytes_per_round": (boot_rx + boot_tx) / len(epochs) if epochs else None,
            "bootstrap_bytes_total": boot_rx + boot_tx}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nat_paths", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate-mbit", type=float, default=20.0)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--paths", nargs="+", default=["direct", "forwarded", "relayed", "client"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/nat_paths.json"))
    parser.add_argument("--logs", type=Path, default=Path("nat-paths-logs"))
    args = parser.parse_args(argv)
    problem = missing_requirements(nat=True)
    if problem:
        print(f"nat_paths: cannot run: {problem}", file=sys.stderr)
        return 1
    install_signal_teardown()
    results = []
    for path in args.paths:
        results.append(run_path(path, args.rate_mbit, args.model, args.rounds, args.logs))
        print(json.dumps(results[-1]), flush=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
