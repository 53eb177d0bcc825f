"""GPU run-book: every GPU path of p2p_diloco measured in one command, written as one JSON file.

    bash benchmarks/gpu_runbook.sh                 # a CUDA machine: the full run (about 30-60 min on one GPU)
    bash benchmarks/gpu_runbook.sh --dry-run       # any machine: tiny shapes on the CPU, a minute or two
    .venv/bin/python -m benchmarks.gpu_runbook --help

Sections (each one's figures, its settings and ``ok`` / ``error`` in the JSON; one failing section does not
stop the others):

- ``memory``: GPU and host memory at the ``1b`` shape (Llama 2048 x 5632 x 22 layers x 32 heads, about 1.1B
  parameters with the byte vocabulary; the largest of ``1b``, ``476m``, ``150m`` that fits) with
  ``--weights-dtype bf16``, fused AdamW (what the trainer uses on CUDA) and ``--gradient-checkpointing``:
  steady (after the last step) and peak, against what ``run_peer doctor`` predicts for the same settings
  (``cli.doctor_resources.training_bytes`` and ``host_bytes``). The GPU side is measured in a child process
  running the peer's own ``InnerTrainer`` (``torch.cuda`` allocator statistics); the host side is one real
  ``run_peer`` of that shape on the GPU, its whole process tree sampled by ``benchmarks.memory`` (PSS).
- ``throughput``: inner-loop tokens per second and MFU (6 x parameters x tokens/s over the GPU's dense bf16
  peak, from a table by GPU name; ``null`` when the GPU is not in it) per preset, default peer options.
- ``swarm``: two ``run_peer`` processes on the one GPU and a bootstrap on loopback, averaging at least 3
  rounds; every averaged epoch's ``params_sha256`` must be the same on both peers.
- ``simulator``: DiLoCo k = 4 against data parallel at equal compute (k x H x rounds sequences each), the
  ``small`` preset, H = 100, with the outer settings the peer would choose (``core.outer_defaults``) and with
  lr 1 without momentum: does "within 3% of data parallel" reproduce at this scale?

``--dry-run`` runs the same sections through the same code on the CPU at tiny shapes and a few steps
(``"dry_run": true`` in the JSON; bf16 weights need CUDA, so its memory probe keeps fp32 weights). Its numbers
say nothing about a GPU; it checks that the run-book works before a GPU is spent on it
(``tests/integration/test_gpu_runbook.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import memory as memory_bench

logger = logging.getLogger("gpu_runbook")
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SHAPES = {"1b": "2048,5632,22,32", "476m": "1280,3456,24,20"}
"""HIDDEN,INTERMEDIATE,LAYERS,HEADS of the shapes beyond the presets (``benchmarks.memory.save_shaped_model``)."""
FITS_24GB_BYTES = 23 * 2**30
"""A 24 GB card holds 24 GiB; the run-book leaves 1 GiB of it to the CUDA context and other processes."""
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12,
                   "4090": 165e12, "3090": 71e12, "V100": 125e12}
"""Dense bf16 (fp16 for V100) tensor-core peak by a substring of the GPU's name; the SXM figures for H100/H200
(an H100 PCIe peaks at 756e12, which this table would overstate: MFU then reads low)."""

FULL = dict(
    memory=dict(shapes=["1b", "476m", "150m"], seq_len=2048, batch=8, micro_batch=1, steps=6, weights_dtype="bf16",
                checkpointing=True, host_rounds=2, host_local_steps=3),
    throughput=dict(presets=["tiny", "mini", "small", "150m"], seq_len=512, batch=16, steps=30),
    swarm=dict(model="small", seq_len=256, batch=8, local_steps=20, rounds=3),
    simulator=dict(model="small", seq_len=256, batch=8, workers=4, local_steps=100, rounds=20, eval_batches=16,
                   inner_lr=1e-3, warmup=100),
)
LEASE = dict(
    memory=dict(shapes=["1b", "476m", "150m"], seq_len=2048, batch=8, micro_batch=1, steps=3, weights_dtype="bf16",
                checkpointing=True, host_rounds=1, host_local_steps=3),
    throughput=dict(presets=["tiny", "small", "150m"], seq_len=512, batch=16, steps=20),
    swarm=dict(model="small", seq_len=256, batch=8, local_steps=20, rounds=3),
    simulator=dict(model="small", seq_len=256, batch=8, workers=4, local_steps=100, rounds=8, eval_batches=8,
                   inner_lr=1e-3, warmup=100),
)
"""``--plan lease``: the same sections cut to fit a short GPU lease (about 8 minutes on an H100/H200): fewer
steps, presets and simulator rounds. Its simulator comparison is 8 rounds of H = 100, too short to settle the
3% question; the JSON's settings say so beside every figure."""
DRY = dict(
    memory=dict(shapes=["tiny"], seq_len=64, batch=2, micro_batch=1, steps=2, weights_dtype="fp32",
                checkpointing=True, host_rounds=3, host_local_steps=10),
    throughput=dict(presets=["tiny"], seq_len=64, batch=2, steps=3),
    swarm=dict(model="tiny", seq_len=64, batch=2, local_steps=2, rounds=3),
    simulator=dict(model="tiny", seq_len=32, batch=2, workers=4, local_steps=2, rounds=1, eval_batches=1,
                   inner_lr=1e-3, warmup=2),
)


# ------------------------------------------------------------------------------------------------ probe


def probe(model: str, seq_len: int, batch: int, micro_batch: int, steps: int, device: str, weights_dtype: str,
          checkpointing: bool) -> dict[str, Any]:
    """In THIS process (run it in a child): build ``model``, train ``steps`` inner steps with the peer's own
    ``InnerTrainer`` on random tokens, and report speed and memory, with doctor's prediction beside them."""
    import psutil
    import torch

    from p2p_diloco.cli.doctor_resources import model_shape, training_bytes
    from p2p_diloco.config import InnerConfig
    from p2p_diloco.models import build_model, count_parameters
    from p2p_diloco.trainer import InnerTrainer

    torch.manual_seed(0)
    vocab = 259  # the byte tokenizer's
    net = build_model(model, vocab, seq_len, dtype=torch.bfloat16 if weights_dtype == "bf16" else torch.float32)
    params = count_parameters(net)
    cfg = InnerConfig(batch_size=batch, micro_batch_size=micro_batch, lr=1e-4, warmup_steps=0, device=device,
                      weights_dtype=weights_dtype, gradient_checkpointing=checkpointing)

    def batches():
        while True:
            yield torch.randint(0, vocab, (batch, seq_len))

    trainer = InnerTrainer(net, cfg, batches())
    cuda = trainer.device.type == "cuda"
    fused = bool(trainer.optimizer.defaults.get("fused"))
    trainer.train_steps(1)  # warm-up: kernels, allocator, lazy AdamW state
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    trainer.train_steps(steps)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    tokens_per_s = steps * batch * seq_len / seconds
    shape = model_shape(model, "byte", seq_len)
    predicted = training_bytes(shape, micro_batch, seq_len, trainer.amp_dtype is not None,
                               checkpointing=checkpointing, weights_dtype=weights_dtype, fused_attention=cuda)
    out: dict[str, Any] = dict(
        model=model, params=params, device=str(trainer.device), weights_dtype=weights_dtype,
        checkpointing=checkpointing, fused_adamw=fused, amp_dtype=str(trainer.amp_dtype), seq_len=seq_len,
        batch=batch, micro_batch=micro_batch, steps=steps, step_s=seconds / steps, tokens_per_s=tokens_per_s,
        predicted_device_bytes=predicted, host_rss_bytes=psutil.Process().memory_info().rss)
    if cuda:
        name = torch.cuda.get_device_name(trainer.device)
        peak_flops = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        out.update(gpu=name, gpu_total_bytes=torch.cuda.get_device_properties(trainer.device).total_memory,
                   gpu_steady_bytes=torch.cuda.memory_allocated(), gpu_peak_bytes=torch.cuda.max_memory_allocated(),
                   gpu_peak_reserved_bytes=torch.cuda.max_memory_reserved(), peak_flops=peak_flops,
                   mfu=6 * params * tokens_per_s / peak_flops if peak_flops else None)
        out["gpu_peak_over_predicted"] = out["gpu_peak_bytes"] / predicted
    else:
        out.update(gpu=None, mfu=None)
    return out


def run_probe(work: Path, model: str, device: str, timeout: float, **settings: Any) -> dict[str, Any]:
    """``probe`` in a child process (a clean CUDA context and allocator per probe; an OOM kills only it)."""
    argv = [sys.executable, "-m", "benchmarks.gpu_runbook", "probe", "--model", model, "--device", device,
            "--json", json.dumps(settings)]
    done = subprocess.run(argv, capture_output=True, text=True, env=memory_bench._env(), timeout=timeout, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout)[-1500:]
        return dict(model=model, ok=False, oom="out of memory" in tail.lower(), error=tail)
    return dict(json.loads(lines[-1]), ok=True)


def model_argument(name: str, seq_len: int, work: Path) -> str:
    """A preset's name, or a local folder holding a Llama of one of ``SHAPES`` (random weights)."""
    if name not in SHAPES:
        return name
    folder = work / f"model-{name}"
    if not (folder / "config.json").exists():
        memory_bench.save_shaped_model(SHAPES[name], seq_len, folder)
    return str(folder)


# --------------------------------------------------------------------------------------------- sections


def section_memory(plan: dict[str, Any], device: str, work: Path, timeout: float) -> dict[str, Any]:
    from p2p_diloco.cli.doctor_resources import GPU_BYTES_PER_PARAM, host_bytes

    tried = []
    for name in plan["shapes"]:
        model = model_argument(name, plan["seq_len"], work)
        got = run_probe(work, model, device, timeout, seq_len=plan["seq_len"], batch=plan["batch"],
                        micro_batch=plan["micro_batch"], steps=plan["steps"], weights_dtype=plan["weights_dtype"],
                        checkpointing=plan["checkpointing"])
        got["shape"] = name
        tried.append(got)
        if got["ok"]:
            break
    fitted = next((t for t in tried if t["ok"]), None)
    out: dict[str, Any] = dict(settings=plan, tried=[{k: t.get(k) for k in ("shape", "ok", "oom")} for t in tried],
                               device_probe=fitted)
    if fitted is None:
        out.update(ok=False, error="no shape could train: " + str(tried[-1].get("error", ""))[-500:])
        return out
    n = fitted["params"]
    if fitted.get("gpu_peak_bytes"):
        out["gpu_bytes_per_param"] = dict(steady=fitted["gpu_steady_bytes"] / n, peak=fitted["gpu_peak_bytes"] / n,
                                          doctor_weights_grads_adamw=GPU_BYTES_PER_PARAM[plan["weights_dtype"]],
                                          doctor_with_activations=fitted["predicted_device_bytes"] / n)
        # a 24 GB card holds 24 GiB; 1 GiB of it is left for the CUDA context and the desktop
        out["fits_24gb"] = fitted["gpu_peak_reserved_bytes"] <= FITS_24GB_BYTES
    # the host side: one real peer of that shape, its whole process tree sampled (benchmarks.memory)
    extra = ["--device", device, "--micro-batch-size", str(plan["micro_batch"])]
    if plan["weights_dtype"] == "bf16":
        extra += ["--weights-dtype", "bf16"]
    if plan["checkpointing"]:
        extra += ["--gradient-checkpointing"]
    if fitted["shape"] in SHAPES:  # the folder the probe loaded, with the byte vocabulary
        extra += ["--tokenizer", "byte"]
    # batch = one micro-batch: the host side does not grow with the batch on a GPU, and benchmarks.memory counts
    # the model side with a CPU step of that batch
    args = argparse.Namespace(preset=fitted["model"], label="gpu-runbook", shape=None, peers=1,
                              rounds=plan["host_rounds"], local_steps=plan["host_local_steps"],
                              batch_size=plan["micro_batch"], seq_len=plan["seq_len"], joiner=False, interval=0.5,
                              timeout=timeout, keep=False, env=[], faults=[], extra=extra)
    host = memory_bench.run(args)
    phases = host["phases"]
    # steady: while training; a short run's sampler may catch only its other running phases
    running = {k: v for k, v in phases.items() if k != "starting"}
    steady = (running.get("training") or max(running.values(), key=lambda v: v["samples"], default={})).get(
        "steady_bytes")
    peak = max((p["peak_bytes"] for p in phases.values()), default=None)
    on_host_training = 0 if device.startswith("cuda") else fitted["predicted_device_bytes"]
    predicted_steady = host_bytes(n, peak=False) + on_host_training
    predicted_peak = host_bytes(n, peak=True) + on_host_training
    out["host"] = dict(params=host["params"], steady_bytes=steady, peak_bytes=peak,
                       doctor_steady_bytes=predicted_steady, doctor_peak_bytes=predicted_peak,
                       steady_over_doctor=steady / predicted_steady if steady else None,
                       peak_over_doctor=peak / predicted_peak if peak else None,
                       outcomes=host["outcomes"], exit_codes=host["exit_codes"],
                       phases={k: {m: v[m] for m in ("samples", "steady_bytes", "peak_bytes")} for k, v in phases.items()})
    out["ok"] = bool(steady) and all(code == 0 for code in host["exit_codes"].values())
    return out


def section_throughput(plan: dict[str, Any], device: str, work: Path, timeout: float) -> dict[str, Any]:
    rows = [run_probe(work, preset, device, timeout, seq_len=plan["seq_len"], batch=plan["batch"],
                      micro_batch=plan["batch"], steps=plan["steps"], weights_dtype="fp32", checkpointing=False)
            for preset in plan["presets"]]
    keep = ("model", "ok", "params", "device", "gpu", "amp_dtype", "fused_adamw", "tokens_per_s", "step_s", "mfu",
            "gpu_peak_bytes", "error")
    return dict(settings=plan, presets=[{k: r.get(k) for k in keep} for r in rows], ok=all(r["ok"] for r in rows))


def section_swarm(plan: dict[str, Any], device: str, work: Path, timeout: float) -> dict[str, Any]:
    """Two real peers on one device, until both averaged ``rounds`` epochs together (then stopped as on Ctrl+C);
    every such epoch's checksum must agree. Open-ended rather than ``--max-rounds``: a peer that starts later
    (two starts on a busy machine can be minutes apart) would otherwise find the other one gone."""
    import signal

    from p2p_diloco.demo import wait_for_maddr

    work = work / "swarm"
    work.mkdir(parents=True, exist_ok=True)
    env = memory_bench._env()
    procs: dict[str, subprocess.Popen] = {}
    with open(work / "bootstrap.out", "w") as out:
        boot = subprocess.Popen([sys.executable, "-m", "p2p_diloco.cli.run_bootstrap", "--identity-path",
                                 str(work / "bootstrap.id"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    began = time.monotonic()

    def together() -> tuple[dict[str, dict[int, str]], list[int]]:
        """Per peer, new epoch -> checksum of its rounds averaged in a group of 2; the epochs both have."""
        sha = {name: {r["new_epoch"]: r["params_sha256"] for r in memory_bench._rows(work / f"{name}.jsonl", "round")
                      if r["outcome"] == "averaged" and r["group_size"] >= 2} for name in ("a", "b")}
        return sha, sorted(set(sha["a"]) & set(sha["b"]))

    try:
        maddr = wait_for_maddr(work / "bootstrap.out", boot)
        for name in ("a", "b"):
            with open(work / f"{name}.out", "w") as out:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "p2p_diloco.cli.run_peer", *memory_bench.TIMINGS, "--initial-peers", maddr,
                     "--run-id", "gpu-runbook", "--model", plan["model"], "--device", device,
                     "--batch-size", str(plan["batch"]), "--seq-len", str(plan["seq_len"]),
                     "--local-steps", str(plan["local_steps"]), "--min-local-steps", str(plan["local_steps"]),
                     "--eval-every", "0", "--log-file", str(work / f"{name}.jsonl")],
                    stdout=out, stderr=subprocess.STDOUT, env=env)
        while time.monotonic() - began < timeout and all(p.poll() is None for p in procs.values()):
            if len(together()[1]) >= plan["rounds"]:
                break
            time.sleep(1)
        codes = {}
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.terminate()
                codes[name] = proc.wait(timeout=60)
    finally:
        for proc in (*procs.values(), boot):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    rounds = {name: memory_bench._rows(work / f"{name}.jsonl", "round") for name in procs}
    sha, both = together()
    identical = [e for e in both if sha["a"][e] == sha["b"][e]]
    out = dict(settings=plan, exit_codes=codes, wall_s=time.monotonic() - began,
               outcomes={n: [r["outcome"] for r in rows] for n, rows in rounds.items()},
               averaged_epochs=both, identical_epochs=identical,
               allreduce_s={n: [r["allreduce_seconds"] for r in rows] for n, rows in rounds.items()},
               tokens_per_s={n: [r["inner_steps"] * plan["batch"] * plan["seq_len"] / r["inner_seconds"]
                                 for r in rows if r["inner_seconds"]] for n, rows in rounds.items()})
    out["ok"] = len(identical) >= plan["rounds"] and identical == both and all(c == 0 for c in codes.values())
    if not out["ok"]:
        out["log_tail"] = {n: (work / f"{n}.out").read_text()[-1500:] for n in procs}
    return out


def section_simulator(plan: dict[str, Any], device: str,
                      on_run: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """DiLoCo k = 4 against data parallel at equal compute, on ``device``, by the simulator. ``on_run`` gets the
    runs finished so far after each one (a lease that ends mid-section keeps them)."""
    from p2p_diloco.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, RunConfig, TrainConfig
    from p2p_diloco.simulate import SimConfig, run

    def config(lr: float | None, momentum: float | None) -> TrainConfig:
        return TrainConfig(
            model=ModelConfig(plan["model"], seq_len=plan["seq_len"]), data=DataConfig(eval_batches=plan["eval_batches"]),
            inner=InnerConfig(batch_size=plan["batch"], lr=plan["inner_lr"], warmup_steps=plan["warmup"],
                              total_steps=plan["rounds"] * plan["local_steps"], device=device),
            outer=OuterConfig(local_steps=plan["local_steps"], min_local_steps=1, expected_peers=plan["workers"],
                              lr=lr, momentum=momentum),
            run=RunConfig(seed=0))

    runs = {}
    for label, mode, (lr, momentum) in (("ddp", "ddp", (None, None)), ("diloco-defaults", "diloco", (None, None)),
                                        ("diloco-lr1", "diloco", (1.0, 0.0))):
        cfg = config(lr, momentum)
        began = time.monotonic()
        res = run(cfg, SimConfig(mode, plan["workers"], plan["rounds"], batched=mode == "diloco"))
        runs[label] = dict(final_eval_loss=res.final_eval_loss, initial_eval_loss=res.initial_eval_loss,
                           outer_lr=cfg.outer.lr, outer_momentum=cfg.outer.momentum,
                           total_inner_steps=res.total_inner_steps, wall_s=time.monotonic() - began,
                           curve=[r.eval_loss for r in res.rounds])
        if on_run is not None:
            on_run(dict(settings=plan, runs=runs, ok=False, unfinished=True))
    ddp = runs["ddp"]["final_eval_loss"]
    ratios = {k: v["final_eval_loss"] / ddp for k, v in runs.items() if k != "ddp"}
    return dict(settings=plan, runs=runs, ratio_to_ddp=ratios,
                within_3_percent={k: r <= 1.03 for k, r in ratios.items()},
                ok=all(v["final_eval_loss"] == v["final_eval_loss"] for v in runs.values()))


# ------------------------------------------------------------------------------------------------- main


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = dict(host=platform.node(), cpu=platform.processor() or platform.machine(),
                                cores=os.cpu_count(), python=platform.python_version(), torch=torch.__version__,
                                cuda=torch.version.cuda, load_average_1m=os.getloadavg()[0])
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def runbook(dry_run: bool, sections: list[str], timeout: float, plan_name: str = "full",
            out: Path | None = None) -> dict[str, Any]:
    """Run ``sections`` in order; with ``out``, the JSON is rewritten after every section, so a run cut short
    (a lease that ends, a hung section killed from outside) still leaves what it measured."""
    plan = DRY if dry_run else PLANS[plan_name]
    device = "cpu" if dry_run else "cuda"
    payload: dict[str, Any] = dict(dry_run=dry_run, plan="dry-run" if dry_run else plan_name, device=device,
                                   began=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    with tempfile.TemporaryDirectory(prefix="gpu_runbook_") as tmp:
        work = Path(tmp)
        for name in sections:
            began = time.monotonic()
            logger.info("section %s ...", name)
            try:
                if name == "simulator":
                    def partial(result: dict[str, Any], name: str = name) -> None:
                        if out is not None:
                            out.write_text(json.dumps(dict(payload, **{name: result}), indent=1))

                    result = section_simulator(plan[name], device, partial)
                else:
                    result = SECTIONS[name](plan[name], device, work, timeout)
            except Exception as e:  # noqa: BLE001 - the other sections still run; the JSON says what failed
                result = dict(ok=False, error=f"{e!r}", traceback=traceback.format_exc()[-3000:])
            result["section_s"] = time.monotonic() - began
            payload[name] = result
            logger.info("section %s: %s in %.0f s", name, "ok" if result.get("ok") else "FAILED", result["section_s"])
            if out is not None:
                out.write_text(json.dumps(payload, indent=1))
    payload["machine"] = machine()  # last: the orchestrator touches CUDA only after every child has run
    payload["ok"] = all(payload[name].get("ok") for name in sections)
    return payload


def plot(payload: dict[str, Any], png: Path) -> None:
    """Two panels from a run-book JSON: memory measured against ``run_peer doctor``'s prediction (GPU peak, host
    steady and peak, GB), and the inner loop's tokens/s per preset (log scale, MFU in the labels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    mem = payload.get("memory") or {}
    probe_row, host = mem.get("device_probe") or {}, mem.get("host") or {}
    bars = [("GPU peak", probe_row.get("gpu_peak_bytes"), probe_row.get("predicted_device_bytes")),
            ("host steady", host.get("steady_bytes"), host.get("doctor_steady_bytes")),
            ("host peak", host.get("peak_bytes"), host.get("doctor_peak_bytes"))]
    bars = [b for b in bars if b[1] and b[2]]
    xs = range(len(bars))
    left.bar([x - 0.2 for x in xs], [b[1] / 1e9 for b in bars], 0.4, label="measured")
    left.bar([x + 0.2 for x in xs], [b[2] / 1e9 for b in bars], 0.4, label="run_peer doctor")
    left.set_xticks(list(xs), [b[0] for b in bars])
    left.set_ylabel("GB")
    left.set_title(f"memory, {probe_row.get('shape', '?')} shape ({(probe_row.get('params') or 0) / 1e9:.2f}B), "
                   f"{probe_row.get('weights_dtype', '?')}" + (" + ckpt" if probe_row.get("checkpointing") else ""))
    left.legend()
    rows = [r for r in (payload.get("throughput") or {}).get("presets", []) if r.get("ok")]
    if probe_row.get("tokens_per_s"):
        rows.append(dict(probe_row, model=f"{probe_row.get('shape')} (micro 1, ckpt)"))
    right.bar([r["model"] for r in rows], [r["tokens_per_s"] for r in rows])
    for i, r in enumerate(rows):
        if r.get("mfu") is not None:
            right.annotate(f"MFU {r['mfu']:.1%}", (i, r["tokens_per_s"]), ha="center", va="bottom", fontsize=8)
    right.set_yscale("log")
    right.set_ylabel("inner-loop tokens/s")
    gpu = (payload.get("machine") or {}).get("gpus") or [probe_row.get("gpu") or "?"]
    right.set_title(f"throughput on {gpu[0]}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


PLANS = {"full": FULL, "lease": LEASE}
SECTIONS = {"memory": section_memory, "throughput": section_throughput, "swarm": section_swarm,
            "simulator": section_simulator}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.gpu_runbook", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    p = sub.add_parser("probe", help="(internal) one training probe in this process, as JSON on stdout")
    p.add_argument("--model", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--json", required=True, help="the probe's other settings")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the run-book, "
                        "measures nothing about a GPU")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default benchmarks/results/gpu_runbook.json, or gpu_runbook_dry_run.json)")
    parser.add_argument("--plan", choices=sorted(PLANS), default="full",
                        help="full: the figures BENCHMARKS.md asks for (30-60 min on one GPU); lease: the same "
                        "sections cut to about 8 min, for a short GPU lease (ignored with --dry-run)")
    parser.add_argument("--plot", type=Path, default=None, metavar="JSON",
                        help="only draw the PNG (beside it) of a run-book JSON written earlier, e.g. one copied back "
                        "from a GPU machine")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per probe and per swarm")
    args = parser.parse_args(argv)
    if args.cmd == "probe":
        print(json.dumps(probe(args.model, device=args.device, **json.loads(args.json))))
        return 0
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        print(f"gpu_runbook: wrote {args.plot.with_suffix('.png')}")
        return 0
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device here; pass --dry-run to check the run-book on the CPU")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = args.out or RESULTS / ("gpu_runbook_dry_run.json" if args.dry_run else "gpu_runbook.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = runbook(args.dry_run, sections, args.timeout, args.plan, out)
    out.write_text(json.dumps(payload, indent=1))
    print(f"gpu_runbook: {'ok' if payload['ok'] else 'FAILED'}; "
          + ", ".join(f"{s} {'ok' if payload[s].get('ok') else 'failed'}" for s in sections) + f"; wrote {out}")
    return 0 if payload["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
