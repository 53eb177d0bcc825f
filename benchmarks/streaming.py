"""Streaming DiLoCo against DiLoCo in the simulator: final eval loss, peak and mean bytes per second per peer.

Runs ``python -m p2p_diloco.simulate --mode streaming`` (tiny preset, 4 workers, H = 12, 5 rounds, batch 4 x 64,
outer lr 1 and momentum 0: equal compute, 60 inner steps per worker; a shared 2-core machine finishes the grid in
about ten minutes) for DiLoCo (F = 1, τ = 0: the ``diloco`` mode bit for bit, ``tests/unit/test_fragments.py``)
and Streaming DiLoCo with F = 2 and 4, τ = 0 and τ = 2 (α = 0.5; and α = 0 at F = 4), each with fp32 and with the smallest codec
(topk-sign 64/4096 with error feedback 0.95), over seeds 0-2. Writes ``results/streaming.json``,
``results/streaming.png`` and the ``streaming`` section of BENCHMARKS.md::

    nice python benchmarks/streaming.py                 # the whole grid
    python benchmarks/streaming.py --report-only        # rewrite table and plot from results/streaming.json

Bytes per second per peer (``simulate.streaming``): every fragment all-reduce's bytes, the bandwidth-optimal
all-reduce of the codec's exact sizes, spread over the time the schedule gives it (τ inner steps, or one step
when it blocks); the peak is the largest rate at any moment, the mean all bytes over the run's virtual time
(1 virtual second per inner step).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

from benchmarks.report import replace_section

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STORE = RESULTS / "streaming.json"
BASE = ["--mode", "streaming", "--workers", "4", "--local-steps", "12", "--rounds", "5", "--batch-size", "4",
        "--seq-len", "64", "--eval-batches", "2"]
CODECS = {
    "fp32": ["--compression", "none"],
    "topk-sign": ["--compression", "topk-sign", "--error-feedback", "--error-feedback-decay", "0.95"],
}
SETTINGS = {
    "DiLoCo": [],
    "F=2, τ=0": ["--fragments", "2"],
    "F=4, τ=0": ["--fragments", "4"],
    "F=2, τ=2, α=0.5": ["--fragments", "2", "--fragment-delay", "2", "--fragment-alpha", "0.5"],
    "F=4, τ=2, α=0.5": ["--fragments", "4", "--fragment-delay", "2", "--fragment-alpha", "0.5"],
    "F=4, τ=2, α=0": ["--fragments", "4", "--fragment-delay", "2"],
}
SEEDS = (0, 1, 2)


def _run(setting: str, codec: str, seed: int) -> dict:
    from p2p_diloco.simulate.__main__ import main

    out = RESULTS / "streaming_runs" / f"{codec}_{setting.replace(', ', '_').replace('=', '')}_s{seed}.json"
    code = main([*BASE, *CODECS[codec], *SETTINGS[setting], "--seed", str(seed), "--json", str(out)])
    if code:
        raise SystemExit(f"simulator run {setting} {codec} seed {seed} failed with {code}")
    data = json.loads(out.read_text())
    out.unlink()
    return {key: data[key] for key in ("seed", "final_eval_loss", "consensus_eval_loss", "peak_bytes_per_s",
                                       "mean_bytes_per_s", "total_bytes_sent_per_worker", "fragment_numels",
                                       "fragment_outcomes", "traffic", "virtual_time_s")}


def _mean(runs: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in runs)


def report(rows: dict[str, dict[str, list[dict]]]) -> list[str]:
    seeds = sorted({r["seed"] for by_setting in rows.values() for runs in by_setting.values() for r in runs})
    lines = [
        f"Simulator (`benchmarks/streaming.py`): `--mode streaming`, tiny preset (837k parameters, 4 layers), "
        f"4 workers, H = 12, 5 rounds (60 inner steps per worker, equal compute), batch 4 x 64, outer lr 1, "
        f"momentum 0; seeds {seeds}. DiLoCo is F = 1, τ = 0 (the `diloco` mode bit for bit). Bytes per peer "
        "(sent; it receives as much): each fragment all-reduce's exact codec bytes spread over the time the "
        "schedule gives it (τ inner steps, one step when it blocks), 1 virtual second per inner step; peak = the "
        "largest rate at any moment, mean = all bytes over the run. Loss: the first worker's own parameters "
        "(consensus: the workers' mean), mean over seeds.",
        "",
        "| codec | setting | final eval loss | vs DiLoCo | consensus loss | peak B/s per peer | peak / DiLoCo | "
        "mean B/s per peer | fragment rounds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for codec, by_setting in rows.items():
        base = by_setting.get("DiLoCo")
        if not base:
            continue
        base_loss, base_peak = _mean(base, "final_eval_loss"), _mean(base, "peak_bytes_per_s")
        for setting, runs in by_setting.items():
            loss, peak = _mean(runs, "final_eval_loss"), _mean(runs, "peak_bytes_per_s")
            outcomes = ", ".join(f"{k} {v}" for k, v in sorted(runs[0]["fragment_outcomes"].items()))
            lines.append(
                f"| {codec} | {setting} | {loss:.4f} | {100 * (loss / base_loss - 1):+.2f}% | "
                f"{_mean(runs, 'consensus_eval_loss'):.4f} | {peak:,.0f} | {peak / base_peak:.3f}x | "
                f"{_mean(runs, 'mean_bytes_per_s'):,.0f} | {outcomes} (seed {runs[0]['seed']}) |")
    lines += ["", "| target (issue 36) | codec | measured | met |", "| --- | --- | --- | --- |"]
    for codec, by_setting in rows.items():
        base, four = by_setting.get("DiLoCo"), by_setting.get("F=4, τ=0")
        if not base or not four:
            continue
        ratio = _mean(four, "peak_bytes_per_s") / _mean(base, "peak_bytes_per_s")
        gap = _mean(four, "final_eval_loss") / _mean(base, "final_eval_loss") - 1
        lines.append(f"| F = 4 peak bandwidth <= 0.3x DiLoCo's | {codec} | {ratio:.3f}x (τ = 0) | "
                     f"{'yes' if ratio <= 0.3 else 'no'} |")
        lines.append(f"| F = 4 eval loss within 1% of DiLoCo's (at most 1% above) | {codec} | {100 * gap:+.2f}% "
                     f"(τ = 0) | {'yes' if gap <= 0.01 else 'no'}{' (lower)' if gap < -0.01 else ''} |")
    lines += [
        "",
        "Reading it. Every setting sends the same bytes (the mean column; the sparse codec's reply sizes vary a",
        "little); fragments only spread them out. The peak falls with the largest fragment's share of the model",
        "(0.52 at F = 2, 0.28 at F = 4: one layer plus the tied embedding, of 4 layers), and τ > 0 spreads each",
        "fragment's bytes over τ steps, halving it again at τ = 2. At fp32 the loss moved by under 1% for every",
        "setting; τ = 2 cost about 0.5% against τ = 0 here (its 2 overlapped steps per fragment round are merged",
        "over), with α = 0 and 0.5 alike. With the sparse codec over this short run (5 rounds; a sparse codec alone",
        "costs tens of percent at such horizons, BENCHMARKS.md \"Sparse-codec\") α = 0.5 ended 23% lower: the merge keeps half of",
        "each worker's local work that the codec has not delivered yet, so the run sits nearer to local training",
        "while the residual still sends the rest; α = 0 with τ = 2 cost 0.9%. This is one short horizon on the",
        "tiny preset; check α on your run length with the simulator before relying on it.",
        "",
        "The swarm side (`run_peer --fragments F`, τ = 0 only: real peers on the namespace testbed, and the host",
        "memory at `150m`) follows below.",
        "",
        "![streaming](benchmarks/results/streaming.png)",
    ]
    return lines


def plot(rows: dict[str, dict[str, list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = rows.get("fp32", {})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for setting in ("DiLoCo", "F=2, τ=0", "F=4, τ=0", "F=4, τ=2, α=0.5"):
        if setting not in runs:
            continue
        traffic = runs[setting][0]["traffic"]
        edges = sorted({t for start, end, _ in traffic for t in (start, end) if end <= 36})
        xs, ys = [0.0, edges[0]], [0.0, 0.0]
        for a, b in zip(edges, edges[1:], strict=False):
            rate = sum(n / (e - s) for s, e, n in traffic if s <= a and e >= b)
            xs += [a, b]
            ys += [rate / 1e6, rate / 1e6]
        left.plot(xs, ys, label=setting, drawstyle="default")
    left.set_xlabel("virtual time (s = inner steps), first 3 rounds")
    left.set_ylabel("MB/s sent per peer")
    left.set_title("fp32, seed 0: traffic over time")
    left.legend()
    labels = list(SETTINGS)
    for offset, codec in enumerate(rows):
        base = _mean(rows[codec]["DiLoCo"], "peak_bytes_per_s")
        values = [_mean(rows[codec][s], "peak_bytes_per_s") / base if s in rows[codec] else 0 for s in labels]
        right.bar([i + 0.4 * offset for i in range(len(labels))], values, width=0.4, label=codec)
    right.axhline(0.3, color="grey", linestyle="--", label="target for F = 4")
    right.set_xticks([i + 0.2 for i in range(len(labels))], labels, rotation=20, fontsize=8)
    right.set_ylabel("peak bytes/s per peer / DiLoCo's")
    right.set_title("peak bandwidth, mean of seeds")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--report-only", action="store_true", help="rewrite table and plot from the JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, list[dict]]] = json.loads(STORE.read_text()) if STORE.exists() else {}
    if not args.report_only:
        for codec in CODECS:
            for setting in SETTINGS:
                for seed in args.seeds:
                    done = rows.setdefault(codec, {}).setdefault(setting, [])
                    if any(r["seed"] == seed for r in done):
                        continue
                    done.append(_run(setting, codec, seed))
                    STORE.write_text(json.dumps(rows))  # after every run: an interrupted grid resumes
    plot(rows, RESULTS / "streaming.png")
    lines = report(rows)
    replace_section(ROOT / "BENCHMARKS.md", "streaming", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
