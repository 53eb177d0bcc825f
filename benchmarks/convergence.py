"""Convergence benchmark: the papers' comparisons at small scale, with tuned outer settings.

Runs every table run over several seeds (``--jobs`` processes), with each mode at the outer lr and
momentum its sweep found best (``benchmarks/results/convergence_sweep.json``, written by
``benchmarks/convergence_sweep.py``; the paper's 0.7/0.9 where a sweep is missing), and writes
``benchmarks/results/convergence.json``, ``convergence.png`` (replicas, equal per-worker steps),
``convergence_time.png`` (modes against virtual time at speeds [1, 1, 1, 0.4]) and the section between the
``convergence`` markers of ``BENCHMARKS.md``. Usage::

    .venv/bin/python benchmarks/convergence.py --jobs 2        # the full tables (< 45 min on 2 CPU cores)
    .venv/bin/python benchmarks/convergence.py --rounds 2 --seeds 0 --only single diloco   # a quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import convergence_setup as S  # noqa: E402
from benchmarks.report import replace_section  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PAPER = (0.7, 0.9)


def tuned() -> dict[str, tuple[float, float]]:
    """Best (outer lr, momentum) per mode from the sweep JSON (the paper's 0.7/0.9 where none ran).

    ``diloco``: the best cell of the diloco sweep at H = 20 (extra lr cells included); ``nesterov``: the
    best with momentum > 0; ``sgd``: the best with momentum 0 (outer SGD; lr 1 is FedAvg).
    """
    out = {"diloco": PAPER, "nesterov": PAPER, "eager": PAPER, "async-dn": PAPER, "sgd": (1.0, 0.0)}
    path = RESULTS / "convergence_sweep.json"
    if not path.exists():
        return out
    grids = json.loads(path.read_text())["grids"]
    def cells(mode: str) -> list[dict]:
        # Every grid of this mode at the tables' H ("diloco-H20", "diloco-H20-lr1.5", ...).
        return [p for name, g in grids.items() if name.split("-H")[0] == mode
                and name.split("-H")[1].split("-")[0] == str(S.H) for p in g["points"]]

    def best_of(cells: list[dict]) -> tuple[float, float] | None:
        # A setting in several grids (a 3-seed grid and a 1-seed slice) counts with its most seeds.
        by: dict[tuple[float, float], dict] = {}
        for p in cells:
            k = (p["outer_lr"], p["outer_momentum"])
            if k not in by or len(p["finals"]) > len(by[k]["finals"]):
                by[k] = p
        if not by:
            return None
        b = min(by.values(), key=lambda p: statistics.fmean(p["finals"]))
        return (b["outer_lr"], b["outer_momentum"])

    for mode in ("eager", "async-dn"):
        out[mode] = best_of(cells(mode)) or out[mode]
    points = cells("diloco")

    out["diloco"] = best_of(points) or out["diloco"]
    out["nesterov"] = best_of([p for p in points if p["outer_momentum"] > 0]) or out["nesterov"]
    out["sgd"] = best_of([p for p in points if p["outer_momentum"] == 0]) or out["sgd"]
    return out


def plan(rounds: int, best: dict[str, tuple[float, float]], codecs: bool) -> list[dict]:
    """The table's runs: label, mode, workers, rounds, outer settings, speeds, codec.

    The late-arrival pair runs at the best setting with momentum (the rules differ in how late work meets
    the momentum). Every run gets every seed except the two costliest, 8 replicas and the 4x-longer single
    worker, which get the first seed only (what fits 45 minutes on 2 shared cores).
    """
    even = [1.0] * S.WORKERS
    d, e, a, sgd, nes = best["diloco"], best["eager"], best["async-dn"], best["sgd"], best["nesterov"]
    runs = [
        dict(label="single", mode="fedavg", workers=1, rounds=rounds, outer=(1.0, 0.0)),
        dict(label="single-4x", first_seed_only=True, mode="fedavg", workers=1, rounds=4 * rounds, outer=(1.0, 0.0)),
        dict(label="ddp", mode="ddp", workers=S.WORKERS, rounds=rounds, outer=d),
        dict(label="diloco-k1", mode="diloco", workers=1, rounds=rounds, outer=d),
        dict(label="diloco-k2", mode="diloco", workers=2, rounds=rounds, outer=d),
        dict(label="diloco", mode="diloco", workers=S.WORKERS, rounds=rounds, outer=d, speeds=S.SPEEDS),
        dict(label="diloco-k8", first_seed_only=True, mode="diloco", workers=8, rounds=rounds, outer=d),
        dict(label="diloco-paper", mode="diloco", workers=S.WORKERS, rounds=rounds, outer=PAPER),
        dict(label="nesterov", mode="diloco", workers=S.WORKERS, rounds=rounds, outer=nes),
        dict(label="outer-sgd", mode="diloco", workers=S.WORKERS, rounds=rounds, outer=sgd),
        dict(label="fedavg", mode="fedavg", workers=S.WORKERS, rounds=rounds, outer=(1.0, 0.0)),
        dict(label="eager", mode="eager", workers=S.WORKERS, rounds=rounds, outer=e, speeds=even),
        dict(label="async-dn", mode="async-dn", workers=S.WORKERS, rounds=rounds, outer=a, speeds=S.SPEEDS),
        dict(label="late-p2p", mode="late-p2p", workers=S.WORKERS, rounds=rounds, outer=nes, speeds=S.SPEEDS),
        dict(label="late-server", mode="late-server", workers=S.WORKERS, rounds=rounds, outer=nes,
             speeds=S.SPEEDS),
    ]
    # Settings that coincide with another run's are not run twice (the table shows both labels).
    same = {"outer-sgd": tuple(sgd) in ((1.0, 0.0), tuple(d)), "diloco-paper": tuple(d) == PAPER,
            "nesterov": tuple(nes) == tuple(d), "fedavg": tuple(d) == (1.0, 0.0)}
    runs = [r for r in runs if not same.get(r["label"], False)]
    if codecs:
        runs += [dict(label=f"diloco-{c}", mode="diloco", workers=S.WORKERS, rounds=rounds, outer=d,
                      compression=c, first_seed_only=True) for c in ("fp16", "int8", "4bit")]
    return runs


def cost(run: dict) -> int:
    return run["workers"] * run["rounds"]


def one(job: tuple[dict, int]) -> dict:
    """Run one (run, seed) in a worker process."""
    from p2p_diloco.simulate import SimConfig, run
    from p2p_diloco.simulate.late import run_late_arrivals

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    spec, seed = job
    lr, mom = spec["outer"]
    cfg = S.config(S.H, spec["rounds"], seed, outer_lr=lr, outer_momentum=mom,
                   compression=spec.get("compression", "none"))
    speeds = list(spec.get("speeds") or [1.0] * spec["workers"])
    t0 = time.time()
    if spec["mode"].startswith("late-"):
        res = run_late_arrivals(cfg, SimConfig("diloco", spec["workers"], spec["rounds"], speeds),
                                spec["mode"].removeprefix("late-"))
    else:
        batched = spec["mode"] in ("diloco", "fedavg", "eager") and spec["workers"] > 1
        res = run(cfg, SimConfig(spec["mode"], spec["workers"], spec["rounds"], speeds, batched=batched))
    out = res.as_dict()
    out.update(label=spec["label"], outer_lr=lr, outer_momentum=mom, wall_s=time.time() - t0)
    return out


def summarize(spec: dict, per_seed: list[dict]) -> dict:
    finals = [r["final_eval_loss"] for r in per_seed]
    first = per_seed[0]
    return dict(
        label=spec["label"], mode=spec["mode"], workers=spec["workers"], rounds=spec["rounds"],
        outer_lr=spec["outer"][0], outer_momentum=spec["outer"][1], speeds=first["speeds"],
        compression=first["compression"], local_steps=first["local_steps"],
        final_eval_loss=statistics.fmean(finals), std=statistics.stdev(finals) if len(finals) > 1 else 0.0,
        per_seed_final=finals, seeds=[r["seed"] for r in per_seed],
        initial_eval_loss=first["initial_eval_loss"],
        total_inner_steps=first["total_inner_steps"], total_bytes_sent_per_worker=first["total_bytes_sent_per_worker"],
        virtual_time_s=first["virtual_time_s"],
        # Mean curve over seeds (records line up: same rounds per seed).
        rounds_mean=[dict(virtual_time_s=recs[0]["virtual_time_s"], inner_steps=recs[0]["inner_steps"],
                          eval_loss=statistics.fmean(r["eval_loss"] for r in recs))
                     for recs in zip(*[r["rounds"] for r in per_seed], strict=True)],
        wall_s=sum(r["wall_s"] for r in per_seed),
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


def _pm(r: dict) -> str:
    if len(r["per_seed_final"]) == 1:
        return f"{r['final_eval_loss']:.4f} (seed {r['seeds'][0]} only)"
    return f"{r['final_eval_loss']:.4f} ± {r['std']:.4f}"


def figures(by: dict[str, dict]) -> list[tuple[str, str, str, bool | None]]:
    """(figure, target, measured, met) rows; every loss is the mean over seeds."""
    rows: list[tuple[str, str, str, bool | None]] = []
    d, single, ddp = by.get("diloco"), by.get("single"), by.get("ddp")
    if d and single:
        rows.append(("DiLoCo k=4 vs one worker, equal per-worker steps", "DiLoCo lower",
                     f"{_pm(d)} vs {_pm(single)}", d["final_eval_loss"] < single["final_eval_loss"]))
    if d and ddp:
        ratio = d["final_eval_loss"] / ddp["final_eval_loss"]
        comm = ddp["total_bytes_sent_per_worker"] / max(1, d["total_bytes_sent_per_worker"])
        rows.append(("DiLoCo k=4 / data parallel, equal compute", "<= 1.03", f"{ratio:.3f}", ratio <= 1.03))
        rows.append(("data-parallel bytes / DiLoCo bytes", f">= H = {d['local_steps']}", f"{comm:.1f}",
                     comm >= d["local_steps"]))
    fed = by.get("fedavg") or (d if d and (d["outer_lr"], d["outer_momentum"]) == (1.0, 0.0) else None)
    sgd = by.get("outer-sgd") or (d if d and d["outer_momentum"] == 0 else None) or fed
    nes = by.get("nesterov") or (d if d and d["outer_momentum"] > 0 else None)
    if nes and sgd:
        name = (f"Nesterov at its best (lr {nes['outer_lr']:g}, mom {nes['outer_momentum']:g}) vs outer SGD at "
                f"its best lr ({sgd['outer_lr']:g})")
        if fed:
            name += f"; FedAvg (lr 1): {_pm(fed)}"
        rows.append((name, "Nesterov lower", f"{_pm(nes)} vs {_pm(sgd)}",
                     nes["final_eval_loss"] < sgd["final_eval_loss"]))
    e = by.get("eager")
    if d and e:
        rel = e["final_eval_loss"] / d["final_eval_loss"] - 1
        rows.append(("eager vs DiLoCo final loss", "within 2%", f"{rel * 100:+.2f}%", abs(rel) <= 0.02))
    a = by.get("async-dn")
    if d and a:
        t_dn = time_to_reach(a["rounds_mean"], d["final_eval_loss"])
        measured = "never reached" if t_dn is None else f"{t_dn / d['virtual_time_s']:.2f}"
        rows.append(("DN+DyLU time to sync DiLoCo's final loss / sync time, speeds [1,1,1,0.4]", "<= 0.8",
                     f"{measured} (DN final {a['final_eval_loss']:.4f})",
                     None if t_dn is None else t_dn / d["virtual_time_s"] <= 0.8))
    lp, ls = by.get("late-p2p"), by.get("late-server")
    if lp and ls:
        rows.append(("late arrivals (slow worker 2.5 rounds late): p2p rule vs server DN", "p2p not worse",
                     f"{_pm(lp)} vs {_pm(ls)}", lp["final_eval_loss"] <= ls["final_eval_loss"] + ls["std"]))
    paper = by.get("diloco-paper") or (d if d and (d["outer_lr"], d["outer_momentum"]) == PAPER else None)
    if d and paper:
        rows.append(("paper outer settings (0.7, 0.9) vs tuned, DiLoCo k=4", "(measure)",
                     f"{_pm(paper)} vs {_pm(d)}", None))
    q = by.get("diloco-4bit")
    if d and q:
        rel = q["final_eval_loss"] / d["per_seed_final"][0] - 1
        rows.append(("4bit vs none final loss (seed 0)", "within 1%", f"{rel * 100:+.2f}%", abs(rel) <= 0.01))
    return rows


def write_report(payload: dict) -> None:
    by = {r["label"]: r for r in payload["runs"]}
    t = payload["tuned"]
    lines = [
        f"Tiny Llama ({payload['params']:,} parameters), batch {S.BATCH} x {S.SEQ_LEN} tokens per worker step, "
        f"embedded corpus, H = {S.H}, {payload['rounds']} rounds = {payload['rounds'] * S.H} inner steps per worker, "
        f"inner AdamW lr {S.INNER_LR:g} (warmup {S.WARMUP}, cosine over the run), seeds {payload['seeds']} "
        f"(mean ± std). Outer settings from the sweep at this H and k = 4 (lr, momentum): diloco {t['diloco']}, "
        f"best with momentum {t['nesterov']}, best outer SGD {t['sgd']}, eager {t['eager']}, async-dn "
        f"{t['async-dn']}. Measured on {payload['hardware']} "
        f"in {payload['wall_s'] / 60:.0f} min ({payload['jobs']} processes).",
        "",
        "| run | k | outer lr, mom | final eval loss | inner steps (all workers) | virtual time (s) "
        "| MB sent per worker |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in payload["runs"]:
        outer = "-" if r["mode"] == "ddp" else f"{r['outer_lr']:g}, {r['outer_momentum']:g}"
        lines.append(f"| {r['label']} | {r['workers']} | {outer} | {_pm(r)} | "
                     f"{r['total_inner_steps']} | {r['virtual_time_s']:.0f} | "
                     f"{r['total_bytes_sent_per_worker'] / 1e6:.2f} |")
    lines += ["", "| figure | target | measured | met |", "| --- | --- | --- | --- |"]
    for name, target, measured, met in figures(by):
        lines.append(f"| {name} | {target} | {measured} | {'yes' if met else 'no' if met is False else '-'} |")
    lines += ["", "![replicas at equal per-worker steps](benchmarks/results/convergence.png)",
              "![modes against virtual time](benchmarks/results/convergence_time.png)"]
    lines += sweep_lines() + cause_lines()
    replace_section(ROOT / "BENCHMARKS.md", "convergence", "\n".join(lines))


def sweep_lines() -> list[str]:
    """Where the sweeps are: their own section, written by ``convergence_sweep.py``."""
    return ["", "The outer settings sweeps behind the tuned settings (3 seeds per key cell, H and k slices) are in "
            "the `convergence-sweep` section below, written by `benchmarks/convergence_sweep.py`."]


def cause_lines() -> list[str]:
    """The cause measurement (``convergence_cause.jsonl``): final loss and the outer step's amplification."""
    path = RESULTS / "convergence_cause.jsonl"
    if not path.exists():
        return []
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = ["", "### Why the old table had DiLoCo behind one worker", "",
           "`benchmarks/convergence_cause.py` (tiny, batch 8 x 64, H = 20, 20 rounds = 400 inner steps per worker, "
           "seed 0): amplification = how far the outer step moved the parameters over the norm of the averaged "
           "pseudo-gradient (1 for FedAvg); agreement = cosine between consecutive rounds' averaged "
           "pseudo-gradients.", "",
           "| run | k | outer lr, mom | final eval loss | amplification, rounds 1 / 10 / 20 "
           "| agreement, rounds 2 / 10 / 20 |", "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        recs = r["recs"]
        amp = " / ".join(f"{recs[i]['amp']:.1f}" for i in (0, len(recs) // 2 - 1, len(recs) - 1))
        agree = " / ".join(f"{recs[i]['cos_prev']:.2f}" for i in (1, len(recs) // 2 - 1, len(recs) - 1))
        out.append(f"| {r['label']} | {r['k']} | {r['olr']:g}, {r['mom']:g} | {r['final']:.4f} | {amp} | {agree} |")
    return out


def plot(payload: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {r["label"]: r for r in payload["runs"]}

    def curve(ax, r: dict, x: str, label: str) -> None:
        xs = [0.0] + [p[x] / (r["workers"] if x == "inner_steps" else 1) for p in r["rounds_mean"]]
        ys = [r["initial_eval_loss"]] + [p["eval_loss"] for p in r["rounds_mean"]]
        ax.plot(xs, ys, marker=".", label=label)

    fig, ax = plt.subplots(figsize=(8, 5))
    for label in ("single", "single-4x", "ddp", "diloco-k1", "diloco-k2", "diloco", "diloco-k8", "diloco-paper"):
        if label in by:
            curve(ax, by[label], "inner_steps", f"{label} (k={by[label]['workers']})")
    ax.set_xlabel("inner steps per worker (ddp: steps of a k-times batch)")
    ax.set_ylabel("eval loss (mean over seeds)")
    ax.set_ylim(top=3.2)
    ax.set_title(f"replicas and baselines, H={S.H}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "convergence.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 5))
    for label in ("diloco", "eager", "async-dn", "late-p2p", "late-server", "ddp"):
        if label in by:
            curve(ax, by[label], "virtual_time_s", label)
    ax.set_xlabel("virtual time (s), speeds [1, 1, 1, 0.4] (eager and ddp: all 1)")
    ax.set_ylabel("eval loss (mean over seeds)")
    ax.set_ylim(top=3.2)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "convergence_time.png", dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=S.ROUNDS)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=1, help="processes (one torch thread each)")
    parser.add_argument("--codecs", action="store_true", help="add fp16/int8/4bit DiLoCo runs (first seed only)")
    parser.add_argument("--only", nargs="*", default=None, help="labels to run (default: all)")
    parser.add_argument("--report", action="store_true",
                        help="rewrite the BENCHMARKS.md section and plots from convergence.json, run nothing")
    parser.add_argument("--out", default=None, metavar="NAME",
                        help="write results/NAME.json only (no plots, no BENCHMARKS.md), e.g. a longer horizon")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.report:
        payload = json.loads((RESULTS / "convergence.json").read_text())
        plot(payload)
        write_report(payload)
        return 0
    started = time.time()
    best = tuned()
    runs = [r for r in plan(args.rounds, best, args.codecs) if not args.only or r["label"] in args.only]
    jobs = [(r, s) for r in runs for s in (args.seeds[:1] if r.get("first_seed_only") else args.seeds)]
    jobs.sort(key=lambda j: -cost(j[0]))
    results: dict[str, list[dict]] = {r["label"]: [] for r in runs}
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(one, j): j for j in jobs}
        for fut in futures:
            res = fut.result()
            results[res["label"]].append(res)
            print(f"{res['label']:>13} seed {res['seed']}: {res['initial_eval_loss']:.4f} -> "
                  f"{res['final_eval_loss']:.4f} ({res['wall_s']:.0f} s)", flush=True)
    summaries = [summarize(r, sorted(results[r["label"]], key=lambda x: x["seed"])) for r in runs]
    from p2p_diloco.models import build_model, count_parameters

    payload = {
        "workers": S.WORKERS, "speeds": S.SPEEDS, "local_steps": S.H, "rounds": args.rounds, "seeds": args.seeds,
        "batch": S.BATCH, "seq_len": S.SEQ_LEN, "inner_lr": S.INNER_LR, "warmup": S.WARMUP,
        "params": count_parameters(build_model(S.MODEL, 259, S.SEQ_LEN)), "tuned": best, "jobs": args.jobs,
        "hardware": f"{platform.processor() or platform.machine()}, {args.jobs} processes x 1 thread, CPU",
        "wall_s": time.time() - started, "runs": summaries,
        "per_seed": {k: v for k, v in results.items()},
    }
    if args.out:
        (RESULTS / f"{args.out}.json").write_text(json.dumps(payload, indent=1))
    else:
        (RESULTS / "convergence.json").write_text(json.dumps(payload, indent=1))
        plot(payload)
        write_report(payload)
    for row in figures({r["label"]: r for r in summaries}):
        print(" | ".join(str(x) for x in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
