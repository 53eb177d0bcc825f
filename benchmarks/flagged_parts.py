"""What a group member that flags its parts with ``requires_grad`` costs the others' averager processes over many
rounds (issue 51, finding 1).

Three peers (``tests/swarm_helpers/peer.py``, role ``rounds``: the project's ``RoundAverager`` each, on loopback)
average ``--rounds`` rounds of ``--params`` float32 values. In ``clean`` all three are honest; in ``attacked``
the third sends every part and reply with protobuf ``requires_grad`` set (``FlaggingCompression``). After each
round every honest peer samples its averager process's resident memory. Before the fix the flag reached the
shared buffers, whose autograd history kept each round's decoded reply alive: the growth per round is the
number to compare.

Run: ``python -m benchmarks.flagged_parts [--rounds 30] [--params 1000000] [--scenario clean attacked]``;
writes ``benchmarks/results/flagged_parts.json`` (merged by scenario and ``--label``) and ``flagged_parts.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from swarm_helpers.harness import Swarm  # noqa: E402  (the test harness: real peer processes on loopback)

from p2p_diloco.swarm import SwarmConfig, start_dht, visible_maddrs  # noqa: E402

RESULTS = Path(__file__).parent / "results"
FINGERPRINT = "abcdef0123456789"


def run(scenario: str, rounds: int, params: int) -> dict[str, Any]:
    dht = start_dht(SwarmConfig.for_loopback())
    try:
        with tempfile.TemporaryDirectory() as tmp:
            swarm = Swarm(Path(tmp), visible_maddrs(dht))
            cfg = dict(run_id=f"flag-{scenario}", min_group_size=2, target_group_size=3, matchmaking_time_s=4.0,
                       matchmaking_timeout_s=40.0, next_chunk_timeout_s=15.0, allreduce_timeout_s=60.0,
                       request_timeout_s=3.0)
            common = dict(role="rounds", rounds=rounds, shapes=[[params]], fingerprint=FINGERPRINT, cfg=cfg,
                          weight=100.0, expect_due=True)
            honest = [swarm.spawn(f"h{i}", fresh=float(i + 1), **common) for i in range(2)]
            swarm.spawn("third", fresh=3.0, **common,
                        **({"compression": "flag_grad"} if scenario == "attacked" else {}))
            started = time.monotonic()
            try:
                swarm.wait_ready(timeout=120)
                outs = [swarm.result(p, timeout=rounds * 60 + 60) for p in honest]
            finally:
                swarm.stop()
                for peer in swarm.peers:  # each peer's DHT, averager and p2pd share its process group
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(peer.proc.pid, signal.SIGKILL)
            elapsed = time.monotonic() - started
    finally:
        dht.shutdown()
    peers = []
    for peer, out in zip(honest, outs, strict=True):
        rss = [r["averager_rss"] / 2**20 for r in out["rounds"]]
        peers.append(dict(name=peer.name, rss_mib=rss, outcomes=[r["outcome"] for r in out["rounds"]],
                          reasons=[r["reason"] for r in out["rounds"]],
                          group_sizes=[r["group_size"] for r in out["rounds"]],
                          growth_mib_per_round=(rss[-1] - rss[0]) / max(1, len(rss) - 1)))
    return dict(scenario=scenario, rounds=rounds, params=params, seconds=round(elapsed, 1), peers=peers)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, result in sorted(results.items()):
        for peer in result["peers"]:
            ax.plot(range(1, len(peer["rss_mib"]) + 1), peer["rss_mib"], label=f"{name} {peer['name']}")
    ax.set_xlabel("round")
    ax.set_ylabel("averager process RSS (MiB)")
    ax.set_title(f"A member flagging requires_grad ({next(iter(results.values()))['params']:,} values)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--scenario", nargs="+", default=["clean", "attacked"], choices=["clean", "attacked"])
    parser.add_argument("--label", default="", help="suffix of the result's name, e.g. 'unfixed'")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "flagged_parts.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    for scenario in args.scenario:
        result = run(scenario, args.rounds, args.params)
        result.update(commit=commit, machine=f"{platform.machine()}, {platform.processor() or '?'}")
        name = scenario + (f"-{args.label}" if args.label else "")
        results[name] = result
        print(json.dumps({name: [dict(p, rss_mib=[round(x) for x in p["rss_mib"]]) for p in result["peers"]]}))
        path.write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / "flagged_parts.png")


if __name__ == "__main__":
    main()
