"""``python -m p2p_diloco.simulate sweep``: find the outer lr and momentum for your H and k before a real run.

Run it with the H (``--local-steps``) and k (``--workers``) of the run you plan; it trains a small proxy
model (default: the tiny preset on the embedded corpus) with every outer lr x outer momentum of the grid,
over several seeds, and prints (and plots) the final eval loss of each, the best setting per mode and how
much worse its neighbours are::

    python -m p2p_diloco.simulate sweep --local-steps 500 --workers 8 --rounds 8 \\
        --outer-lrs 0.3 0.5 0.7 1.0 --outer-momenta 0.5 0.8 0.9 --seeds 0 1 2 --plot sweep.png

Why a proxy can guide the real run: the DiLoCo scaling-law study (Charles et al. 2025, arXiv 2503.09799,
35M-2.4B parameters) found DiLoCo's hyperparameters transfer across model sizes, while the best outer
lr moves with the number of replicas M (our k) and with H. So sweep at the k and H you will use; the
model size may differ. Limits: the transfer was measured on one architecture family and one data set
with each run's inner lr tuned, and at hundreds of outer steps; a proxy run of a few outer steps on the
embedded corpus says which region of the grid is good, not the third digit. Keep the proxy's number of
outer rounds close to a few dozen where you can (outer momentum needs rounds to act), and check the
best setting's neighbours: a flat optimum is the one to trust.

What each mode sweeps: ``diloco`` and ``eager`` the outer Nesterov lr and momentum (momentum 0 is outer
SGD; lr 1 with momentum 0 is FedAvg); ``async-dn`` the Delayed Nesterov step size and momentum decay.
"""

from __future__ import annotations

import copy
import json
import logging
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from p2p_diloco.cli.common import make_parser, parse_config, setup_logging, usage_error
from p2p_diloco.config import TrainConfig
from p2p_diloco.simulate.engine import SimConfig

logger = logging.getLogger(__name__)
PROG = "p2p_diloco.simulate sweep"
TRANSFER = (
    "Why a small proxy can guide a large run: the DiLoCo scaling-law study (Charles et al. 2025, arXiv "
    "2503.09799; 35M-2.4B parameters) found DiLoCo's hyperparameters transfer across model sizes, while the "
    "best outer lr depends on the number of replicas (k) and on H, so sweep at the k and H you will use. "
    "Limits: one architecture family and data set, each size with its inner lr tuned, hundreds of outer "
    "steps; a proxy of a few rounds on the embedded corpus locates the good region of the grid, not the "
    "third digit. Prefer a flat optimum (small 'neighbours' numbers) and as many rounds as you can afford."
)
SWEEP_MODES = ("diloco", "eager", "async-dn")
DEFAULT_LRS = (0.2, 0.4, 0.7, 1.0)
DEFAULT_MOMENTA = (0.0, 0.5, 0.8, 0.9)


@dataclass
class SweepPoint:
    """One grid cell: a mode at one outer lr and momentum, over the seeds."""

    mode: str
    outer_lr: float
    outer_momentum: float
    finals: list[float] = field(default_factory=list)
    """Final eval loss of each seed, in the order of the sweep's seeds."""
    curves: list[list[float]] = field(default_factory=list)
    """Eval loss after each round, per seed."""

    @property
    def mean(self) -> float:
        return statistics.fmean(self.finals) if self.finals else float("nan")

    @property
    def std(self) -> float:
        return statistics.stdev(self.finals) if len(self.finals) > 1 else 0.0


@dataclass
class SweepResult:
    workers: int
    local_steps: int
    rounds: int
    seeds: list[int]
    model: str
    points: list[SweepPoint]

    def best(self, mode: str) -> SweepPoint:
        return min((p for p in self.points if p.mode == mode), key=lambda p: p.mean)

    def modes(self) -> list[str]:
        return list(dict.fromkeys(p.mode for p in self.points))

    def sensitivity(self, mode: str) -> dict[str, float]:
        """How much worse than the best (relative mean loss) the nearest grid neighbours are.

        ``lr_down``/``lr_up``: the next smaller/larger lr at the best momentum; ``mom_down``/``mom_up``
        likewise for momentum at the best lr; missing neighbours are left out.
        """
        best = self.best(mode)
        cells = {(p.outer_lr, p.outer_momentum): p for p in self.points if p.mode == mode}
        lrs = sorted({lr for lr, _ in cells})
        moms = sorted({m for _, m in cells})
        out: dict[str, float] = {}
        i, j = lrs.index(best.outer_lr), moms.index(best.outer_momentum)
        for name, key in (("lr_down", (i - 1, j)), ("lr_up", (i + 1, j)), ("mom_down", (i, j - 1)),
                          ("mom_up", (i, j + 1))):
            a, b = key
            if 0 <= a < len(lrs) and 0 <= b < len(moms) and (lrs[a], moms[b]) in cells:
                out[name] = cells[(lrs[a], moms[b])].mean / best.mean - 1
        return out

    def as_dict(self) -> dict:
        d = asdict(self)
        d["best"] = {m: asdict(self.best(m)) | {"mean": self.best(m).mean, "std": self.best(m).std,
                                                 "sensitivity": self.sensitivity(m)} for m in self.modes()}
        return d


def _one(job: tuple[TrainConfig, SimConfig]) -> tuple[float, list[float]]:
    """Run one simulation in a worker process; returns (final eval loss, curve)."""
    from p2p_diloco.simulate.modes import run

    torch.set_num_threads(1)
    cfg, sim = job
    res = run(cfg, sim)
    return res.final_eval_loss, [r.eval_loss for r in res.rounds]


def grid_jobs(
    cfg: TrainConfig, base: SimConfig, modes: Sequence[str], lrs: Sequence[float], momenta: Sequence[float],
    seeds: Sequence[int],
) -> list[tuple[SweepPoint, int, TrainConfig, SimConfig]]:
    """Every (point, seed index, config, sim) of the grid; the inner schedule spans rounds x H."""
    jobs = []
    for mode in modes:
        for lr in lrs:
            for mom in momenta:
                point = SweepPoint(mode, lr, mom)
                for si, seed in enumerate(seeds):
                    c = copy.deepcopy(cfg)
                    c.outer.lr, c.outer.momentum, c.run.seed = lr, mom, seed
                    if c.inner.total_steps == 0:
                        c.inner.total_steps = base.rounds * c.outer.local_steps
                    sim = copy.deepcopy(base)
                    sim.mode = mode
                    jobs.append((point, si, c, sim))
    return jobs


def run_sweep(
    cfg: TrainConfig,
    base: SimConfig,
    modes: Sequence[str],
    lrs: Sequence[float],
    momenta: Sequence[float],
    seeds: Sequence[int],
    jobs: int = 1,
    progress: Callable[[SweepPoint, int, float], None] | None = None,
) -> SweepResult:
    """Run the grid (``jobs`` processes at a time) and collect the final losses per cell."""
    work = grid_jobs(cfg, base, modes, lrs, momenta, seeds)
    points: list[SweepPoint] = []
    for point, _, _, _ in work:
        if not points or points[-1] is not point:
            points.append(point)
            point.finals = [float("nan")] * len(seeds)
            point.curves = [[] for _ in seeds]

    def take(point: SweepPoint, si: int, out: tuple[float, list[float]]) -> None:
        point.finals[si], point.curves[si] = out
        if progress:
            progress(point, seeds[si], out[0])

    if jobs <= 1:
        for point, si, c, sim in work:
            take(point, si, _one((c, sim)))
    else:
        import multiprocessing

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [(point, si, pool.submit(_one, (c, sim))) for point, si, c, sim in work]
            for point, si, fut in futures:
                take(point, si, fut.result())
    return SweepResult(base.workers, cfg.outer.local_steps, base.rounds, list(seeds), cfg.model.model, points)


def format_table(result: SweepResult) -> str:
    """The grid as text: one block per mode, lr down, momentum across; the best cell starred."""
    lines = [f"k={result.workers} H={result.local_steps} rounds={result.rounds} model={result.model} "
             f"seeds={result.seeds}: final eval loss, mean over seeds (std)"]
    for mode in result.modes():
        cells = [p for p in result.points if p.mode == mode]
        moms = sorted({p.outer_momentum for p in cells})
        lrs = sorted({p.outer_lr for p in cells})
        best = result.best(mode)
        lines.append(f"\n{mode}: outer lr \\ momentum " + " ".join(f"{m:>15}" for m in moms))
        for lr in lrs:
            row = []
            for m in moms:
                p = next(p for p in cells if p.outer_lr == lr and p.outer_momentum == m)
                star = "*" if p is best else " "
                row.append(f"{p.mean:8.4f} ({p.std:.3f}){star}")
            lines.append(f"{mode:>8} {lr:>19g} " + " ".join(f"{c:>15}" for c in row))
        sens = ", ".join(f"{k} {v * 100:+.1f}%" for k, v in result.sensitivity(mode).items())
        lines.append(f"best {mode}: outer lr {best.outer_lr:g}, momentum {best.outer_momentum:g}: "
                     f"{best.mean:.4f} +- {best.std:.4f}; neighbours: {sens or 'none'}")
    return "\n".join(lines)


def plot(result: SweepResult, path: Path) -> None:
    """Final loss against outer lr, one line per momentum, one panel per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = result.modes()
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), squeeze=False, sharey=True)
    for ax, mode in zip(axes[0], modes, strict=True):
        cells = [p for p in result.points if p.mode == mode]
        for m in sorted({p.outer_momentum for p in cells}):
            row = sorted((p for p in cells if p.outer_momentum == m), key=lambda p: p.outer_lr)
            ax.errorbar([p.outer_lr for p in row], [p.mean for p in row], yerr=[p.std for p in row],
                        marker="o", capsize=3, label=f"momentum {m:g}")
        best = result.best(mode)
        ax.plot([best.outer_lr], [best.mean], "k*", markersize=14)
        ax.set_xscale("log")
        ax.set_xlabel("outer lr")
        ax.set_title(f"{mode}, k={result.workers}, H={result.local_steps}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(f"final eval loss (mean of {len(result.seeds)} seeds)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None, defaults: dict) -> int:
    parser = make_parser(PROG, __doc__.splitlines()[0], TrainConfig)
    parser.epilog = TRANSFER
    parser.add_argument("--modes", nargs="+", default=["diloco"], help=f"modes to sweep: {', '.join(SWEEP_MODES)}")
    parser.add_argument("--workers", type=int, default=4, help="k, the number of peers of your real run")
    parser.add_argument("--rounds", type=int, default=10,
                        help="outer rounds per proxy run (more rounds: momentum has time to act; cost grows)")
    parser.add_argument("--outer-lrs", type=float, nargs="+", default=list(DEFAULT_LRS), help="outer lr grid")
    parser.add_argument("--outer-momenta", type=float, nargs="+", default=list(DEFAULT_MOMENTA),
                        help="outer momentum grid (async-dn: momentum decay beta)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds per cell")
    parser.add_argument("--speeds", type=float, nargs="*", default=None, help="per-worker speeds (async-dn)")
    parser.add_argument("--batched", action="store_true", help="train a round's workers as one model (GPU)")
    parser.add_argument("--jobs", type=int, default=1, help="simulations run at once, one process each")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the grid as JSON here")
    parser.add_argument("--plot", metavar="PATH", default=None, help="write a PNG of the grid here")
    cfg, args = parse_config(parser, TrainConfig, argv, base=defaults)
    setup_logging(args.verbose)
    bad = [m for m in args.modes if m not in SWEEP_MODES]
    if bad:
        usage_error(PROG, f"--modes: {', '.join(bad)} cannot be swept; choose from {', '.join(SWEEP_MODES)}")
    if any(not 0 < lr <= 10 for lr in args.outer_lrs):
        usage_error(PROG, f"--outer-lrs: each must be in (0, 10], got {args.outer_lrs}")
    if any(not 0 <= m < 1 for m in args.outer_momenta):
        usage_error(PROG, f"--outer-momenta: each must be in [0, 1), got {args.outer_momenta}")
    if not 1 <= args.jobs <= 64:
        usage_error(PROG, f"--jobs: must be in [1, 64], got {args.jobs}")
    try:
        base = SimConfig("diloco", args.workers, args.rounds, list(args.speeds or []), batched=args.batched,
                         credit_undelivered=cfg.outer.credit_undelivered)
    except ValueError as e:
        usage_error(PROG, str(e))
    n = len(args.modes) * len(args.outer_lrs) * len(args.outer_momenta) * len(args.seeds)
    print(f"{n} simulations of {args.workers} x {args.rounds} x {cfg.outer.local_steps} inner steps "
          f"({cfg.model.model}, batch {cfg.inner.batch_size} x {cfg.model.seq_len})", flush=True)

    def show(p: SweepPoint, seed: int, final: float) -> None:
        print(f"{p.mode:>8} outer lr {p.outer_lr:<5g} momentum {p.outer_momentum:<4g} seed {seed}: {final:.4f}",
              flush=True)

    result = run_sweep(cfg, base, args.modes, args.outer_lrs, args.outer_momenta, args.seeds, args.jobs, show)
    print(format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=1))
    if args.plot:
        plot(result, Path(args.plot))
    return 0
