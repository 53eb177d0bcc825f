"""p2p_diloco at its defaults against hivemind's own Optimizer, as a user would try them, on loopback or on the
namespace testbed behind a rate limit.

    .venv/bin/python -m benchmarks.vs_hivemind [--peers 3] [--seconds 150] [--sides p2p,hm-local,hm-grad]
    .venv/bin/python -m benchmarks.vs_hivemind --quick        # 2 peers, 90 s each side: checks the script
    .venv/bin/python -m benchmarks.vs_hivemind --peers 4 --rate-mbit 20   # as root: each peer in a namespace

Sides, each ``--peers`` real processes (a bootstrap DHT node first), ``--seconds`` of wall-clock from each
peer's start, one thread per peer. On loopback by default; with ``--rate-mbit`` each side gets its own
``benchmarks.testbed.Testbed``: the bootstrap and every peer in its own network namespace, each link limited
to that rate both ways with ``tc tbf``, and every peer's bytes sent counted by its link (headers included, the
same for both sides). The sides:

- ``p2p``: ``run_peer`` at its defaults (outer settings chosen from H, blocking rounds, its deadlines),
  ``--eval-every 1`` so that its eval loss is read every round like the others'.
- ``hm-local``: ``hivemind.Optimizer(use_local_updates=True)``: AdamW steps on local gradients, parameters
  averaged in the background every ``target_batch_size = peers x H x batch`` samples (H local steps each).
- ``hm-grad``: ``hivemind.Optimizer`` in its default mode: gradients accumulated to the same target batch,
  averaged, then one AdamW step (with ``delay_optimizer_step`` and ``delay_grad_averaging`` off, hivemind's
  defaults for a CPU optimizer).

Identical on every side: the model (the ``tiny`` preset, same seed), each peer's data shard (the peer's name
picks it, as a peer id does), sequence length, batch, inner AdamW (lr, betas (0.9, 0.95), weight decay 0.1
on matrices, clipping 1.0, linear warm-up then constant), the held-out batches and the evaluation cadence
(every H local steps). hivemind's side keeps its own defaults except ``matchmaking_time`` and
``averaging_timeout``, set to p2p_diloco's (15 s and 60 s) and tried at 3 s (``--hm-matchmaking-s``).

Per side: eval loss against wall-clock and tokens, the time to reach a common loss (the worst side's best),
the time each side takes to reach every side's final loss (the issue's "time to hivemind's final loss"),
compute utilization (seconds in forward/backward/optimizer over wall seconds), whether the peers' parameters
are identical at the end, and bytes sent per peer: on the testbed from each peer's link, on loopback from
p2p_diloco's round log only (hivemind's traffic cannot be told apart there). Writes
``benchmarks/results/vs_hivemind.json`` and ``.png``. Report the machine's load beside the numbers: the peers
share its cores.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from p2p_diloco.peer.runlog import read_records

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODEL, SEQ_LEN, BATCH, INNER_LR, WARMUP, H, EVAL_BATCHES = "tiny", 128, 16, 1e-3, 20, 20, 8


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class Hosts:
    """Where one side's processes run: all on loopback, or host ``i`` in namespace ``i`` of a testbed (the
    bootstrap in 0, peer ``i`` in ``i + 1``)."""

    def __init__(self, bed: Any = None):
        self.bed = bed

    def address(self, index: int) -> str:
        return "127.0.0.1" if self.bed is None else self.bed.host_ip(index)

    def popen(self, index: int, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(argv, **kwargs) if self.bed is None else self.bed.popen(index, argv, **kwargs)

    def bootstrap_maddr(self, out: Path, proc: subprocess.Popen) -> str:
        if self.bed is None:
            from p2p_diloco.demo import wait_for_maddr

            return wait_for_maddr(out, proc)
        from benchmarks.testbed import wait_for_maddr as wait_on_testbed

        return wait_on_testbed(out, proc)

    def bytes_sent(self, index: int) -> int | None:
        """What host ``index`` sent over its link so far; None on loopback (not separable there)."""
        return None if self.bed is None else self.bed.link_bytes(index)[1]


# ------------------------------------------------------------------------------------- a hivemind peer


def hivemind_peer(args: argparse.Namespace) -> int:
    """One hivemind.Optimizer peer, training for ``args.seconds``; JSON lines of evals to ``args.log``."""
    import hivemind
    import torch
    from transformers import get_constant_schedule_with_warmup

    from p2p_diloco.build import build_local
    from p2p_diloco.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, RunConfig, TrainConfig
    from p2p_diloco.trainer import evaluate_model

    torch.set_num_threads(1)
    cfg = TrainConfig(model=ModelConfig(MODEL, seq_len=SEQ_LEN), data=DataConfig(eval_batches=EVAL_BATCHES),
                      inner=InnerConfig(batch_size=BATCH, lr=INNER_LR, warmup_steps=WARMUP, device="cpu"),
                      outer=OuterConfig(local_steps=H), run=RunConfig(run_id="vs-hivemind", eval_every=1))
    local = build_local(cfg, peer_id=args.name)
    model = local.model
    dht = hivemind.DHT(initial_peers=[args.initial_peers], host_maddrs=[f"/ip4/{args.host}/tcp/0"], start=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    local_updates = args.mode == "local"

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=INNER_LR, betas=(0.9, 0.95))

    opt = hivemind.Optimizer(
        dht=dht, run_id=f"vs-hivemind-{args.mode}", target_batch_size=args.peers * H * BATCH,
        batch_size_per_step=BATCH, optimizer=adamw, params=groups, use_local_updates=local_updates,
        # the gradient mode steps once per target batch: its warm-up counts epochs (one epoch = H local steps)
        scheduler=None if local_updates else (lambda o: get_constant_schedule_with_warmup(o, max(1, WARMUP // H))),
        matchmaking_time=args.matchmaking_s, averaging_timeout=args.averaging_timeout_s,
        # its status lines (epoch steps, "Peer is out of sync", state downloads) go to the peer's .out file:
        # a side that stalls says why there (one quiet-machine run stalled after 20 steps)
        verbose=True)
    # local updates: the inner AdamW steps every batch, so its warm-up counts batches, as on p2p_diloco's side
    schedule = (get_constant_schedule_with_warmup(opt.state_averager.optimizer, WARMUP) if local_updates else None)
    log = open(args.log, "a")
    # the clock starts where run_peer writes its "start" event: model built, DHT and averager up
    began = time.time()

    def write(**fields: Any) -> None:
        log.write(json.dumps(dict(time=time.time(), **fields)) + "\n")
        log.flush()

    write(event="start", t=time.time() - began)
    steps = tokens = 0
    busy = 0.0
    initial = evaluate_model(model, local.eval_batches, torch.device("cpu"), None)
    write(event="eval", t=time.time() - began, tokens=0, steps=0, eval_loss=initial, epoch=opt.local_epoch)
    while time.time() - began < args.seconds:
        batch = local.stream.next_batch()
        t0 = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule.step()
        step_s = time.perf_counter() - t0
        busy += step_s
        steps, tokens = steps + 1, tokens + batch.numel()
        # one line per step: where a side's time goes (an epoch step, a state download) shows in its timings
        write(event="step", t=time.time() - began, steps=steps, epoch=opt.local_epoch, step_s=step_s)
        if steps % H == 0:
            eval_loss = evaluate_model(model, local.eval_batches, torch.device("cpu"), None)
            write(event="eval", t=time.time() - began, tokens=tokens, steps=steps, eval_loss=eval_loss,
                  epoch=opt.local_epoch, busy_s=busy)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    write(event="end", t=time.time() - began, tokens=tokens, steps=steps, busy_s=busy, params_sha256=digest,
          epoch=opt.local_epoch)
    log.close()
    opt.shutdown()
    dht.shutdown()
    return 0


# -------------------------------------------------------------------------------------------- the sides


def run_hivemind(mode: str, peers: int, seconds: float, work: Path, matchmaking_s: float,
                 averaging_timeout_s: float, hosts: Hosts) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    # the same bootstrap node as p2p_diloco's side, so that every peer starts at once: a peer that starts
    # late finds the others epochs ahead and spends its steps downloading their state
    boot = _bootstrap(work, hosts)
    procs = []
    try:
        maddr = hosts.bootstrap_maddr(work / "bootstrap.out", boot)
        for i in range(peers):
            argv = [sys.executable, "-m", "benchmarks.vs_hivemind", "peer", "--mode", mode, "--name", f"hm{i}",
                    "--peers", str(peers), "--seconds", str(seconds), "--log", str(work / f"hm{i}.jsonl"),
                    "--initial-peers", maddr, "--matchmaking-s", str(matchmaking_s),
                    "--averaging-timeout-s", str(averaging_timeout_s), "--host", hosts.address(i + 1)]
            procs.append(hosts.popen(i + 1, argv, stdout=open(work / f"hm{i}.out", "w"), stderr=subprocess.STDOUT,
                                     env=_env(), cwd=ROOT))
        codes = [_wait(p, seconds + 600) for p in procs]
        sent = [hosts.bytes_sent(i + 1) for i in range(peers)]
    finally:
        for proc in (*procs, boot):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    per_peer = []
    for i in range(peers):
        rows = _rows(work / f"hm{i}.jsonl")
        evals = [r for r in rows if r["event"] == "eval"]
        end = next((r for r in rows if r["event"] == "end"), {})
        per_peer.append(dict(curve=[(r["t"], r["tokens"], r["eval_loss"]) for r in evals], steps=end.get("steps"),
                             utilization=end["busy_s"] / end["t"] if end.get("t") else None,
                             params_sha256=end.get("params_sha256"), epoch=end.get("epoch"),
                             bytes_sent=sent[i]))
    return dict(side=f"hm-{mode}", exit_codes=codes, peers=per_peer,
                settings=dict(matchmaking_time=matchmaking_s, averaging_timeout=averaging_timeout_s,
                              target_batch_size=peers * H * BATCH))


def p2p_peer_argv(maddr: str, run_id: str, log: Path, host: str = "127.0.0.1",
                  extra: tuple[str, ...] = ()) -> list[str]:
    """``run_peer`` at its defaults with this benchmark's model, data and evaluation settings (also used by
    ``benchmarks/peer_cpu.py``)."""
    return [sys.executable, "-m", "p2p_diloco.cli.run_peer", "--host-maddrs", f"/ip4/{host}/tcp/0",
            "--use-relay", "false", "--initial-peers", maddr, "--run-id", run_id, "--model", MODEL,
            "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--inner-lr", str(INNER_LR),
            "--warmup-steps", str(WARMUP), "--local-steps", str(H), "--eval-batches", str(EVAL_BATCHES),
            "--eval-every", "1", "--log-file", str(log), *extra]


def run_p2p(peers: int, seconds: float, work: Path, hosts: Hosts, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    boot = _bootstrap(work, hosts)
    procs = []
    try:
        maddr = hosts.bootstrap_maddr(work / "bootstrap.out", boot)
        for i in range(peers):
            procs.append(hosts.popen(
                i + 1, p2p_peer_argv(maddr, "vs-hivemind", work / f"p{i}.jsonl", hosts.address(i + 1), extra),
                stdout=open(work / f"p{i}.out", "w"), stderr=subprocess.STDOUT, env=_env(), cwd=ROOT))
        # each peer trains for `seconds` from its own start event, then stops as on Ctrl+C
        deadline = time.monotonic() + seconds + 600
        stopped: set[int] = set()
        while len(stopped) < peers and time.monotonic() < deadline:
            for i, proc in enumerate(procs):
                start = next((r for r in _rows(work / f"p{i}.jsonl") if r["event"] == "start"), None)
                if i not in stopped and (proc.poll() is not None or (start and time.time() - start["time"] >= seconds)):
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGINT)
                    stopped.add(i)
            time.sleep(0.5)
        codes = [_wait(p, 120) for p in procs]
        sent = [hosts.bytes_sent(i + 1) for i in range(peers)]
    finally:
        for proc in (*procs, boot):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    per_peer = []
    for i in range(peers):
        rows = _rows(work / f"p{i}.jsonl")
        start = next(r for r in rows if r["event"] == "start")
        t0 = start["time"]
        first = next((r for r in rows if r["event"] == "eval"), None)
        rounds = [r for r in rows if r["event"] == "round"]
        curve = ([(first["time"] - t0, 0, first["eval_loss"])] if first else [])
        tokens = 0
        for r in rounds:
            tokens += r["inner_steps"] * BATCH * SEQ_LEN
            if r.get("eval_loss") is not None and r["time"] - t0 <= seconds:
                curve.append((r["time"] - t0, tokens, r["eval_loss"]))
        wall = (rounds[-1]["time"] - t0) if rounds else None
        per_peer.append(dict(curve=curve, steps=sum(r["inner_steps"] for r in rounds),
                             utilization=sum(r["inner_seconds"] for r in rounds) / wall if wall else None,
                             params_sha256=rounds[-1]["params_sha256"] if rounds else None,
                             epoch=rounds[-1]["new_epoch"] if rounds else None,
                             # the link's count on the testbed; on loopback, what the round log says it sent
                             bytes_sent=sent[i] if sent[i] is not None else sum(r["bytes_sent"] for r in rounds),
                             sha_by_epoch={r["new_epoch"]: r["params_sha256"] for r in rounds},
                             outer=start["config"]["outer"]["choice"],
                             outcomes=[r["outcome"] for r in rounds]))
    return dict(side="p2p" + (" " + " ".join(extra) if extra else ""), exit_codes=codes, peers=per_peer,
                settings=dict(defaults=not extra, extra=list(extra)))


def _bootstrap(work: Path, hosts: Hosts) -> subprocess.Popen:
    """A DHT node for one side's peers to meet at (p2p_diloco's bootstrap, a plain hivemind DHT node)."""
    return hosts.popen(0, [sys.executable, "-m", "p2p_diloco.cli.run_bootstrap", "--identity-path",
                           str(work / "bootstrap.id"), "--host-maddrs", f"/ip4/{hosts.address(0)}/tcp/0",
                           "--use-relay", "false"],
                       stdout=open(work / "bootstrap.out", "w"), stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        return proc.wait(timeout=60)


def _rows(path: Path) -> list[dict[str, Any]]:
    return read_records(path)  # the hivemind side's log has the same shape: one JSON object per line


# ---------------------------------------------------------------------------------------------- summary


def summarize(sides: list[dict[str, Any]]) -> dict[str, Any]:
    def final(side: dict[str, Any]) -> float:
        return statistics.fmean(p["curve"][-1][2] for p in side["peers"] if p["curve"])

    finals = {s["side"]: final(s) for s in sides}
    target = max(min(pt[2] for p in s["peers"] for pt in p["curve"]) for s in sides)  # the worst side's best

    def reach(side: dict[str, Any], loss_to_reach: float | None = None) -> float | None:
        """When the side's last peer first scored ``loss_to_reach`` (the common loss by default), or None."""
        goal = target if loss_to_reach is None else loss_to_reach
        times = [next((t for t, _, loss in p["curve"] if loss <= goal), None) for p in side["peers"]]
        return max(times) if times and all(t is not None for t in times) else None

    def identical(side: dict[str, Any]) -> bool:
        # p2p_diloco's peers are stopped mid-round at different epochs: compare the last epoch they all reached
        if all("sha_by_epoch" in p for p in side["peers"]):
            common = set.intersection(*(set(p["sha_by_epoch"]) for p in side["peers"]))
            return bool(common) and len({p["sha_by_epoch"][max(common)] for p in side["peers"]}) == 1
        return len({p["params_sha256"] for p in side["peers"]}) == 1

    return dict(
        final_eval_loss=finals, common_loss=target, seconds_to_common_loss={s["side"]: reach(s) for s in sides},
        # {whose final loss: {side: seconds to reach it}}: "time to hivemind's final loss" for every side
        seconds_to_final_loss_of={a["side"]: {b["side"]: reach(b, finals[a["side"]]) for b in sides} for a in sides},
        steps_per_peer={s["side"]: statistics.fmean(p["steps"] or 0 for p in s["peers"]) for s in sides},
        utilization={s["side"]: statistics.fmean(p["utilization"] or 0 for p in s["peers"]) for s in sides},
        identical_params={s["side"]: identical(s) for s in sides},
        bytes_sent_per_peer={s["side"]: (statistics.fmean(p["bytes_sent"] for p in s["peers"])
                                         if all(p["bytes_sent"] is not None for p in s["peers"]) else None)
                             for s in sides})


def plot(sides: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, side in enumerate(sides):
        for j, peer in enumerate(side["peers"]):
            if not peer["curve"]:
                continue
            t, tokens, loss = zip(*peer["curve"], strict=True)
            label = side["side"] if j == 0 else None
            axes[0].plot(t, loss, color=f"C{i}", alpha=0.8, label=label)
            axes[1].plot([x / 1e6 for x in tokens], loss, color=f"C{i}", alpha=0.8, label=label)
    axes[0].set_xlabel("wall-clock seconds (each peer from its start)")
    axes[1].set_xlabel("tokens trained by the peer (millions)")
    for ax in axes:
        ax.set_ylabel("eval loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.vs_hivemind", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    p = sub.add_parser("peer", help="(internal) one hivemind.Optimizer peer")
    p.add_argument("--mode", choices=["local", "grad"], required=True)
    for name in ("--name", "--log", "--initial-peers"):
        p.add_argument(name, required=True)
    p.add_argument("--peers", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--matchmaking-s", type=float, default=15.0)
    p.add_argument("--averaging-timeout-s", type=float, default=60.0)
    p.add_argument("--host", default="127.0.0.1", help="the address its DHT listens on")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--sides", default="p2p,hm-local,hm-grad")
    parser.add_argument("--hm-matchmaking-s", type=float, default=15.0)
    parser.add_argument("--quick", action="store_true", help="2 peers, 90 s per side: checks the script")
    parser.add_argument("--p2p-extra", default="",
                        help="run_peer flags for the p2p side, e.g. '--overlap eager' (its side is then named so)")
    parser.add_argument("--rate-mbit", type=float, default=None,
                        help="run each side on the namespace testbed, every link limited to this rate both ways "
                             "(needs root, iproute2); default: loopback")
    parser.add_argument("--out", type=Path, default=RESULTS / "vs_hivemind.json")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="keep every peer's logs here (default: a temporary folder, removed at the end)")
    args = parser.parse_args(argv)
    if args.cmd == "peer":
        return hivemind_peer(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.quick:
        args.peers, args.seconds = 2, 90.0
    sides = []
    with tempfile.TemporaryDirectory(prefix="vs_hivemind_") as tmp_dir:
        tmp = args.work_dir or Path(tmp_dir)
        for side in args.sides.split(","):
            logging.info("side %s: %d peers, %.0f s", side, args.peers, args.seconds)
            load_before = os.getloadavg()
            if side not in ("p2p", "hm-local", "hm-grad"):
                parser.error(f"--sides: unknown side {side!r}")
            with contextlib.ExitStack() as stack:
                hosts = Hosts()
                if args.rate_mbit is not None:
                    from benchmarks.testbed import Testbed

                    # a fresh testbed per side: its links' byte counts start at zero
                    hosts = Hosts(stack.enter_context(Testbed(args.peers + 1, args.rate_mbit,
                                                              prefix=f"vh{os.getpid()}x")))
                if side == "p2p":
                    sides.append(run_p2p(args.peers, args.seconds, Path(tmp) / side, hosts,
                                         tuple(args.p2p_extra.split())))
                else:
                    sides.append(run_hivemind(side.removeprefix("hm-"), args.peers, args.seconds, Path(tmp) / side,
                                              args.hm_matchmaking_s, 60.0, hosts))
            # the peers share the machine's cores with whatever else runs: the load goes beside every number
            sides[-1]["load_average"] = dict(before_1m=load_before[0], after_1m=os.getloadavg()[0],
                                             after_5m=os.getloadavg()[1])
            logging.info("side %s: exit codes %s, load %s", side, sides[-1]["exit_codes"], sides[-1]["load_average"])
    summary = summarize(sides)
    payload = dict(quick=args.quick, peers=args.peers, seconds=args.seconds, rate_mbit=args.rate_mbit,
                   settings=dict(model=MODEL, seq_len=SEQ_LEN, batch=BATCH, inner_lr=INNER_LR, warmup=WARMUP, H=H,
                                 eval_batches=EVAL_BATCHES),
                   load_average_1m_end=os.getloadavg()[0], cores=os.cpu_count(), summary=summary, sides=sides)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    plot(sides, args.out.with_suffix(".png"))
    print(json.dumps(summary, indent=1))
    return 0 if all(c == 0 for s in sides for c in s["exit_codes"]) and not any(
        math.isnan(v) for v in summary["final_eval_loss"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
