"""``python -m p2p_diloco.simulate``: compare training modes on a virtual clock.

Example::

    python -m p2p_diloco.simulate --mode diloco --workers 4 --local-steps 20 --rounds 10 --json out.json
    python -m p2p_diloco.simulate --mode async-dn --speeds 1 1 1 0.4 --compression 4bit
    python -m p2p_diloco.simulate --workers 5 --byzantine 4=-20 --aggregation centered-clip
    python -m p2p_diloco.simulate sweep --local-steps 500 --workers 8   # outer lr/momentum for your H, k
    python -m p2p_diloco.simulate --mode swarm --workers 4 --drop-rate 0.5 --fault-seed 1
    python -m p2p_diloco.simulate --mode streaming --fragments 4 --fragment-delay 2 --fragment-alpha 0.5
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from p2p_diloco.cli.common import make_parser, parse_config, setup_logging, usage_error
from p2p_diloco.config import TrainConfig
from p2p_diloco.config_loader import ConfigError
from p2p_diloco.core.robust import AGGREGATION_CHOICES
from p2p_diloco.simulate.engine import MODES, RoundRecord, SimConfig
from p2p_diloco.simulate.faults import FaultSchedule
from p2p_diloco.simulate.modes import run

logger = logging.getLogger(__name__)
PROG = "p2p_diloco.simulate"
# The simulator's defaults suit the tiny preset on a CPU; every TrainConfig flag can override them.
# Outer lr 1 / momentum 0: the best cell of the H = 20, k = 4, 10-round sweep on the tiny preset
# (BENCHMARKS.md, "Convergence"); the paper's 0.7 / 0.9 (TrainConfig's defaults, for H about 500) ended
# 10% worse there. Other H or k: run `python -m p2p_diloco.simulate sweep`.
DEFAULTS = {
    "outer.lr": 1.0,
    "outer.momentum": 0.0,
    "inner.lr": 1e-3,
    "inner.warmup_steps": 20,
    "inner.batch_size": 8,
    "model.seq_len": 128,
    "outer.local_steps": 20,
    "outer.min_local_steps": 2,
    "data.eval_batches": 8,
}


def parse_byzantine(items: Sequence[str]) -> dict[int, float]:
    """``["4=-20", ...]`` -> ``{4: -20.0}``; ``ValueError`` naming the item that cannot be read."""
    out: dict[int, float] = {}
    for item in items:
        worker, sep, scale = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(worker)] = float(scale)
        except ValueError:
            raise ValueError(f"byzantine: cannot read {item!r}; expected WORKER=SCALE, e.g. 4=-20") from None
    return out


def parse_pairs(name: str, items: Sequence[str]) -> dict[int, int]:
    """``["3=5", ...]`` -> ``{3: 5}``; ``ValueError`` naming the item that cannot be read."""
    out: dict[int, int] = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(key)] = int(value)
        except ValueError:
            raise ValueError(f"{name}: cannot read {item!r}; expected WORKER=ROUND, e.g. 3=5") from None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sweep"]:
        from p2p_diloco.simulate.sweep import main as sweep_main

        return sweep_main(argv[1:], DEFAULTS)
    parser = make_parser(
        PROG, "Simulate k peers on a virtual clock, driving the same core as the swarm.", TrainConfig
    )
    parser.add_argument("--mode", default="diloco", help=f"one of {', '.join(MODES)}")
    parser.add_argument("--workers", type=int, default=4, help="number of simulated peers (k)")
    parser.add_argument("--rounds", type=int, default=10, help="outer rounds (async: equal compute)")
    parser.add_argument(
        "--speeds", type=float, nargs="*", default=None, help="per-worker speed factors, e.g. 1 1 1 0.4"
    )
    parser.add_argument("--step-time", type=float, default=1.0, help="virtual seconds per step at speed 1")
    parser.add_argument(
        "--bandwidth-mbps",
        type=float,
        default=0.0,
        help="per-peer link for all-reduce time; 0 = free communication",
    )
    parser.add_argument(
        "--aggregation",
        default=SimConfig.aggregation,
        help=f"all-reduce rule, one of {', '.join(AGGREGATION_CHOICES)} (as the swarm's --aggregation)",
    )
    parser.add_argument(
        "--byzantine",
        nargs="*",
        default=[],
        metavar="WORKER=SCALE",
        help="hostile workers sending their pseudo-gradient times SCALE every round, e.g. 4=-20",
    )
    parser.add_argument(
        "--norm-outlier-factor",
        type=float,
        default=SimConfig.norm_outlier_factor,
        help="reducers drop and ban a worker whose part is this many times the median; 0 = off",
    )
    parser.add_argument(
        "--part-size-bytes",
        type=int,
        default=SimConfig.part_size_bytes,
        help="all-reduce part size; the screen and the robust rules act per part",
    )
    faults = parser.add_argument_group("faults (--mode swarm; see p2p_diloco/simulate/faults.py)")
    faults.add_argument("--drop-rate", type=float, default=0.0,
                        help="probability that a worker's outer gradient of a round is lost, e.g. 0.5")
    faults.add_argument("--late-rate", type=float, default=0.0,
                        help="probability that a worker misses a round and folds its work in later")
    faults.add_argument("--partial-rate", type=float, default=0.0,
                        help="probability that a round's all-reduce fails mid-way (nobody applies it)")
    faults.add_argument("--join", nargs="*", default=[], metavar="WORKER=ROUND",
                        help="workers that join late, e.g. 3=5")
    faults.add_argument("--faults", nargs="*", default=[], metavar="FAULT",
                        help="scripted faults: late@EPOCH:WORKER, drop@EPOCH:WORKER, partial@EPOCH")
    faults.add_argument("--fault-seed", type=int, default=0, help="seed of the drawn faults")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the result as JSON here")
    cfg, args = parse_config(parser, TrainConfig, argv, base=DEFAULTS)
    setup_logging(args.verbose)
    try:
        sim = SimConfig(
            mode=args.mode,
            workers=args.workers,
            rounds=args.rounds,
            speeds=list(args.speeds or []),
            step_time_s=args.step_time,
            bandwidth_mbps=args.bandwidth_mbps,
            aggregation=args.aggregation,
            byzantine=parse_byzantine(args.byzantine),
            norm_outlier_factor=args.norm_outlier_factor,
            part_size_bytes=args.part_size_bytes,
            credit_undelivered=cfg.outer.credit_undelivered,  # one flag for swarm and simulator
        )
        schedule = FaultSchedule(seed=args.fault_seed, drop_rate=args.drop_rate, late_rate=args.late_rate,
                                 partial_rate=args.partial_rate, joins=parse_pairs("join", args.join),
                                 script=list(args.faults))
        if schedule.active and sim.mode != "swarm":
            raise ValueError(f"--drop-rate, --late-rate, --partial-rate, --join and --faults need --mode swarm, "
                             f"not {sim.mode}")
        schedule.check_workers(sim.workers)
    except ValueError as e:
        usage_error(PROG, str(e))
    print(f"{'round':>5} {'eval_loss':>9} {'virtual_s':>10} {'MB_sent/worker':>14} {'inner_steps':>11}")

    def show(r: RoundRecord) -> None:
        print(
            f"{r.round:>5} {r.eval_loss:>9.4f} {r.virtual_time_s:>10.1f} "
            f"{r.bytes_sent_per_worker / 1e6:>14.3f} {r.inner_steps:>11}",
            flush=True,
        )

    try:
        result = run(cfg, sim, show, faults=schedule)
    except ValueError as e:
        usage_error(PROG, str(e))
    print(
        f"{sim.mode}: eval loss {result.initial_eval_loss:.4f} -> {result.final_eval_loss:.4f}, "
        f"{result.total_inner_steps} inner steps, {result.total_bytes_sent_per_worker / 1e6:.3f} MB "
        f"sent per worker, {result.virtual_time_s:.1f} virtual s"
    )
    if hasattr(result, "peak_bytes_per_s"):
        print(f"{result.fragments} fragment(s), delay {result.fragment_delay}, alpha {result.fragment_alpha}: "
              f"{result.peak_bytes_per_s / 1e6:.3f} MB/s peak and {result.mean_bytes_per_s / 1e6:.3f} MB/s mean "
              f"sent per worker; fragment rounds {result.fragment_outcomes}")
    for peer, outcomes in getattr(result, "outcomes", {}).items():
        print(f"{peer}: {' '.join(o or '-' for o in outcomes)}")
    for ban in result.bans:
        logger.info("%s", ban)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:
        usage_error(PROG, str(e))
