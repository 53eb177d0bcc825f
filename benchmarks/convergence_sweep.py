"""Outer lr x outer momentum x H sweeps behind the convergence tables; writes
``benchmarks/results/convergence_sweep.json`` (after every grid) and ``convergence_sweep.png``.

    .venv/bin/python benchmarks/convergence_sweep.py [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import convergence_setup as S  # noqa: E402
from p2p_diloco.simulate.engine import SimConfig  # noqa: E402
from p2p_diloco.simulate.sweep import format_table, plot, run_sweep  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
OUT = RESULTS / "convergence_sweep.json"


def grids() -> list[tuple[str, str, int, list[float], list[float], list[float]]]:
    """(name, mode, H, lrs, momenta, speeds) in the order they run; the H = 20 grids first.

    The grids are as large as fit the CPU time this machine had (see BENCHMARKS.md): diloco gets the full
    lr x momentum grid at H = 20, eager and async-dn a 2 x 3 grid around it, and the H slices outer SGD
    (momentum 0, the best family at H = 20) at three lrs.
    """
    total = S.SWEEP_ROUNDS * S.H
    even = [1.0] * S.WORKERS
    out = [
        ("diloco-H20", "diloco", S.H, S.SWEEP_LRS, S.SWEEP_MOMENTA, even),
        ("eager-H20", "eager", S.H, [0.7, 1.0], S.SWEEP_MOMENTA, even),
        ("async-dn-H20", "async-dn", S.H, [0.7, 1.0], S.SWEEP_MOMENTA, S.SPEEDS),
    ]
    for h in S.SWEEP_H:
        out.append((f"diloco-H{h}", "diloco", h, [0.5, 1.0, 1.5], [0.0], even))
    out.append(("diloco-H20-lr1.5", "diloco", S.H, [1.5], [0.0], even))
    # Eager's H = 20 optimum sat at the grid's smallest lr (0.7, momentum 0): extend the grid down.
    out.append(("eager-H20-low", "eager", S.H, [0.3, 0.5], [0.0], even))
    assert all(total % g[2] == 0 for g in out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=None, help="grid names to run (default: all)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name, mode, h, lrs, moms, speeds in grids():
        if args.only and name not in args.only:
            continue
        rounds = S.SWEEP_ROUNDS * S.H // h
        cfg = S.config(h, rounds, 0)
        base = SimConfig(mode, S.WORKERS, rounds, list(speeds), batched=mode != "async-dn")
        t0 = time.time()
        res = run_sweep(cfg, base, [mode], lrs, moms, S.SWEEP_SEEDS, args.jobs,
                        lambda p, s, f, h=h: print(f"{p.mode} H={h} lr {p.outer_lr} mom {p.outer_momentum} seed {s}: "
                                              f"{f:.4f}", flush=True))
        print(format_table(res), flush=True)
        # Re-read before writing, so grids written meanwhile by another run of this script are kept.
        payload = json.loads(OUT.read_text()) if OUT.exists() else {"grids": {}}
        payload["grids"][name] = res.as_dict() | {"wall_s": time.time() - t0, "speeds": speeds,
                                                   "batch": S.BATCH, "seq_len": S.SEQ_LEN}
        OUT.write_text(json.dumps(payload, indent=1))
        plot(res, RESULTS / f"convergence_sweep_{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
