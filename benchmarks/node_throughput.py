"""Tokens per second of a 2-rank node (torchrun, gloo on CPU) against a single-process peer, and the per-round
overhead the node layer adds.

Each configuration is one real ``run_peer`` (or ``torchrun --nproc-per-node 2 run_peer``) that starts its
own swarm and steps alone (no other peer: rounds have no matchmaking, so what is left besides training is
the round's bookkeeping and, for a node, its collectives). The tiny model, the same per-rank batch, H inner
steps per round, evaluation off. Per round after the first (which includes start-up):

- ``round_s``: wall seconds between consecutive round ends (the run log's timestamps);
- ``inner_s``: the inner phase (a node's: its slowest rank);
- ``overhead_s``: ``round_s - inner_s``: everything else (outer step, checksums; a node's stats gather,
  parameter broadcast and digest check, and its ranks' skew);
- ``tokens_per_s``: tokens of all ranks / ``round_s``; ``inner_tokens_per_s``: the same / ``inner_s``.

Run: ``python -m benchmarks.node_throughput [--rounds 6]``; writes ``benchmarks/results/node_throughput.json``
and ``.png`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
BATCH, SEQ, H = 8, 128, 20
PEER = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--use-relay", "false", "--model", "tiny", "--batch-size",
        str(BATCH), "--seq-len", str(SEQ), "--local-steps", str(H), "--min-local-steps", str(H),
        "--eval-every", "0", "--device", "cpu", "--warmup-steps", "5"]
CONFIGS = {
    # name: (ranks, threads per process, extra flags)
    "single, 1 thread": (1, 1, []),
    "single, 2 threads": (1, 2, []),
    "node 2 ranks ddp, 1 thread each": (2, 1, ["--node-parallel", "ddp"]),
    "node 2 ranks fsdp2, 1 thread each": (2, 1, ["--node-parallel", "fsdp2"]),
}


def run_config(name: str, ranks: int, threads: int, extra: list[str], rounds: int, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    log = work / "run.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
              if ranks > 1 else [sys.executable])
    args = [*launch, "-m", "p2p_diloco.cli.run_peer", *PEER, *extra, "--max-rounds", str(rounds),
            "--log-file", str(log)]
    with open(work / "out.txt", "w") as out:
        code = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=900).returncode
    if code != 0:
        raise RuntimeError(f"{name}: exit {code}: {(work / 'out.txt').read_text()[-2000:]}")
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    ends = [r for r in rows if r["event"] == "round"]
    per_round = []
    for prev, cur in zip(ends, ends[1:], strict=False):
        round_s = cur["time"] - prev["time"]
        tokens = cur["inner_steps"] * BATCH * SEQ * ranks
        per_round.append({"round_s": round_s, "inner_s": cur["inner_seconds"],
                          "overhead_s": round_s - cur["inner_seconds"], "tokens_per_s": tokens / round_s,
                          "inner_tokens_per_s": tokens / cur["inner_seconds"], "outcome": cur["outcome"]})
    med = {k: statistics.median(r[k] for r in per_round)
           for k in ("round_s", "inner_s", "overhead_s", "tokens_per_s", "inner_tokens_per_s")}
    return {"name": name, "ranks": ranks, "threads": threads, "extra": extra, "rounds": per_round, "median": med}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    load_before = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (ranks, threads, extra)) in enumerate(CONFIGS.items()):
            results.append(run_config(name, ranks, threads, extra, args.rounds, Path(tmp) / str(i)))
            print(name, {k: round(v, 3) for k, v in results[-1]["median"].items()}, flush=True)
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_before": load_before,
                       "load_after": os.getloadavg()},
           "batch_per_rank": BATCH, "seq_len": SEQ, "local_steps": H, "results": results}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "node_throughput.json").write_text(json.dumps(out, indent=1))
    _plot(results, RESULTS / "node_throughput.png")
    base = results[0]["median"]
    print("| configuration | tokens/s (end to end) | inner tokens/s | round (s) | inner (s) | overhead per round (s) "
          "| overhead added vs single, 1 thread (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        m = r["median"]
        print(f"| {r['name']} | {m['tokens_per_s']:,.0f} | {m['inner_tokens_per_s']:,.0f} | {m['round_s']:.2f} | "
              f"{m['inner_s']:.2f} | {m['overhead_s']:.3f} | {m['overhead_s'] - base['overhead_s']:+.3f} |")


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["name"].replace(", ", "\n") for r in results]
    a.bar(names, [r["median"]["tokens_per_s"] for r in results], label="end to end")
    a.bar(names, [r["median"]["inner_tokens_per_s"] for r in results], alpha=0.35, label="inner phase")
    a.set_ylabel("tokens / s (all ranks)")
    a.legend()
    b.bar(names, [r["median"]["overhead_s"] for r in results])
    b.set_ylabel("round - inner phase (s)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"tiny model, batch {BATCH} x {SEQ} per rank, H = {H}, 2-core CPU (gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
