"""Seconds per simulated inner step, k = 4 workers, batched (one vmapped stacked model) against unbatched.

Writes ``benchmarks/results/sim_speed.json`` and the ``simulator-speed`` section of ``BENCHMARKS.md``.
Each size alternates the two paths three times (one round of 5 steps per worker each) and keeps each
path's fastest repetition, in CPU seconds of this process (the machine is shared: a single-threaded
process's CPU time leaves out the time other processes held the core) and in wall seconds::

    .venv/bin/python benchmarks/sim_speed.py
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import replace_section  # noqa: E402
from p2p_diloco.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, TrainConfig  # noqa: E402
from p2p_diloco.simulate.engine import SimConfig, build_workers, train_round  # noqa: E402

SIZES = [("tiny", 2, 32), ("tiny", 4, 64), ("tiny", 8, 64), ("tiny", 8, 128), ("mini", 4, 64)]
K, STEPS, REPS = 4, 5, 3


def measure(model: str, batch: int, seq: int) -> dict:
    cfg = TrainConfig(model=ModelConfig(model, seq_len=seq), data=DataConfig(eval_batches=1),
                      inner=InnerConfig(batch_size=batch, lr=1e-3, warmup_steps=5),
                      outer=OuterConfig(local_steps=STEPS, min_local_steps=1))
    ws = {b: build_workers(cfg, SimConfig("diloco", K, 1, batched=b), lr=0.7, momentum=0.9) for b in (False, True)}
    for b in ws:
        train_round(ws[b], 2)
    cpu: dict[bool, list[float]] = {False: [], True: []}
    wall: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(REPS):
        for b in (False, True):
            t, c = time.perf_counter(), time.process_time()
            train_round(ws[b], STEPS)
            cpu[b].append((time.process_time() - c) / (STEPS * K))
            wall[b].append((time.perf_counter() - t) / (STEPS * K))
    u, v = min(cpu[False]), min(cpu[True])
    return dict(model=model, batch=batch, seq_len=seq, unbatched_s=u, batched_s=v, speedup=u / v,
                unbatched_wall_s=min(wall[False]), batched_wall_s=min(wall[True]),
                wall_speedup=min(wall[False]) / min(wall[True]), all_unbatched_cpu=cpu[False],
                all_batched_cpu=cpu[True], load_1min=os.getloadavg()[0])


def main() -> int:
    torch.set_num_threads(1)
    rows = []
    for model, batch, seq in SIZES:
        rows.append(measure(model, batch, seq))
        r = rows[-1]
        print(f"{model} {batch}x{seq}: unbatched {r['unbatched_s'] * 1e3:.1f} ms, batched {r['batched_s'] * 1e3:.1f} ms "
              f"CPU per simulated inner step, speed-up {r['speedup']:.2f} (wall {r['wall_speedup']:.2f}, load "
              f"{r['load_1min']:.1f})", flush=True)
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    payload = {"workers": K, "rows": rows, "hardware": f"{platform.machine()}, 1 torch thread, CPU",
               "load_1min_at_end": load}
    out = ROOT / "benchmarks" / "results" / "sim_speed.json"
    out.write_text(json.dumps(payload, indent=1))
    lines = [f"`benchmarks/sim_speed.py`: seconds per simulated inner step with k = {K} workers, one torch thread "
             f"on {payload['hardware']}. Fastest of 3 alternating repetitions of 5 steps per worker, in CPU "
             "seconds of the benchmark's process (the machine was shared; CPU time leaves out the time other "
             "processes held the core) and, for comparison, in wall seconds. 1-minute load average after each "
             "row as listed.", "",
             "| model | batch x seq | unbatched (CPU ms/step) | batched (CPU ms/step) | speed-up (CPU) "
             "| speed-up (wall) | load |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} x {r['seq_len']} | {r['unbatched_s'] * 1e3:.1f} | "
                     f"{r['batched_s'] * 1e3:.1f} | {r['speedup']:.2f} | {r['wall_speedup']:.2f} | "
                     f"{r['load_1min']:.1f} |")
    replace_section(ROOT / "BENCHMARKS.md", "simulator-speed", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
