"""Where a simulated inner step spends its time on this CPU, and the most any batching could gain.

k = 4 workers, tiny preset, batch 4 x 64 (the convergence benchmark's setting), one torch thread. For the
unbatched path (k models in turn) and the batched one (one vmapped stacked model) it records a
``torch.profiler`` trace of 5 steps per worker with FLOP counts, and groups the self CPU time into matrix
products (``aten::mm``/``bmm``/``addmm``), the optimizer, attention and the rest. It then measures the
CPU's own single-thread matrix-product throughput on the model's shapes, which gives a floor under any
method that keeps float32 and the same arithmetic: the step's matrix-product FLOPs at that throughput.
Unbatched time over that floor is the largest speed-up batching (or compiling, or fusing) could reach.
It also times two candidate improvements: the batched path with ``torch.compile`` of the vmapped
forward+backward, and with a fused AdamW. Writes ``benchmarks/results/sim_profile.json``::

    .venv/bin/python benchmarks/sim_profile.py [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import replace_section  # noqa: E402
from p2p_diloco.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, TrainConfig  # noqa: E402
from p2p_diloco.simulate.engine import SimConfig, build_workers, train_round  # noqa: E402

K, STEPS, BATCH, SEQ = 4, 5, 4, 64
MM_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")
OUT = ROOT / "benchmarks" / "results" / "sim_profile.json"


def config() -> TrainConfig:
    return TrainConfig(model=ModelConfig("tiny", seq_len=SEQ), data=DataConfig(eval_batches=1),
                       inner=InnerConfig(batch_size=BATCH, lr=1e-3, warmup_steps=5),
                       outer=OuterConfig(local_steps=STEPS, min_local_steps=1))


def timed(fn, reps: int = 3) -> float:
    """Fewest CPU seconds of this process per simulated inner step over ``reps`` calls of ``fn``.

    CPU time, not wall time: the machine is shared, and a single-threaded process's CPU time does not
    count the time other processes held the core (caches and clock still vary with load).
    """
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        fn()
        best = min(best, (time.process_time() - t) / (STEPS * K))
    return best


def breakdown(batched: bool) -> dict:
    ws = build_workers(config(), SimConfig("diloco", K, 1, batched=batched), lr=1.0, momentum=0.0)
    train_round(ws, 2)
    step_s = timed(lambda: train_round(ws, STEPS))
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        train_round(ws, STEPS)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    mm = sum(e.self_cpu_time_total for e in events if e.key in MM_OPS)
    flops = sum(e.flops for e in events if e.key in MM_OPS)
    opt = next((e.cpu_time_total for e in events if e.key.startswith("Optimizer.step")), 0.0)
    attn = sum(e.self_cpu_time_total for e in events if "attention" in e.key or e.key in ("aten::_softmax",))
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    return dict(
        batched=batched, step_s=step_s, profiled_self_cpu_s=total / 1e6,
        mm_fraction=mm / total, optimizer_fraction=opt / total, attention_fraction=attn / total,
        mm_flops_per_sim_step=flops / (STEPS * K), mm_s_per_sim_step=mm / 1e6 / (STEPS * K),
        mm_gflops_achieved=flops / (mm / 1e6) / 1e9 if mm else 0.0,
        top=[dict(op=e.key, self_s=e.self_cpu_time_total / 1e6, calls=e.count) for e in top],
    )


def peak_gflops() -> dict:
    """Single-thread float32 matrix-product throughput on the tiny model's shapes (256 tokens x 128 hidden)."""
    shapes = {"256x128 @ 128x352": ((256, 128), (128, 352)), "256x352 @ 352x128": ((256, 352), (352, 128)),
              "256x128 @ 128x128": ((256, 128), (128, 128)), "256x128 @ 128x259": ((256, 128), (128, 259)),
              "4 x (256x128 @ 128x352), bmm": ((4, 256, 128), (4, 128, 352)),
              "1024x1024 @ 1024x1024": ((1024, 1024), (1024, 1024))}
    out = {}
    for name, (a_shape, b_shape) in shapes.items():
        a, b = torch.randn(*a_shape), torch.randn(*b_shape)
        f = torch.bmm if a.ndim == 3 else torch.mm
        reps = 20 if a_shape[-1] == 1024 else 400
        for _ in range(5):
            f(a, b)
        best = float("inf")
        for _ in range(5):
            t = time.process_time()
            for _ in range(reps):
                f(a, b)
            best = min(best, (time.process_time() - t) / reps)
        out[name] = 2 * a.numel() * b_shape[-1] / best / 1e9
    return out


def candidates(compile_: bool) -> dict:
    """The unbatched path and the batched one with its AdamW per tensor, fused (the default), and fused
    with the vmapped forward+backward compiled; timed in alternation, fewest CPU seconds of 3 each."""
    from p2p_diloco.simulate.batched import BatchedInnerTrainer
    from p2p_diloco.trainer import make_adamw, make_scheduler

    cfg = config()
    variants = {}
    for name in ("unbatched", "batched, AdamW per tensor", "batched, fused AdamW", "batched, fused AdamW, compiled"):
        if name.endswith("compiled") and not compile_:
            continue
        ws = build_workers(cfg, SimConfig("diloco", K, 1, batched=name != "unbatched"), lr=1.0, momentum=0.0)
        if name.endswith("compiled"):
            bt = BatchedInnerTrainer([w.local.model for w in ws], [w.local.stream for w in ws], cfg.inner,
                                     compile=True)
            for w in ws:
                w.batched = bt
        elif name.endswith("per tensor"):
            bt = ws[0].batched
            assert bt is not None
            ndims = [p.ndim - 1 for p in bt.stacked.values()]
            bt.optimizer = make_adamw(list(bt.stacked.items()), cfg.inner, ndims=ndims, fused=False)
            bt.scheduler = make_scheduler(bt.optimizer, cfg.inner)
        t = time.perf_counter()
        train_round(ws, 2)
        variants[name] = dict(workers=ws, warmup_s=time.perf_counter() - t, times=[])
    for _ in range(3):
        for v in variants.values():
            t = time.process_time()
            train_round(v["workers"], STEPS)
            v["times"].append((time.process_time() - t) / (STEPS * K))
    # Same starting weights, data and number of steps in every variant: their eval losses must agree.
    for v in variants.values():
        w = v["workers"][0]
        v["eval_loss"] = w.local.trainer.evaluate(w.local.eval_batches)
    ref = variants["unbatched"]["eval_loss"]
    ref_params = variants["unbatched"]["workers"][0].params
    for v in variants.values():
        v["max_param_diff"] = max(float((p.detach() - q.detach()).abs().max())
                                  for p, q in zip(v["workers"][0].params, ref_params, strict=True))
    return {name: dict(step_s=min(v["times"]), all_s=v["times"], first_two_steps_s=v["warmup_s"],
                       eval_loss_after=v["eval_loss"], rel_diff_to_unbatched=abs(v["eval_loss"] / ref - 1),
                       max_abs_param_diff_to_unbatched=v["max_param_diff"])
            for name, v in variants.items()}


def report(payload: dict) -> None:
    """The ``simulator-profile`` section of BENCHMARKS.md and ``sim_profile.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cand = payload["rows"], payload["candidates"]
    un = cand["unbatched"]["step_s"]
    lines = [
        f"`benchmarks/sim_profile.py`: k = {K}, tiny preset, batch {BATCH} x {SEQ}, one torch thread on "
        f"{payload['hardware']}, torch {payload['torch']}; 1-minute load average {payload['load_1min_at_end']:.1f} "
        "at the end (the machine was shared), so every time is CPU seconds of the benchmark's process, fewest of "
        "3 alternating repetitions of 5 steps per worker.", "",
        "| path | CPU ms per simulated inner step | speed-up | max abs parameter difference to unbatched after "
        "17 steps |", "| --- | --- | --- | --- |"]
    for name, c in cand.items():
        lines.append(f"| {name} | {c['step_s'] * 1e3:.1f} | {un / c['step_s']:.2f} | "
                     f"{c['max_abs_param_diff_to_unbatched']:.1e} |")
    lines.append(f"| floor: the step's matrix-product FLOPs at the core's peak | {payload['floor_s'] * 1e3:.1f} | "
                 f"{un / payload['floor_s']:.2f} | - |")
    lines += ["", "| profile (torch.profiler, self CPU time) | unbatched | batched |", "| --- | --- | --- |"]
    u, b = rows
    for label, key in (("matrix products (mm, bmm)", "mm_fraction"), ("optimizer step", "optimizer_fraction"),
                       ("attention kernels, softmax", "attention_fraction")):
        lines.append(f"| {label} | {u[key] * 100:.0f}% | {b[key] * 100:.0f}% |")
    lines.append(f"| matrix-product GFLOP per simulated step | {u['mm_flops_per_sim_step'] / 1e9:.2f} | "
                 f"{b['mm_flops_per_sim_step'] / 1e9:.2f} |")
    peaks = ", ".join(f"{k} {v:.0f}" for k, v in payload["peak_gflops"].items())
    lines += ["", f"Single-thread float32 matrix-product throughput on this core (GFLOP/s): {peaks}.", "",
              "![simulator profile](benchmarks/results/sim_profile.png)"]
    replace_section(ROOT / "BENCHMARKS.md", "simulator-profile", "\n".join(lines))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(cand) + ["FLOP floor"]
    vals = [c["step_s"] * 1e3 for c in cand.values()] + [payload["floor_s"] * 1e3]
    ax.barh(names, vals, color=["C0"] * len(cand) + ["C3"])
    ax.axvline(un * 1e3 / 3, color="k", ls="--", label="3x target")
    ax.set_xlabel("CPU ms per simulated inner step (k = 4, tiny, 4 x 64)")
    ax.invert_yaxis()
    ax.legend()
    fig.tight_layout()
    fig.savefig(ROOT / "benchmarks" / "results" / "sim_profile.png", dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile candidate")
    parser.add_argument("--report", action="store_true", help="rewrite the section and plot from the JSON")
    args = parser.parse_args()
    if args.report:
        report(json.loads(OUT.read_text()))
        return 0
    torch.set_num_threads(1)
    rows = [breakdown(False), breakdown(True)]
    peaks = peak_gflops()
    best_peak = max(peaks.values())
    un = rows[0]
    floor_s = un["mm_flops_per_sim_step"] / (best_peak * 1e9)
    payload = dict(workers=K, batch=BATCH, seq_len=SEQ, hardware=f"{platform.processor() or platform.machine()}, "
                   f"{os.cpu_count()} cores, 1 torch thread", torch=torch.__version__, rows=rows,
                   peak_gflops=peaks, floor_s=floor_s, max_speedup=un["step_s"] / floor_s,
                   candidates=candidates(not args.no_compile), load_1min_at_end=os.getloadavg()[0])
    OUT.write_text(json.dumps(payload, indent=1))
    report(payload)
    for r in rows:
        print(f"{'batched' if r['batched'] else 'unbatched'}: {r['step_s'] * 1e3:.1f} ms/sim step; matrix products "
              f"{r['mm_fraction'] * 100:.0f}% ({r['mm_gflops_achieved']:.0f} GFLOP/s), optimizer "
              f"{r['optimizer_fraction'] * 100:.0f}%, attention {r['attention_fraction'] * 100:.0f}%")
    print(f"peak {best_peak:.0f} GFLOP/s; floor {floor_s * 1e3:.1f} ms/sim step; max speed-up "
          f"{payload['max_speedup']:.2f}x; candidates {payload['candidates']}; load {payload['load_1min_at_end']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
