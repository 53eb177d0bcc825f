"""Outer lr x outer momentum x H x k sweeps behind the convergence tables, three seeds per cell.

Every simulation is one line of ``benchmarks/results/convergence_sweep_runs.jsonl``, appended the moment
it ends, so an interrupted sweep keeps what it ran and a rerun only runs what is missing (the seed-0
cells of the first, one-seed sweep and the table runs of ``convergence.py`` that coincide with a cell
are imported once, see :func:`seed_cache`). ``--report`` (also run at the end of a sweep) assembles the
grids into ``benchmarks/results/convergence_sweep.json`` (read by ``convergence.py`` for its tuned
settings), ``convergence_sweep.png`` and the ``convergence-sweep`` section of ``BENCHMARKS.md``::

    .venv/bin/python benchmarks/convergence_sweep.py --jobs 2     # run what is missing, then report
    .venv/bin/python benchmarks/convergence_sweep.py --report     # report from the runs so far

All runs: the tiny preset, batch 4 x 64, 200 inner steps per worker (rounds = 200 / H), inner AdamW lr
1e-3 with warmup 20 and cosine decay over the run unless a grid says otherwise (``convergence_setup``).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import convergence_setup as S  # noqa: E402
from benchmarks.report import replace_section  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
OUT = RESULTS / "convergence_sweep.json"
RUNS = RESULTS / "convergence_sweep_runs.jsonl"
SEEDS = [0, 1, 2]
TOTAL = S.SWEEP_ROUNDS * S.H


@dataclass
class Grid:
    """One rectangular grid of outer lr x outer momentum at one mode, H, k and inner setting."""

    name: str
    mode: str
    h: int
    lrs: list[float]
    moms: list[float]
    k: int = S.WORKERS
    seeds: list[int] = field(default_factory=lambda: list(SEEDS))
    inner_lr: float = S.INNER_LR
    warmup: int = S.WARMUP

    @property
    def speeds(self) -> list[float]:
        return list(S.SPEEDS) if self.mode == "async-dn" else [1.0] * self.k

    @property
    def rounds(self) -> int:
        return TOTAL // self.h


def grids() -> list[Grid]:
    """The grids, in the order their runs are queued (most important first).

    Sized to what the machine allowed (2 cores shared with other engineers' test runs at load averages of
    3-11; a 200-step k = 4 run took 70-280 s): the full lr x momentum grid with 3 seeds for diloco at
    H = 20; for eager and async-dn the lr slice at momentum 0 (their best family) with 3 seeds and their
    momentum cells with seed 0; the lr slice at H = 5 and 50 with 3 seeds, momentum at H = 5 (40 rounds)
    with seed 0; k = 2 (3 seeds) and k = 8 (2 seeds); the inner lr and warm-up against the outer lr with
    seed 0.
    """
    lr3 = [0.5, 1.0, 1.5]
    one = [0]
    return [
        Grid("diloco-H20", "diloco", 20, [0.3, 0.7, 1.0], [0.0, 0.6, 0.9]),
        Grid("diloco-H20-lr1.5", "diloco", 20, [1.5], [0.0]),
        Grid("eager-H20", "eager", 20, [0.5, 0.7, 1.0], [0.0]),
        Grid("async-dn-H20", "async-dn", 20, [0.7, 1.0, 1.5], [0.0]),
        Grid("diloco-k2-H20", "diloco", 20, [0.7, 1.0, 1.5], [0.0], k=2),
        # k = 8 costs twice a k = 4 run: its first seed early, its second at the end (same name: the later
        # entry, a superset, is the one reported).
        Grid("diloco-k8-H20", "diloco", 20, [0.7, 1.0, 1.5], [0.0], k=8, seeds=one),
        Grid("diloco-ilr5e-4-H20", "diloco", 20, [0.7, 1.0, 1.5], [0.0], inner_lr=5e-4, seeds=one),
        Grid("diloco-ilr2e-3-H20", "diloco", 20, [0.7, 1.0, 1.5], [0.0], inner_lr=2e-3, seeds=one),
        Grid("diloco-H5", "diloco", 5, lr3, [0.0]),
        Grid("diloco-H50", "diloco", 50, lr3, [0.0]),
        # Momentum at 40 rounds, at about the effective steps (lr / (1 - momentum)) 0.25-4 around H = 20's best.
        Grid("diloco-H5-mom", "diloco", 5, [0.1, 0.4], [0.6, 0.9], seeds=one),
        Grid("diloco-wu5-H20", "diloco", 20, [0.7, 1.0, 1.5], [0.0], warmup=5, seeds=one),
        Grid("diloco-wu60-H20", "diloco", 20, [0.7, 1.0, 1.5], [0.0], warmup=60, seeds=one),
        Grid("diloco-k8-H20", "diloco", 20, [0.7, 1.0, 1.5], [0.0], k=8, seeds=[0, 1]),
        Grid("eager-H20-mom", "eager", 20, [0.7, 1.0], [0.0, 0.6, 0.9], seeds=one),
        Grid("async-dn-H20-mom", "async-dn", 20, [0.7, 1.0], [0.0, 0.6, 0.9], seeds=one),
    ]


def key(mode: str, h: int, k: int, lr: float, mom: float, inner_lr: float, warmup: int, seed: int) -> str:
    return f"{mode}|H{h}|k{k}|lr{lr:g}|m{mom:g}|ilr{inner_lr:g}|wu{warmup}|s{seed}"


def grid_keys(g: Grid) -> list[tuple[str, float, float, int]]:
    return [(key(g.mode, g.h, g.k, lr, m, g.inner_lr, g.warmup, s), lr, m, s)
            for lr in g.lrs for m in g.moms for s in g.seeds]


def load_cache() -> dict[str, dict]:
    if not RUNS.exists():
        return {}
    out = {}
    for line in RUNS.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out[r["key"]] = r
    return out


def append(rec: dict) -> None:
    with RUNS.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def seed_cache() -> None:
    """Import, once, the runs of the earlier sweep (seed 0) and of ``convergence.json`` that are grid cells.

    Same configuration, same seed, same code path (batched for diloco and eager): the simulator is
    deterministic per seed, so these are the numbers a rerun would give (the table's diloco seed 0, 2.3354,
    equals the sweep's cell).
    """
    if RUNS.exists():
        return
    RUNS.parent.mkdir(parents=True, exist_ok=True)
    recs: list[dict] = []
    old = RESULTS / "convergence_sweep.json"
    if old.exists():
        for name, g in json.loads(old.read_text())["grids"].items():
            mode = name.split("-H")[0]
            for p in g["points"]:
                for seed, final, curve in zip(g["seeds"], p["finals"], p["curves"], strict=True):
                    recs.append(dict(key=key(mode, g["local_steps"], g["workers"], p["outer_lr"],
                                             p["outer_momentum"], S.INNER_LR, S.WARMUP, seed),
                                     final=final, curve=curve, source="convergence_sweep.json (first sweep)"))
    table = RESULTS / "convergence.json"
    if table.exists():
        for label, runs in json.loads(table.read_text())["per_seed"].items():
            for r in runs:
                if r["mode"] not in ("diloco", "eager", "async-dn") or r.get("compression", "none") != "none":
                    continue
                recs.append(dict(key=key(r["mode"], r["local_steps"], r["workers"], r["outer_lr"],
                                         r["outer_momentum"], S.INNER_LR, S.WARMUP, r["seed"]),
                                 final=r["final_eval_loss"], curve=[x["eval_loss"] for x in r["rounds"]],
                                 source=f"convergence.json ({label})"))
    seen: set[str] = set()
    for rec in recs:
        if rec["key"] not in seen:
            seen.add(rec["key"])
            append(rec)


def one(job: tuple[str, str, int, int, float, float, float, int, int, list[float]]) -> dict:
    """One simulation in a worker process (one torch thread)."""
    from p2p_diloco.simulate.engine import SimConfig
    from p2p_diloco.simulate.modes import run

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    k_, mode, h, k, lr, mom, inner_lr, warmup, seed, speeds = job
    rounds = TOTAL // h
    cfg = S.config(h, rounds, seed, outer_lr=lr, outer_momentum=mom, inner_lr=inner_lr)
    cfg.inner.warmup_steps = warmup
    t0 = time.time()
    res = run(cfg, SimConfig(mode, k, rounds, list(speeds), batched=mode != "async-dn" and k > 1))
    return dict(key=k_, final=res.final_eval_loss, curve=[r.eval_loss for r in res.rounds],
                wall_s=time.time() - t0, load_1min=os.getloadavg()[0], source="convergence_sweep.py")


def missing_jobs(only: list[str] | None) -> list[tuple]:
    cache = load_cache()
    jobs, queued = [], set()
    for g in grids():
        if only and g.name not in only:
            continue
        for k_, lr, m, s in grid_keys(g):
            if k_ not in cache and k_ not in queued:
                queued.add(k_)
                jobs.append((k_, g.mode, g.h, g.k, lr, m, g.inner_lr, g.warmup, s, g.speeds))
    return jobs


def run_missing(jobs_n: int, only: list[str] | None) -> None:
    jobs = missing_jobs(only)
    print(f"{len(jobs)} simulations to run", flush=True)
    if not jobs:
        return
    with ProcessPoolExecutor(jobs_n, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(one, j) for j in jobs]
        for fut in as_completed(futures):
            rec = fut.result()
            append(rec)
            print(f"{rec['key']}: {rec['final']:.4f} ({rec['wall_s']:.0f} s, load {rec['load_1min']:.1f})",
                  flush=True)


# ----------------------------------------------------------------------------------------------- report


def assemble() -> dict:
    """Grids from the runs so far: every cell with at least one seed; mean, std and the seeds it has."""
    from p2p_diloco.simulate.sweep import SweepPoint, SweepResult

    cache = load_cache()
    out: dict[str, dict] = {}
    for g in grids():
        points = []
        for lr in g.lrs:
            for m in g.moms:
                p = SweepPoint(g.mode, lr, m)
                seeds = []
                for s in g.seeds:
                    r = cache.get(key(g.mode, g.h, g.k, lr, m, g.inner_lr, g.warmup, s))
                    if r is not None:
                        p.finals.append(r["final"])
                        p.curves.append(r["curve"])
                        seeds.append(s)
                if p.finals:
                    p.seeds = seeds  # type: ignore[attr-defined]
                    points.append(p)
        if not points:
            continue
        res = SweepResult(g.k, g.h, g.rounds, g.seeds, S.MODEL, points)
        d = res.as_dict()
        for pd, p in zip(d["points"], points, strict=True):
            pd.update(seeds=p.seeds, mean=p.mean, std=p.std)  # type: ignore[attr-defined]
        d.update(speeds=g.speeds, batch=S.BATCH, seq_len=S.SEQ_LEN, inner_lr=g.inner_lr, warmup=g.warmup,
                 complete=all(len(p.finals) == len(g.seeds) for p in points) and
                 len(points) == len(g.lrs) * len(g.moms))
        out[g.name] = d
    walls = [r["wall_s"] for r in cache.values() if "wall_s" in r]
    loads = [r["load_1min"] for r in cache.values() if "load_1min" in r]
    return {"grids": out, "runs": len(cache), "new_runs": len(walls),
            "new_runs_wall_s": sum(walls), "load_1min_range": [min(loads), max(loads)] if loads else None}


def _best(g: dict) -> dict:
    return min(g["points"], key=lambda p: p["mean"])


def _cell(g: dict, lr: float, m: float) -> dict | None:
    return next((p for p in g["points"] if p["outer_lr"] == lr and p["outer_momentum"] == m), None)


def _fmt(p: dict | None) -> str:
    if p is None:
        return "-"
    n = len(p["finals"])
    return f"{p['mean']:.4f} ± {p['std']:.4f}" if n > 1 else f"{p['mean']:.4f} (seed {p['seeds'][0]})"


def report_lines(payload: dict) -> list[str]:
    gs = payload["grids"]
    lines = [
        f"`benchmarks/convergence_sweep.py --jobs 2`: tiny preset, batch {S.BATCH} x {S.SEQ_LEN}, {TOTAL} inner "
        f"steps per worker in every cell (rounds = {TOTAL} / H), inner AdamW lr {S.INNER_LR:g} with warmup "
        f"{S.WARMUP} and cosine decay over the run unless the grid says otherwise, k = {S.WORKERS} unless the "
        "grid says otherwise; async-dn at speeds [1, 1, 1, 0.4], equal compute. Final eval loss, mean ± std "
        f"over the seeds listed per grid. {payload['runs']} simulations, {payload['new_runs']} of them run by "
        f"this version of the sweep ({payload['new_runs_wall_s'] / 60:.0f} process-minutes, 2 processes x 1 "
        f"thread, 1-minute load average {payload['load_1min_range'][0]:.1f}-{payload['load_1min_range'][1]:.1f} "
        "at their ends), the others imported from the first sweep and the tables (same configuration, seed and "
        "code path)." if payload["load_1min_range"] else "", "",
    ]
    lines += slice_lines(gs)
    lines += ["", "Every grid: rows outer lr, columns outer momentum (effective outer step = lr / (1 - momentum)); "
              "a cell with one seed says which.", ""]
    for name, g in gs.items():
        moms = sorted({p["outer_momentum"] for p in g["points"]})
        lrs = sorted({p["outer_lr"] for p in g["points"]})
        b = _best(g)
        lines += [f"**{name}** (k = {g['workers']}, H = {g['local_steps']}, {g['rounds']} rounds, inner lr "
                  f"{g['inner_lr']:g}, warmup {g['warmup']}, seeds {g['seeds']}"
                  f"{'' if g['complete'] else ', incomplete'})", "",
                  "| outer lr | " + " | ".join(f"momentum {m:g}" for m in moms) + " |",
                  "| --- |" + " --- |" * len(moms)]
        for lr in lrs:
            cells = []
            for m in moms:
                p = _cell(g, lr, m)
                star = " **best**" if p is b else ""
                cells.append(_fmt(p) + star)
            lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["| grid | best (lr, momentum) | final eval loss | nearest grid neighbours (relative loss over the "
              "seeds both have [how many]) |",
              "| --- | --- | --- | --- |"]
    for name, g in gs.items():
        if len(g["points"]) < 2:
            continue
        b = _best(g)
        lrs = sorted({p["outer_lr"] for p in g["points"]})
        moms = sorted({p["outer_momentum"] for p in g["points"]})
        i, j = lrs.index(b["outer_lr"]), moms.index(b["outer_momentum"])
        sens = []
        for label, (a, c) in (("lr down", (i - 1, j)), ("lr up", (i + 1, j)), ("momentum down", (i, j - 1)),
                              ("momentum up", (i, j + 1))):
            p = _cell(g, lrs[a], moms[c]) if 0 <= a < len(lrs) and 0 <= c < len(moms) else None
            if p is not None:
                sens.append(f"{label} {_rel(p, b)}")
        lines.append(f"| {name} | {b['outer_lr']:g}, {b['outer_momentum']:g} | {_fmt(b)} | "
                     f"{', '.join(sens) or '-'} |")
    lines += ["", "![sweeps](benchmarks/results/convergence_sweep.png)"]
    return lines


SLICE_LRS = [0.3, 0.5, 0.7, 1.0, 1.5]


def _rel(p: dict, best: dict) -> str:
    """``p``'s loss relative to ``best``'s over the seeds both have (seed 0 alone runs lower than the mean
    of three here, so cells with different seeds are not compared); [number of seeds compared]."""
    common = [s for s in p["seeds"] if s in best["seeds"]]
    if not common:
        return "?"
    a = statistics.fmean(f for s, f in zip(p["seeds"], p["finals"], strict=True) if s in common)
    b = statistics.fmean(f for s, f in zip(best["seeds"], best["finals"], strict=True) if s in common)
    return f"{(a / b - 1) * 100:+.1f}% [{len(common)}]"


def slice_lines(gs: dict[str, dict]) -> list[str]:
    """How the best outer lr (momentum 0) moves with H, k, the mode and the inner settings: per setting,
    each lr's loss relative to the best lr of that setting (the same cell from several grids counts with
    its most seeds)."""
    rows: dict[tuple, dict[float, dict]] = {}
    for g in gs.values():
        mode = g["points"][0]["mode"]
        row = rows.setdefault((mode, g["workers"], g["local_steps"], g["rounds"], g["inner_lr"], g["warmup"]), {})
        for p in g["points"]:
            if p["outer_momentum"] == 0 and (p["outer_lr"] not in row
                                             or len(p["finals"]) > len(row[p["outer_lr"]]["finals"])):
                row[p["outer_lr"]] = p
    out = ["**How the best outer lr moves** (momentum 0, outer SGD; lr 1 = FedAvg). Each lr's final loss "
           "relative to the best lr of its row over the seeds both have [how many].", "",
           "| mode | k | H | rounds | inner lr, warmup | best lr | best loss | "
           + " | ".join(f"lr {lr:g}" for lr in SLICE_LRS) + " |",
           "| --- " * (7 + len(SLICE_LRS)) + "|"]
    for (mode, k, h, rounds, ilr, wu), cells in rows.items():
        if len(cells) < 2:
            continue
        best = min(cells.values(), key=lambda p: p["mean"])
        rel = [_rel(cells[lr], best) if lr in cells else "" for lr in SLICE_LRS]
        out.append(f"| {mode} | {k} | {h} | {rounds} | {ilr:g}, {wu} | {best['outer_lr']:g} | {_fmt(best)} | "
                   + " | ".join(rel) + " |")
    return out


def plot(payload: dict) -> None:
    """One panel per grid: final loss against outer lr, one line per momentum (mean ± std)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grids = payload["grids"]
    # A one-cell extension ("diloco-H20-lr1.5") is drawn in its grid's panel.
    gs = [(n, dict(g, points=g["points"] + [p for m, e in grids.items() if m.startswith(n + "-lr")
                                           for p in e["points"]]))
          for n, g in grids.items() if len({p["outer_lr"] for p in g["points"]}) > 1]
    cols = 4
    rows = (len(gs) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, (name, g) in zip(axes.flat, gs, strict=False):
        for m in sorted({p["outer_momentum"] for p in g["points"]}):
            row = sorted((p for p in g["points"] if p["outer_momentum"] == m), key=lambda p: p["outer_lr"])
            ax.errorbar([p["outer_lr"] for p in row], [p["mean"] for p in row], yerr=[p["std"] for p in row],
                        marker="o", capsize=3, label=f"mom {m:g}")
        b = _best(g)
        ax.plot([b["outer_lr"]], [b["mean"]], "k*", markersize=12)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("outer lr")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(gs):]:
        ax.axis("off")
    axes[0][0].set_ylabel("final eval loss")
    fig.tight_layout()
    fig.savefig(RESULTS / "convergence_sweep.png", dpi=100)
    plt.close(fig)


def report() -> None:
    payload = assemble()
    OUT.write_text(json.dumps(payload, indent=1))
    plot(payload)
    replace_section(ROOT / "BENCHMARKS.md", "convergence-sweep", "\n".join(report_lines(payload)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=None, help="grid names to run (default: all)")
    parser.add_argument("--report", action="store_true", help="only assemble and report the runs so far")
    parser.add_argument("--list", action="store_true", help="print the simulations still missing")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    seed_cache()
    if args.list:
        for j in missing_jobs(args.only):
            print(j[0])
        return 0
    if not args.report:
        run_missing(args.jobs, args.only)
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
