"""The memory section of BENCHMARKS.md and its plot, from ``benchmarks/results/memory.json``.

    .venv/bin/python -m benchmarks.memory report

Swarm side = whole-tree PSS - model side (counted from the tensors) - runtime (the tiny preset's whole-tree
PSS of the same label, whose parameters are too few to matter), per parameter. The extrapolation to 1B and
7B multiplies the measured swarm-side bytes per parameter of the largest preset measured and adds the
runtime; the GPU side uses ``cli.doctor_resources``' bytes per parameter (weights, gradients, AdamW) plus
the activations of one 2048-token sequence of a Llama-shaped model of that size.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
GIB = 2**30
PHASES = ("training", "averaging", "serving", "syncing")
START, END = "<!-- memory:start -->", "<!-- memory:end -->"
INNER_PHASE_STEPS = 500
# Llama-shaped models for the extrapolation: (parameters, layers, hidden, heads, vocabulary)
SIZES = {"1B": (1.1e9, 22, 2048, 32, 32000), "7B": (6.7e9, 32, 4096, 32, 32000)}


def _runtime(runs: list[dict[str, Any]], label: str) -> float | None:
    tiny = [r for r in runs if r["preset"] == "tiny" and r["label"] == label]
    return tiny[0]["phases"]["training"]["steady_bytes"] if tiny and "training" in tiny[0]["phases"] else None


def summarize(run: dict[str, Any], runtime: float | None) -> dict[str, Any]:
    n = run["params"]
    model = run["model_side_b_per_param"] * n
    out: dict[str, Any] = {"preset": run["preset"], "label": run["label"], "params": n,
                           "model_b": run["model_side_b_per_param"], "phases": {}, "joiner": run.get("joiner", False),
                           "peers": run.get("peers", 2), "shape": run.get("shape"),
                           "extra_args": run.get("extra_args", []), "faults": run.get("faults", [])}
    for phase in PHASES:
        p = run["phases"].get(phase)
        if p is None:
            continue
        row = {"steady": p["steady_b_per_param"], "peak": p["peak_b_per_param"]}
        if runtime is not None and run["preset"] != "tiny":
            row["swarm_steady"] = (p["steady_bytes"] - model - runtime) / n
            row["swarm_peak"] = (p["peak_bytes"] - model - runtime) / n
        out["phases"][phase] = row
    swarm = [r for r in out["phases"].values() if "swarm_steady" in r]
    if swarm:
        out["swarm_steady"] = out["phases"].get("training", swarm[0]).get("swarm_steady")
        out["swarm_peak"] = max(r["swarm_peak"] for r in swarm)
    overhead, step = run.get("overhead_seconds_median"), run.get("inner_step_seconds_median")
    if overhead is not None and step:
        out["overhead_s"] = overhead
        out["overhead_pct_of_500"] = 100 * overhead / (INNER_PHASE_STEPS * step)
        out["overhead_ns_per_param"] = 1e9 * overhead / n
        out["inner_step_s"] = step
    out["checkpoint_s"] = run.get("checkpoint_seconds_median")
    out["outcomes"] = run.get("outcomes", {})
    return out


def gpu_bytes(size: str, weights_dtype: str, checkpointing: bool) -> int:
    from p2p_diloco.cli.doctor_resources import ModelShape, training_bytes

    params, layers, hidden, heads, vocab = SIZES[size]
    shape = ModelShape(int(params), layers, hidden, heads, vocab)
    return training_bytes(shape, 1, 2048, True, checkpointing=checkpointing, weights_dtype=weights_dtype,
                          fused_attention=True)


def extrapolate(swarm_steady: float, swarm_peak: float, runtime: float) -> list[dict[str, Any]]:
    rows = []
    for size, (params, *_rest) in SIZES.items():
        host_steady = runtime + swarm_steady * params
        host_peak = runtime + swarm_peak * params
        gpu = {f"{dtype}{'+ckpt' if ck else ''}": gpu_bytes(size, dtype, ck)
               for dtype in ("fp32", "bf16") for ck in (False, True)}
        rows.append({"size": size, "params": params, "host_steady": host_steady, "host_peak": host_peak,
                     "gpu": gpu, "host_fits_32gb": host_peak <= 32e9 * 0.9,
                     "gpu_fits_24gb": [k for k, v in gpu.items() if v <= 24e9 * 0.92]})
    return rows


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in summaries if "swarm_steady" in s]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{s['preset']}\n{s['label']}" for s in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [s["swarm_steady"] for s in rows], 0.4, label="steady (training)")
    ax.bar([i + 0.2 for i in x], [s["swarm_peak"] for s in rows], 0.4, label="peak (any phase)")
    ax.axhline(12, color="green", linestyle="--", linewidth=1, label="target steady 12")
    ax.axhline(16, color="red", linestyle=":", linewidth=1, label="target peak 16")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("host bytes / parameter, swarm side")
    ax.set_title("Host memory beyond the training side and the runtime (PSS, whole process tree)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(data: dict[str, Any], summaries: list[dict[str, Any]], extra: list[dict[str, Any]] | None,
             basis: str) -> str:
    lines = [START, "",
             "`python -m benchmarks.memory run --preset P --peers 2 --rounds R --joiner` starts a bootstrap and real "
             "`run_peer` processes on loopback (batch 1, 64 tokens, 3 inner steps per round, a checkpoint every round, "
             "and a third peer that joins after the first round) and samples the proportional set size (PSS) of each "
             "peer's whole process tree (training process, forked DHT and averager processes, p2p daemons) with the "
             "phase its metrics report; `python -m benchmarks.memory report` writes this section and "
             "`benchmarks/results/memory.png`. Bytes per parameter = PSS / parameters. *Swarm side* = PSS - model side "
             "(weights, gradients, AdamW state, counted from the tensors: 16 bytes/parameter on this CPU) - runtime "
             "(the tiny preset's whole-tree PSS while training, same label). `serving` = a donor while the joiner "
             "downloads from it; `syncing` = the joiner while it downloads (its steady value mixes the download at "
             "start-up, before its first step allocates gradients and AdamW state, 12 of the 16 bytes/param counted "
             "as model side, hence the low or negative swarm side, with its resyncs after a round: read the peak). "
             "Every peer shares the 2 cores and 24 GiB "
             "with other jobs (1-minute load average at the end of each run in the JSON). `476m`: "
             "`--preset 476m --shape 1280,3456,24,20 --peers 1`, one peer of a 476M-parameter Llama that it loads from "
             "a local model folder (`from_pretrained`), stepping alone; two peers of that size do not fit this "
             "machine.", ""]
    lines += ["| preset | label | parameters | phase | steady B/param | peak B/param | swarm side steady | "
              "swarm side peak |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in summaries:
        for phase, row in s["phases"].items():
            lines.append(f"| {s['preset']} | {s['label']} | {s['params']:,} | {phase} | {row['steady']:.1f} | "
                         f"{row['peak']:.1f} | {_fmt(row.get('swarm_steady'))} | {_fmt(row.get('swarm_peak'))} |")
    lines += ["", "Per-round overhead: the time `end_round` spends outside the network (pseudo-gradient, outer step, "
              "the one hash of the new anchors, waiting for a checkpoint write), `RoundReport.overhead_seconds`, "
              f"median over rounds after the first, against an inner phase of {INNER_PHASE_STEPS} steps at the "
              "measured step time. The checkpoint is written in the background from the live anchors "
              "(`checkpoint_seconds`: its whole write, off the training thread).", "",
              "| preset | label | overhead s | inner step s | % of a 500-step phase | ns per parameter | "
              "background checkpoint s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in summaries:
        if "overhead_s" in s:
            lines.append(f"| {s['preset']} | {s['label']} | {s['overhead_s']:.2f} | {s['inner_step_s']:.2f} | "
                         f"{s['overhead_pct_of_500']:.3f}% | {s['overhead_ns_per_param']:.1f} | "
                         f"{_fmt(s.get('checkpoint_s'), '.2f')} |")
    if extra:
        lines += ["", f"Extrapolation ({basis}). GPU: one 2048-token sequence per micro-batch, bf16 autocast, fused (SDPA) attention; "
                  "`fp32` / `bf16` = `--weights-dtype`, `+ckpt` = `--gradient-checkpointing`. Fits = within 90% of "
                  "32 GB RAM (host, at its peak) and 92% of 24 GB (GPU).", "",
                  "| size | host steady GB | host peak GB | fits 32 GB RAM | GPU fp32 | GPU fp32+ckpt | GPU bf16 | "
                  "GPU bf16+ckpt | fits 24 GB GPU with |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in extra:
            g = r["gpu"]
            lines.append(f"| {r['size']} | {r['host_steady'] / 1e9:.1f} | {r['host_peak'] / 1e9:.1f} | "
                         f"{'yes' if r['host_fits_32gb'] else 'no'} | {g['fp32'] / 1e9:.1f} | "
                         f"{g['fp32+ckpt'] / 1e9:.1f} | {g['bf16'] / 1e9:.1f} | {g['bf16+ckpt'] / 1e9:.1f} | "
                         f"{', '.join(r['gpu_fits_24gb']) or 'none'} |")
    lines += ["", *reading(summaries, extra), "", "![memory](benchmarks/results/memory.png)", "", END]
    return "\n".join(lines)


def reading(summaries: list[dict[str, Any]], extra: list[dict[str, Any]] | None) -> list[str]:
    """What the tables say, with the targets (steady <= 12, peak <= 16 bytes/param, overhead <= 1%)."""
    out = ["Reading:", ""]
    by = {(s["preset"], s["label"]): s for s in summaries}
    for preset in ("small", "150m"):
        before, after = by.get((preset, "before")), by.get((preset, "after"))
        if before and after and "swarm_steady" in before and "swarm_steady" in after:
            out.append(f"- {preset}: swarm side {before['swarm_steady']:.1f} -> {after['swarm_steady']:.1f} "
                       f"bytes/param steady, {before['swarm_peak']:.1f} -> {after['swarm_peak']:.1f} at peak.")
    for s in summaries:  # variants of the after-code (e.g. ``eager``: --overlap eager), against its plain run
        plain = by.get((s["preset"], "after"))
        if s["label"] not in ("before", "after") and plain and "swarm_steady" in s and "swarm_steady" in plain:
            how = " ".join([*(s.get("extra_args") or []), *(f"--faults {f}" for f in s.get("faults") or [])])
            out.append(f"- {s['preset']}, {s['label']} ({how or 'same flags'}): "
                       f"swarm side {s['swarm_steady']:.1f} bytes/param steady, {s['swarm_peak']:.1f} at peak, "
                       f"against {plain['swarm_steady']:.1f} and {plain['swarm_peak']:.1f} without.")
    after = [s for s in summaries if s["label"] == "after" and "swarm_steady" in s]
    full = max((s for s in after if s["joiner"]), key=lambda s: s["params"], default=None)
    largest = max(after, key=lambda s: s["params"], default=None)
    for s in [x for x in (full, largest) if x is not None][: 1 if full is largest else 2]:
        worst = max(s["phases"].items(), key=lambda kv: kv[1].get("swarm_peak", 0.0))
        what = ("every phase" if s["joiner"] else
                f"{s['peers']} peer, solo rounds: no serving or download phase, whose peak the row above gives")
        out.append(f"- {s['preset']} ({what}): steady {s['swarm_steady']:.1f} bytes/param "
                   f"(target 12: {'met' if s['swarm_steady'] <= 12 else 'missed'}), peak "
                   f"{s['swarm_peak']:.1f} in phase `{worst[0]}` (target 16: "
                   f"{'met' if s['swarm_peak'] <= 16 else 'missed'}).")
    if largest:
        if "overhead_pct_of_500" in largest:
            out.append(f"- Round overhead at {largest['preset']}: {largest['overhead_s']:.2f} s, "
                       f"{largest['overhead_pct_of_500']:.3f}% of a 500-step phase of this CPU's steps (target 1%: "
                       f"{'met' if largest['overhead_pct_of_500'] <= 1 else 'missed'}); "
                       f"{largest['overhead_ns_per_param']:.0f} ns/param, i.e. about "
                       f"{largest['overhead_ns_per_param']:.0f} s per round at 1B on this loaded CPU.")
    for r in extra or []:
        out.append(f"- {r['size']}: host {r['host_steady'] / 1e9:.1f} GB steady, {r['host_peak'] / 1e9:.1f} GB at "
                   f"peak ({'fits' if r['host_fits_32gb'] else 'does not fit'} 32 GB RAM at its peak); GPU fits 24 GB "
                   f"with: {', '.join(r['gpu_fits_24gb']) or 'no option'}.")
    out += ["", "Not measured (misses stay listed):", "",
            "- A 400-500M config in a swarm: two such peers (about 13 GB each with the training side on this CPU) "
            "do not fit this 24 GiB machine, so the 476m row is one peer's solo rounds: no all-reduce, serving or "
            "download at that size.",
            "- 150m before the changes: two peers needed about 18 GB together; the issue's own measurement was "
            "8.8 GB per peer.",
            "- A late-work fold and eager overlap are measured at `small` only (the `fold` and `eager` rows): the "
            "phase gauge has no phase of its own for a fold, so its buffers show in the peaks of `averaging` and "
            "`syncing`.",
            "- The per-round hash still blocks the training thread (inside the overhead above): the anchors' and "
            "the momentum's chunks, on up to 8 threads (`checksum.HASH_THREADS`; 1.56 GB/s on one core of this "
            "machine, 3.1 on both, idle), about 1 s per round at 1B on 8 cores. The training thread could go on "
            "while it runs; not built."]
    return out


def report(path: Path) -> str:
    data = json.loads(path.read_text())
    runs = data["runs"]
    order = {"tiny": 0, "mini": 1, "small": 2, "150m": 3}
    runs.sort(key=lambda r: (order.get(r["preset"], 9), r["params"], r["label"] != "before"))
    # a variant without its own tiny run (e.g. ``eager``) uses the after-code's runtime
    summaries = [summarize(r, _runtime(runs, r["label"]) or _runtime(runs, "after")) for r in runs]
    plot(summaries, RESULTS / "memory.png")
    after = [s for s in summaries if s["label"] == "after" and "swarm_steady" in s and s["joiner"]]
    extra, basis = None, ""
    if after:  # the largest run that went through every phase (a joiner: serving and download too)
        largest = max(after, key=lambda s: s["params"])
        runtime = _runtime(runs, "after") or 0.0
        extra = extrapolate(largest["swarm_steady"], largest["swarm_peak"], runtime)
        basis = (f"swarm side {largest['swarm_steady']:.1f} B/param steady, {largest['swarm_peak']:.1f} at peak, "
                 f"measured at {largest['preset']}; runtime {runtime / GIB:.2f} GiB")
    section = markdown(data, summaries, extra, basis)
    bench = ROOT / "BENCHMARKS.md"
    text = bench.read_text()
    if START in text:
        text = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _m: section, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n## Host memory\n\n" + section + "\n"
    bench.write_text(text)
    (RESULTS / "memory_summary.json").write_text(json.dumps({"summaries": summaries, "extrapolation": extra},
                                                            indent=1))
    return section
