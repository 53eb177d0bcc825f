"""The sparse codec against none and 4bit in the simulator: final eval loss and bytes per peer per round.

Runs ``python -m p2p_diloco.simulate`` (diloco mode, tiny preset, 4 workers, H = 10, 6 rounds (``--rounds``), batch 4 x 64,
outer lr 1 and momentum 0: a short run that a shared 2-core machine finishes in minutes) once per codec and seed, through the same core code the swarm
runs (codec, error feedback, the reducers' reply codec), and writes ``results/sparse_codec.json`` and the
``sparse-codec`` section of BENCHMARKS.md::

    python benchmarks/sparse_codec.py --seeds 0              # runs every codec (minutes each on a CPU)
    python benchmarks/sparse_codec.py --rounds 20            # a longer horizon; each horizon keeps its table
    python benchmarks/sparse_codec.py --reuse DIR --seeds 0  # reads DIR/{label}_s{seed}.json written by
                                                             # `python -m p2p_diloco.simulate ... --json`
                                                             # with the same settings (missing labels skipped)

Bytes are the simulator's count of what each peer sends (its parts and, as a reducer, its share of the
replies), per round; a peer receives as much.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
from pathlib import Path

from benchmarks.report import replace_section

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = {
    "none": ["--compression", "none"],
    "4bit": ["--compression", "4bit"],
    "topk_ef095": ["--compression", "topk", "--error-feedback", "--error-feedback-decay", "0.95",
                   "--credit-undelivered", "false"],
    "topk_ef095_credit": ["--compression", "topk", "--error-feedback", "--error-feedback-decay", "0.95",
                          "--credit-undelivered"],
    "topk32_ef095_credit": ["--compression", "topk", "--topk-k", "32", "--error-feedback",
                            "--error-feedback-decay", "0.95", "--credit-undelivered"],
    "2bit_ef095": ["--compression", "2bit", "--error-feedback", "--error-feedback-decay", "0.95"],
}
"""What this script runs: the reducers answer with the aggregate's own top-k (``TopKCodec.reply_codec``)."""
LABELS = {"none": "none", "4bit": "4bit",
          "topk_ef095": "topk 64/4096 + EF 0.95, top-k reply",
          "topk_ef095_credit": "topk 64/4096 + EF 0.95, top-k reply, undelivered credited",
          "topk32_ef095_credit": "topk 32/4096 + EF 0.95, top-k reply, undelivered credited",
          "2bit_ef095": "2bit dense + EF 0.95",
          "topk_union_ef095": "topk 64/4096 + EF 0.95, union reply (before 2cd0c28)",
          "topk_union_ef1": "topk 64/4096 + EF 1.0, union reply (before 2cd0c28)",
          "topk256_union_ef095": "topk 256/4096 + EF 0.95, union reply (before 2cd0c28)"}
"""Labels ``*_union_*`` were measured before the reply became a top-k (commit 2cd0c28): the reducers then
answered with the union of the senders' entries at int8; the stored rows are kept for the comparison."""
BASE = ["--mode", "diloco", "--workers", "4", "--local-steps", "10", "--batch-size", "4", "--seq-len", "64",
        "--eval-batches", "2"]


def _run(label: str, seed: int, rounds: int) -> dict:
    from p2p_diloco.simulate.__main__ import main

    out = RESULTS / f"sparse_codec_{label}_r{rounds}_s{seed}.json"
    code = main([*BASE, "--rounds", str(rounds), *RUNS[label], "--seed", str(seed), "--json", str(out)])
    if code:
        raise SystemExit(f"simulator run {label} seed {seed} failed with {code}")
    return json.loads(out.read_text())


def report(rows: dict[str, list[dict]], rounds: int) -> list[str]:
    none = rows["none"]
    fp32_per_round = none[0]["total_bytes_sent_per_worker"] / len(none[0]["rounds"])
    base_loss = sum(r["final_eval_loss"] for r in none) / len(none)
    lines = [
        f"### {rounds} rounds",
        "",
        f"Simulator (`benchmarks/sparse_codec.py --rounds {rounds}`): diloco mode, tiny preset, 4 workers, H = 10,"
        f" {rounds} rounds, batch 4 x 64,",
        f"outer lr 1, momentum 0; seeds {sorted({r['seed'] for runs in rows.values() for r in runs})}. Bytes per peer per round"
        " both ways (its parts, and its share of the reducers' replies); a peer receives as much.",
        "",
        "| codec | final eval loss | vs none | bytes sent per peer per round | / fp32 |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, runs in rows.items():
        loss = sum(r["final_eval_loss"] for r in runs) / len(runs)
        per_round = sum(r["total_bytes_sent_per_worker"] / len(r["rounds"]) for r in runs) / len(runs)
        lines.append(f"| {LABELS[label]} | {loss:.4f} | {100 * (loss / base_loss - 1):+.2f}% | "
                     f"{per_round:,.0f} | 1/{fp32_per_round / per_round:.1f} |")
    best = "topk_ef095_credit" if "topk_ef095_credit" in rows else "topk_ef095"
    if best not in rows and "topk_union_ef095" in rows:
        best = "topk_union_ef095"
    if best in rows:
        runs = rows[best]
        loss = sum(r["final_eval_loss"] for r in runs) / len(runs)
        ratio = fp32_per_round / (sum(r["total_bytes_sent_per_worker"] / len(r["rounds"]) for r in runs) / len(runs))
        lines += [
            "",
            f"| target (issue 35) | measured ({LABELS[best]}) | met |",
            "| --- | --- | --- |",
            f"| bytes sent per peer per round <= 1/100 of fp32 | 1/{ratio:.1f} | {'yes' if ratio >= 100 else 'no'} |",
            f"| final eval loss within 1% of none | {100 * (loss / base_loss - 1):+.2f}% | "
            f"{'yes' if loss <= 1.01 * base_loss else 'no'} |",
            "",
        ]
    if "topk_union_ef095" in rows and rounds == 6:
        lines += [
            "Why the union reply missed the bytes target: a sender's own parts are 1/140 of fp32, but in the",
            "butterfly all-reduce each reducer sent the aggregate of its slice back to every member as the union of",
            "the senders' entries (up to 4 x 64 per chunk here) with 12-bit offsets (or a bitmap) and int8 values:",
            "most of the bytes. Since 2cd0c28 the reply is the aggregate's own top-k (see the 20-round table and",
            "\"Choosing the reply\" below). Why the loss target is missed in 6 rounds: in",
            "6 rounds each worker sends 1.56% of its values per round, and what waits in the residual has not reached",
            "the shared parameters the next inner phase starts from; the published results are from far longer runs.",
        ]
    return lines


def sweep_report(paths: dict[str, list[Path]], fp32_per_round: float, rows: dict[str, list[dict]]) -> list[str]:
    """The sweep section: each codec at its best outer settings (mean of the sweep's seeds), with a PNG.

    ``paths``: codec label -> the JSONs (their grids merged) of ``python -m p2p_diloco.simulate sweep ... --json``; bytes per round
    come from the stored single runs of the same label (the outer settings do not change a codec's bytes
    beyond the counts of all-zero chunks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps: dict[str, dict] = {}
    for label, label_paths in paths.items():  # several sweeps of one label: their grids together
        for path in label_paths:
            sweep = json.loads(path.read_text())
            if label in sweeps:
                sweeps[label]["points"] += sweep["points"]
            else:
                sweeps[label] = sweep
    for sweep in sweeps.values():
        for point in sweep["points"]:
            point["mean"] = statistics.fmean(point["finals"])
            point["std"] = statistics.stdev(point["finals"]) if len(point["finals"]) > 1 else 0.0
        sweep["best"] = {"diloco": min(sweep["points"], key=lambda p: p["mean"])}
    (RESULTS / "sparse_codec_sweep.json").write_text(json.dumps(sweeps, indent=1))
    base = sweeps["none"]["best"]["diloco"]
    lines = [
        f"Sweep (`python -m p2p_diloco.simulate sweep`, tiny preset, {sweeps['none']['workers']} workers, "
        f"H = {sweeps['none']['local_steps']}, {sweeps['none']['rounds']} rounds, batch 4 x 64, seeds "
        f"{sweeps['none']['seeds']}; equal compute: every cell runs the same inner steps). Each codec at its best"
        " outer lr and momentum of the grid; loss is the mean over seeds (± standard deviation).",
        "",
        "| codec | cells swept (lr/momentum) | best lr | best momentum | final eval loss | vs none at its best |"
        " bytes sent per peer per round | / fp32 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, sweep in sweeps.items():
        best = sweep["best"]["diloco"]
        points = sweep["points"]
        cells = ", ".join(f"{p['outer_lr']:g}/{p['outer_momentum']:g}"
                          for p in sorted(points, key=lambda p: (p["outer_lr"], p["outer_momentum"])))
        runs = rows.get(label, [])
        per_round = (sum(r["total_bytes_sent_per_worker"] / len(r["rounds"]) for r in runs) / len(runs)
                     if runs else float("nan"))
        lines.append(
            f"| {LABELS[label]} | {cells} | {best['outer_lr']:g} | {best['outer_momentum']:g} | "
            f"{best['mean']:.4f} ± {best['std']:.4f} | {100 * (best['mean'] / base['mean'] - 1):+.2f}% | "
            f"{per_round:,.0f} | 1/{fp32_per_round / per_round:.1f} |")
        curves = [c for c in best["curves"] if c]
        mean_curve = [sum(c[i] for c in curves) / len(curves) for i in range(min(map(len, curves)))]
        ax.plot(range(1, len(mean_curve) + 1), mean_curve,
                label=f"{LABELS[label]} (lr {best['outer_lr']:g}, mom {best['outer_momentum']:g})")
    ax.set_xlabel("outer round")
    ax.set_ylabel("eval loss (mean of seeds)")
    ax.set_ylim(top=4.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "sparse_codec_sweep.png", dpi=110)
    plt.close(fig)
    return [*lines, "", "![sparse codec sweep](benchmarks/results/sparse_codec_sweep.png)"]


MINI_SEEDS = [0, 1, 2]


def mini_report(labels: list[str]) -> list[str]:
    """Each of ``labels`` on the ``mini`` preset (4.9M parameters) at its best ``tiny`` cell of the stored sweep
    (``sparse_codec_sweep.json``; ``mini`` is not swept), same settings otherwise, 3 seeds; runs the ones not
    stored in ``sparse_codec_mini.json`` at that cell (minutes each on a CPU) and returns the table against
    ``none``."""
    from p2p_diloco.simulate.__main__ import main as simulate_main

    best = {label: sweep["best"]["diloco"]
            for label, sweep in json.loads((RESULTS / "sparse_codec_sweep.json").read_text()).items()}
    store = RESULTS / "sparse_codec_mini.json"
    stored = json.loads(store.read_text()) if store.exists() else {}
    for label in labels:
        if label not in best:
            raise SystemExit(f"--mini {label}: no sweep of it on tiny to take the outer settings from "
                             f"(run --sweep {label} JSON first)")
        cell = best[label]
        row = stored.get(label)
        if row is not None and (row["outer_lr"], row["outer_momentum"]) == (cell["outer_lr"], cell["outer_momentum"]):
            continue  # stored at the current best tiny cell; a row of an older best is run again
        out = RESULTS / f"sparse_codec_mini_{label}.json"
        settings = ["--model", "mini", "--rounds", "20", "--modes", "diloco", "--outer-lrs", str(cell["outer_lr"]),
                    "--outer-momenta", str(cell["outer_momentum"]), "--seeds", *map(str, MINI_SEEDS)]
        base = [a for a in BASE if a not in ("--mode", "diloco")]
        if simulate_main(["sweep", *base, *RUNS[label], *settings, "--json", str(out)]):
            raise SystemExit(f"the mini sweep of {label} failed")
        point = json.loads(out.read_text())["points"][0]
        stored[label] = dict(seeds=MINI_SEEDS, finals=point["finals"], curves=point["curves"],
                             outer_lr=cell["outer_lr"], outer_momentum=cell["outer_momentum"],
                             settings="mini, 4 workers, H = 10, 20 rounds, batch 4 x 64")
        store.write_text(json.dumps(stored, indent=1))
        out.unlink()
    base_loss = statistics.fmean(stored["none"]["finals"])
    lines = [
        "On `mini` (4.9M parameters; `benchmarks/sparse_codec.py --mini LABEL ...`): 4 workers, H = 10, 20 rounds,"
        " batch 4 x 64, each codec at its best `tiny` cell (not swept on `mini`), seeds"
        f" {MINI_SEEDS}; `benchmarks/results/sparse_codec_mini.json`.",
        "",
        "| codec | outer lr | momentum | final eval loss | vs none |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, row in stored.items():
        loss = statistics.fmean(row["finals"])
        lines.append(f"| {LABELS[label]} | {row['outer_lr']:g} | {row['outer_momentum']:g} | "
                     f"{loss:.4f} ± {statistics.stdev(row['finals']):.4f} | {100 * (loss / base_loss - 1):+.2f}% |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reuse", type=Path, help="read {label}_s{seed}.json from here instead of running")
    parser.add_argument("--sweep", nargs=2, action="append", default=[], metavar=("LABEL", "JSON"),
                        help="a `simulate sweep --json` result for LABEL (none, topk_ef095_credit, ...): "
                             "writes the sweep-at-best-settings table")
    parser.add_argument("--mini", nargs="+", default=[], metavar="LABEL",
                        help="run LABEL (none, 4bit, 2bit_ef095, ...) on the mini preset at its best tiny cell, "
                             "3 seeds, unless stored; writes the mini table")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows: dict[str, list[dict]] = {}
    for label in RUNS:
        for seed in args.seeds:
            if args.reuse:
                path = args.reuse / f"{label}_s{seed}.json"
                if not path.exists():
                    continue
                data = json.loads(path.read_text())
            else:
                data = _run(label, seed, args.rounds)
            assert math.isfinite(data["final_eval_loss"]) and len(data["rounds"]) == args.rounds, path
            rows.setdefault(label, []).append(data)
    RESULTS.mkdir(parents=True, exist_ok=True)
    store = RESULTS / "sparse_codec.json"
    horizons = json.loads(store.read_text()) if store.exists() else {}
    if "none" in horizons:  # the first format held one horizon's rows
        horizons = {"6": horizons}
    horizons[str(args.rounds)] = {**horizons.get(str(args.rounds), {}), **rows}  # rows not rerun stay
    rows = horizons[str(args.rounds)]
    store.write_text(json.dumps(horizons, indent=1))
    lines = [line for key in sorted(horizons, key=int) for line in [*report(horizons[key], int(key)), ""]]
    replace_section(ROOT / "BENCHMARKS.md", "sparse-codec", "\n".join(lines))
    print("\n".join(lines))
    if args.sweep:
        none = rows["none"]
        fp32_per_round = none[0]["total_bytes_sent_per_worker"] / len(none[0]["rounds"])
        paths: dict[str, list[Path]] = {}
        for label, path in args.sweep:
            paths.setdefault(label, []).append(Path(path))
        table = sweep_report(paths, fp32_per_round, rows)
        replace_section(ROOT / "BENCHMARKS.md", "sparse-codec-sweep", "\n".join(table))
        print("\n".join(table))
    if args.mini:
        table = mini_report(args.mini)
        replace_section(ROOT / "BENCHMARKS.md", "sparse-codec-mini", "\n".join(table))
        print("\n".join(table))


if __name__ == "__main__":
    main()
