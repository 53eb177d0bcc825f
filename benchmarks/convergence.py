"""Convergence benchmark: the papers' comparisons at small scale, on the embedded corpus.

Runs the simulator's modes at equal total compute (rounds x H x k inner steps), writes
``benchmarks/results/convergence.json``, a plot of eval loss against virtual time
(``benchmarks/results/convergence.png``) and the table between the ``convergence`` markers of
``BENCHMARKS.md``. Usage::

    .venv/bin/python benchmarks/convergence.py            # full run (about 30 minutes on 2 CPU cores)
    .venv/bin/python benchmarks/convergence.py --rounds 3 # a quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import replace_section  # noqa: E402
from p2p_diloco.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, RunConfig, TrainConfig  # noqa: E402
from p2p_diloco.simulate import SimConfig, run  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SPEEDS = [1.0, 1.0, 1.0, 0.4]
# (label, mode, compression)
RUNS = [
    ("ddp", "ddp", "none"),
    ("diloco", "diloco", "none"),
    ("fedavg", "fedavg", "none"),
    ("async", "async", "none"),
    ("async-dn", "async-dn", "none"),
    ("eager", "eager", "none"),
    ("diloco-fp16", "diloco", "fp16"),
    ("diloco-int8", "diloco", "int8"),
    ("diloco-4bit", "diloco", "4bit"),
]


def config(local_steps: int, rounds: int, compression: str, seed: int) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig("tiny", seq_len=128),
        data=DataConfig(eval_batches=16),
        inner=InnerConfig(batch_size=8, lr=1e-3, warmup_steps=20, total_steps=rounds * local_steps),
        outer=OuterConfig(local_steps=local_steps, min_local_steps=2, compression=compression),
        run=RunConfig(seed=seed),
    )


def time_to_reach(rounds: list[dict], target: float) -> float | None:
    """Virtual time at which eval loss first reaches ``target`` (linear interpolation between records)."""
    prev_t, prev_l = 0.0, float("inf")
    for r in rounds:
        t, loss = r["virtual_time_s"], r["eval_loss"]
        if loss <= target:
            if prev_l == float("inf"):
                return t
            return prev_t + (t - prev_t) * (prev_l - target) / (prev_l - loss)
        prev_t, prev_l = t, loss
    return None


def figures(by_label: dict[str, dict]) -> list[tuple[str, str, str, bool | None]]:
    """(figure, target, measured, met) rows."""
    rows: list[tuple[str, str, str, bool | None]] = []
    d, ddp = by_label.get("diloco"), by_label.get("ddp")
    if d and ddp:
        ratio = d["final_eval_loss"] / ddp["final_eval_loss"]
        comm = ddp["total_bytes_sent_per_worker"] / max(1, d["total_bytes_sent_per_worker"])
        rows.append(("diloco / ddp final eval loss", "<= 1.00", f"{ratio:.3f}", ratio <= 1.0))
        rows.append(("ddp bytes / diloco bytes", f">= H = {d['local_steps']}", f"{comm:.1f}",
                     comm >= d["local_steps"]))
    if d and by_label.get("fedavg"):
        f = by_label["fedavg"]["final_eval_loss"]
        rows.append(("diloco vs fedavg final eval loss", "diloco lower", f"{d['final_eval_loss']:.4f} vs {f:.4f}",
                     d["final_eval_loss"] < f))
    if d and by_label.get("async-dn"):
        t_sync = d["virtual_time_s"]
        t_dn = time_to_reach(by_label["async-dn"]["rounds"], d["final_eval_loss"])
        measured = "never reached" if t_dn is None else f"{t_dn / t_sync:.2f}"
        rows.append(("async-dn time to diloco's final loss / diloco time", "<= 0.8", measured,
                     None if t_dn is None else t_dn / t_sync <= 0.8))
    if d and by_label.get("async"):
        a = by_label["async"]["final_eval_loss"]
        rows.append(("naive async vs diloco final loss (equal compute)", "async worse",
                     f"{a:.4f} vs {d['final_eval_loss']:.4f}", a > d["final_eval_loss"]))
    if d and by_label.get("eager"):
        rel = by_label["eager"]["final_eval_loss"] / d["final_eval_loss"] - 1
        rows.append(("eager vs diloco final loss", "within 2%", f"{rel * 100:+.2f}%", abs(rel) <= 0.02))
    q = by_label.get("diloco-4bit")
    if d and q:
        rel = q["final_eval_loss"] / d["final_eval_loss"] - 1
        frac = q["total_bytes_sent_per_worker"] / d["total_bytes_sent_per_worker"]
        rows.append(("4bit vs none final loss", "within 1%", f"{rel * 100:+.2f}%", abs(rel) <= 0.01))
        rows.append(("4bit bytes / fp32 bytes", "1/8 = 0.125", f"{frac:.4f}", frac <= 0.125))
    return rows


def write_report(payload: dict) -> None:
    by_label = {r["label"]: r for r in payload["runs"]}
    lines = [
        f"Tiny Llama ({payload['params']:,} parameters) on the embedded corpus, k = {payload['workers']}, "
        f"H = {payload['local_steps']}, {payload['rounds']} rounds, speeds {payload['speeds']}, "
        f"seeds {payload['seeds']} (median), equal total compute. Measured on {payload['hardware']} "
        f"in {payload['wall_s'] / 60:.0f} min.",
        "",
        "| run | final eval loss | virtual time (s) | MB sent per worker | inner steps |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in payload["runs"]:
        lines.append(f"| {r['label']} | {r['final_eval_loss']:.4f} | {r['virtual_time_s']:.0f} | "
                     f"{r['total_bytes_sent_per_worker'] / 1e6:.2f} | {r['total_inner_steps']} |")
    lines += ["", "| figure | target | measured | met |", "| --- | --- | --- | --- |"]
    for name, target, measured, met in figures(by_label):
        lines.append(f"| {name} | {target} | {measured} | {'yes' if met else 'no' if met is False else '-'} |")
    lines += ["", "![eval loss against virtual time](benchmarks/results/convergence.png)"]
    replace_section(ROOT / "BENCHMARKS.md", "convergence", "\n".join(lines))


def plot(payload: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in payload["runs"]:
        xs = [0.0] + [x["virtual_time_s"] for x in r["rounds"]]
        ys = [r["initial_eval_loss"]] + [x["eval_loss"] for x in r["rounds"]]
        ax.plot(xs, ys, label=r["label"], marker=".")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("eval loss")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.set_title(f"k={payload['workers']}, H={payload['local_steps']}, speeds {payload['speeds']}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "convergence.png", dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--local-steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--only", nargs="*", default=None, help="labels to run (default: all)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    started = time.time()
    runs = []
    for label, mode, compression in RUNS:
        if args.only and label not in args.only:
            continue
        per_seed = []
        for seed in args.seeds:
            cfg = config(args.local_steps, args.rounds, compression, seed)
            t0 = time.time()
            res = run(cfg, SimConfig(mode, len(SPEEDS), args.rounds, list(SPEEDS))).as_dict()
            res["wall_s"] = time.time() - t0
            per_seed.append(res)
            print(f"{label:>12} seed {seed}: {res['initial_eval_loss']:.4f} -> {res['final_eval_loss']:.4f} "
                  f"({res['wall_s']:.0f} s)", flush=True)
        best = sorted(per_seed, key=lambda r: r["final_eval_loss"])[len(per_seed) // 2]
        best = dict(best, label=label, final_eval_loss=statistics.median(r["final_eval_loss"] for r in per_seed),
                    per_seed_final=[r["final_eval_loss"] for r in per_seed])
        runs.append(best)
    from p2p_diloco.models import build_model, count_parameters

    payload = {
        "workers": len(SPEEDS), "speeds": SPEEDS, "local_steps": args.local_steps, "rounds": args.rounds,
        "seeds": args.seeds, "params": count_parameters(build_model("tiny", 259, 128)),
        "hardware": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, CPU",
        "wall_s": time.time() - started, "runs": runs,
    }
    (RESULTS / "convergence.json").write_text(json.dumps(payload, indent=1))
    plot(payload)
    write_report(payload)
    for row in figures({r["label"]: r for r in runs}):
        print(" | ".join(str(x) for x in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
