"""Host memory of real peers, per phase, in bytes per parameter; and the per-round work outside the network.

    .venv/bin/python -m benchmarks.memory run --preset small --peers 2 --rounds 4 --joiner
    .venv/bin/python -m benchmarks.memory report          # table into BENCHMARKS.md, plot, extrapolation

``run`` starts a real bootstrap and real ``run_peer`` processes on loopback (the tests' timings, see
``tests/swarm_procs.py``), each with ``--metrics-port`` (the phase gauge says what the peer does now) and
``--checkpoint-dir``. A sampler reads, every ``--interval`` seconds, the proportional set size (PSS) of each
peer's whole process tree (the training process, the DHT and averager processes, and their children, via
``psutil``'s ``memory_full_info().pss``): PSS splits pages shared between processes (the averager's shared
buffers, the libraries) so that the tree's sum counts each byte once. With ``--joiner`` a peer joins after
the first round: its own samples while it syncs are the "join download", and the donors' samples meanwhile
are "serving". Peak and steady (median) per phase go to ``benchmarks/results/memory.json``.

The model side (weights, gradients, AdamW state) is counted from the tensors themselves after one real
AdamW step, in a child process, per device. "Swarm side" is what the peer holds beyond that and beyond the
runtime (interpreter, torch, hivemind, the DHT's daemon): the tiny preset's whole-tree PSS less its model
side, whose parameters are too few to matter.

Per-round overhead is ``RoundReport.overhead_seconds``: the time ``end_round`` spends outside the network
(pseudo-gradient, outer step, serving, hashing, publishing), read from the peers' run logs; the checkpoint's
host copy on the training thread is ``checkpoint_seconds`` of the ``checkpoint`` log event.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from p2p_diloco.peer.runlog import read_records

logger = logging.getLogger("memory")
RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
# The tests' loopback timings (tests/swarm_procs.py FAST), with more room for a large model's all-reduce and
# state download on a loaded 2-core machine.
TIMINGS = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--matchmaking-time-s", "6", "--matchmaking-timeout-s", "60",
           "--allreduce-timeout-s", "600", "--next-chunk-timeout-s", "120", "--request-timeout-s", "3",
           "--state-download-timeout-s", "600", "--startup-timeout-s", "120", "--progress-ttl-s", "600",
           "--shutdown-timeout-s", "30"]
_PHASE = re.compile(r'^p2p_diloco_phase\{phase="([a-z_]+)"\} 1\.0$', re.M)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("P2P_DILOCO_FAULTS", None)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def tree_pss(pid: int) -> dict[str, int] | None:
    """PSS in bytes of ``pid`` and all its descendants by part, or None when it is gone. Parts: ``training``
    (the peer's own process), ``children`` (the forked DHT and averager processes), ``p2pd`` (libp2p daemons),
    ``other`` (e.g. torch's shared-memory manager)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    parts = {"training": 0, "children": 0, "p2pd": 0, "other": 0}
    for proc in procs:
        try:
            pss = proc.memory_full_info().pss
            name = proc.name()
        except psutil.Error:
            continue
        part = ("training" if proc.pid == pid else "p2pd" if name.startswith("p2pd")
                else "children" if name.startswith("python") else "other")
        parts[part] += pss
    return parts


def read_phase(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return None
    match = _PHASE.search(text)
    return match.group(1) if match else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_side(preset: str, seq_len: int, batch: int) -> dict[str, Any]:
    """Bytes of weights, gradients and AdamW state by device, counted from the tensors after one step."""
    code = (
        "import json, torch, sys\n"
        "torch.set_num_threads(1)\n"
        "from p2p_diloco.models import build_model\n"
        "from p2p_diloco.trainer import make_adamw\n"
        "from p2p_diloco.config import InnerConfig\n"
        f"m = build_model({preset!r}, 259, {seq_len})\n"
        "opt = make_adamw(list(m.named_parameters()), InnerConfig())\n"
        f"x = torch.randint(0, 259, ({batch}, {seq_len}))\n"
        "m(input_ids=x, labels=x).loss.backward(); opt.step()\n"
        "out = {'params': sum(p.numel() for p in m.parameters()), 'by_device': {}}\n"
        "def add(dev, kind, n):\n"
        "    d = out['by_device'].setdefault(str(dev), {}); d[kind] = d.get(kind, 0) + n\n"
        "for p in m.parameters():\n"
        "    add(p.device, 'weights', p.numel() * p.element_size())\n"
        "    if p.grad is not None: add(p.grad.device, 'gradients', p.grad.numel() * p.grad.element_size())\n"
        "for st in opt.state.values():\n"
        "    for t in st.values():\n"
        "        if torch.is_tensor(t): add(t.device, 'optimizer', t.numel() * t.element_size())\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=1800,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


class Sampler(threading.Thread):
    """Samples (time, name, phase, pss bytes) of each named peer until stopped."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.peers: dict[str, tuple[int, int]] = {}  # name -> (pid, metrics port)
        self.samples: list[tuple[float, str, str, int]] = []
        self.parts: list[dict[str, int]] = []
        self.syncing: set[str] = set()
        self._stop_event = threading.Event()

    def add(self, name: str, pid: int, port: int) -> None:
        self.peers[name] = (pid, port)

    def run(self) -> None:
        while not self._stop_event.is_set():
            now = time.time()
            peers = dict(self.peers)
            phases = {name: read_phase(port) or "starting" for name, (_pid, port) in peers.items()}
            self.syncing = {n for n, p in phases.items() if p == "syncing"}
            for name, (pid, _port) in peers.items():
                parts = tree_pss(pid)
                if parts is None:
                    continue
                phase = phases[name]
                if phase in ("training", "averaging", "matchmaking") and self.syncing - {name}:
                    phase = "serving"
                self.samples.append((now, name, phase, sum(parts.values())))
                self.parts.append(parts)
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)


def _rows(path: Path, kind: str) -> list[dict[str, Any]]:
    return read_records(path, kind)


def save_shaped_model(shape: str, seq_len: int, folder: Path) -> None:
    """A Llama of ``HIDDEN,INTERMEDIATE,LAYERS,HEADS`` with random weights and the byte vocabulary, saved as a
    local model folder (config.json + safetensors): the peers load it as any local model (``--model DIR``),
    through ``from_pretrained``. For sizes between the presets, e.g. 1280,3456,24,20 (about 476M)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads = (int(v) for v in shape.split(","))
    config = LlamaConfig(vocab_size=259, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max(seq_len, 128), tie_word_embeddings=True, pad_token_id=0,
                         bos_token_id=None, eos_token_id=1)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    del model


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"mem-{Path(args.preset).name}-"))  # --preset may name a model folder
    model_arg = [] if args.shape else ["--model", args.preset]
    if args.shape:  # --preset names the result; the model is a local folder of that shape
        save_shaped_model(args.shape, args.seq_len, work / "model")
        model_arg = ["--model", str(work / "model"), "--tokenizer", "byte"]
    logger.info("model side of %s ...", args.preset)
    model = model_side(str(work / "model") if args.shape else args.preset, args.seq_len, args.batch_size)
    n = model["params"]
    logger.info("%s: %d parameters, %s", args.preset, n, model["by_device"])
    env = _env()
    env.update(dict(kv.split("=", 1) for kv in args.env))
    boot_out = open(work / "bootstrap.out", "w")
    boot = subprocess.Popen([sys.executable, "-m", "p2p_diloco.cli.run_bootstrap", "--identity-path",
                             str(work / "bootstrap.id"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
                            stdout=boot_out, stderr=subprocess.STDOUT, env=env)
    from p2p_diloco.demo import wait_for_maddr

    maddr = wait_for_maddr(work / "bootstrap.out", boot)
    sampler = Sampler(args.interval)
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, rounds: int) -> None:
        port = free_port()
        argv = [sys.executable, "-m", "p2p_diloco.cli.run_peer", *TIMINGS, "--initial-peers", maddr,
                *model_arg, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                "--local-steps", str(args.local_steps), "--min-local-steps", str(args.local_steps),
                "--eval-every", "0", "--max-rounds", str(rounds), "--metrics-port", str(port),
                "--log-file", str(work / f"{name}.jsonl"), "--checkpoint-dir", str(work / f"ckpt-{name}"),
                "--checkpoint-every", "1", "--keep-checkpoints", "1", *args.extra]
        faults = dict(kv.split("=", 1) for kv in args.faults)
        peer_env = dict(env, P2P_DILOCO_FAULTS=faults[name]) if name in faults else env
        procs[name] = subprocess.Popen(argv, stdout=open(work / f"{name}.out", "w"), stderr=subprocess.STDOUT,
                                       env=peer_env)
        sampler.add(name, procs[name].pid, port)

    began = time.time()
    try:
        sampler.start()
        for i in range(args.peers):
            start(f"peer{i}", 1_000_000 if args.joiner else args.rounds)
        if args.joiner:
            deadline = time.monotonic() + args.timeout
            while time.monotonic() < deadline and not _rows(work / "peer0.jsonl", "round"):
                if procs["peer0"].poll() is not None:
                    break
                time.sleep(1)
            start("joiner", 1)
        deadline = time.monotonic() + args.timeout
        if args.joiner:
            # The donors train on (their --max-rounds is open) until the joiner has downloaded and done its
            # round, and until they did --rounds rounds; then they stop as on Ctrl+C.
            while time.monotonic() < deadline and procs["joiner"].poll() is None:
                time.sleep(1)
            while time.monotonic() < deadline and any(
                    len(_rows(work / f"peer{i}.jsonl", "round")) < args.rounds and procs[f"peer{i}"].poll() is None
                    for i in range(args.peers)):
                time.sleep(1)
            for i in range(args.peers):
                if procs[f"peer{i}"].poll() is None:
                    procs[f"peer{i}"].send_signal(signal.SIGINT)
        for name, proc in procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not finish within --timeout; stopping it", name)
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    finally:
        sampler.stop()
        for proc in [*procs.values(), boot]:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    phases: dict[str, dict[str, Any]] = {}
    for phase in sorted({s[2] for s in sampler.samples}):
        values = [s[3] for s in sampler.samples if s[2] == phase]
        parts = [p for s, p in zip(sampler.samples, sampler.parts, strict=True) if s[2] == phase]
        phases[phase] = {"samples": len(values), "steady_bytes": statistics.median(values),
                         "peak_bytes": max(values), "steady_b_per_param": statistics.median(values) / n,
                         "peak_b_per_param": max(values) / n,
                         "steady_parts_bytes": {k: statistics.median(p[k] for p in parts) for k in parts[0]}}
    rounds = {name: _rows(work / f"{name}.jsonl", "round") for name in procs}
    ckpts = {name: _rows(work / f"{name}.jsonl", "checkpoint") for name in procs}
    overhead = [r.get("overhead_seconds") for rows in rounds.values() for r in rows[1:]
                if r.get("overhead_seconds") is not None]
    inner = [r["inner_seconds"] / max(1, r["inner_steps"]) for rows in rounds.values() for r in rows
             if r["inner_steps"]]
    ck_s = [r["checkpoint_seconds"] for rows in ckpts.values() for r in rows if "checkpoint_seconds" in r]
    result = {
        "preset": args.preset, "params": n, "peers": args.peers, "joiner": args.joiner, "rounds": args.rounds,
        "local_steps": args.local_steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "extra_args": args.extra, "shape": args.shape, "faults": args.faults, "env": args.env, "label": args.label,
        "model_side": model["by_device"],
        "model_side_b_per_param": sum(sum(d.values()) for d in model["by_device"].values()) / n,
        "phases": phases,
        "outcomes": {name: {o: [r["outcome"] for r in rows].count(o) for o in {r["outcome"] for r in rows}}
                     for name, rows in rounds.items()},
        "exit_codes": {name: proc.returncode for name, proc in procs.items()},
        "overhead_seconds_median": statistics.median(overhead) if overhead else None,
        "inner_step_seconds_median": statistics.median(inner) if inner else None,
        "checkpoint_seconds_median": statistics.median(ck_s) if ck_s else None,
        "wall_seconds": time.time() - began, "load_avg_1m": os.getloadavg()[0],
        "timeline": [(round(t - began, 2), name, phase, pss) for t, name, phase, pss in sampler.samples],
    }
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        logger.info("logs kept in %s", work)
    return result


def save(result: dict[str, Any], path: Path) -> None:
    data = json.loads(path.read_text()) if path.exists() else {"runs": []}
    key = (result["preset"], result["label"])
    data["runs"] = [r for r in data["runs"] if (r["preset"], r["label"]) != key] + [result]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.memory", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="start a swarm and sample its memory")
    r.add_argument("--preset", default="tiny")
    r.add_argument("--label", default="after", help="a name for this measurement (e.g. before, after)")
    r.add_argument("--shape", help="HIDDEN,INTERMEDIATE,LAYERS,HEADS: peers load a Llama of this shape from a local "
                   "folder (random weights, byte vocabulary) instead of the preset; --preset then only names it")
    r.add_argument("--peers", type=int, default=2)
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--local-steps", type=int, default=3)
    r.add_argument("--batch-size", type=int, default=1)
    r.add_argument("--seq-len", type=int, default=64)
    r.add_argument("--joiner", action="store_true", help="a third peer joins after the first round")
    r.add_argument("--interval", type=float, default=0.5)
    r.add_argument("--timeout", type=float, default=1800)
    r.add_argument("--keep", action="store_true", help="keep the peers' logs")
    r.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the peers, e.g. MALLOC_MMAP_THRESHOLD_=65536")
    r.add_argument("--faults", action="append", default=[], metavar="PEER=SPEC",
                   help="faults of one peer (peer0, peer1, joiner), e.g. peer1=slow_steps@1=8: it misses a round, "
                        "resyncs and folds its work in late (p2p_diloco.peer.faults)")
    r.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more run_peer flags")
    sub.add_parser("report", help="BENCHMARKS.md table, plot and extrapolation from memory.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    path = RESULTS / "memory.json"
    if args.cmd == "run":
        result = run(args)
        save(result, path)
        summary = {k: v for k, v in result.items() if k != "timeline"}
        print(json.dumps(summary, indent=1))
        return 0
    from benchmarks.memory_report import report

    print(report(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
