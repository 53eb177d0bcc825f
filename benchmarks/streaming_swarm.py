"""Streaming DiLoCo against DiLoCo in a real swarm on the namespace testbed: bytes and time per round, compute
utilization, at a fixed link rate.

    sudo .venv/bin/python -m benchmarks.streaming_swarm              # F = 1, 2, 4; writes the JSON and BENCHMARKS.md
    .venv/bin/python -m benchmarks.streaming_swarm --report-only     # table and plot from results/streaming_swarm.json
    # long phases, the overlaps side by side (eager, and fragments with τ > 0):
    sudo .venv/bin/python -m benchmarks.streaming_swarm --name streaming_swarm_overlap --rate 10 \
        --local-steps 400 --rounds 3 --settings diloco eager F4 F4t100

Each case starts a bootstrap and 4 ``run_peer`` processes in network namespaces whose links are limited to
``--rate`` Mbit/s each way (``benchmarks/testbed.py``: veth pairs and ``tc tbf``), the tiny preset, fp32,
``--local-steps H`` and ``--fragments F``, for the same inner steps per peer in every case (R whole rounds: R·F
fragment rounds). Read from the peers' run logs, rounds of all 4 after the first F (start-up) only:

- **bytes per round**: what a peer sent in one fragment round (``bytes_sent``: the all-reduce's payload), and
  its all-reduce's seconds. Their ratio is the rate a peer sends at while it sends, which the link caps: on a
  fixed link, fragments send the same rate for 1/F of the time, so what falls is the burst, not its rate;
- **mean bytes per second**: everything a peer sent over the wall time of those rounds;
- **compute utilization**: inner-phase seconds over wall seconds between round ends (median over peers and
  rounds): the time a blocking round takes from training is what fragments shorten.

The simulator's peak and loss for the same settings are in BENCHMARKS.md "Streaming DiLoCo".
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.perf_swarm import PEER_BASE, fresh, read_log
from benchmarks.report import replace_section
from benchmarks.testbed import Testbed, start_swarm, wait_peers

logger = logging.getLogger("streaming_swarm")
ROOT = Path(__file__).resolve().parents[1]
STORE = ROOT / "benchmarks" / "results" / "streaming_swarm.json"
PEERS = 4


SETTING = re.compile(r"^(diloco|eager|F(\d+)(?:t(\d+))?)(?:\+(topk-sign))?$")
"""A case: ``diloco`` (F = 1), ``eager`` (F = 1, ``--overlap eager``), ``F4`` (4 fragments, τ = 0), ``F4t100``
(4 fragments, ``--fragment-delay 100``); ``+topk-sign`` sends with the smallest codec (error feedback on, as the
simulator's streaming benchmark runs it), else fp32."""
CODECS = {"fp32": [], "topk-sign": ["--compression", "topk-sign", "--error-feedback", "--error-feedback-decay", "0.95"]}


def parse_setting(text: str) -> tuple[int, int, bool, str]:
    """``(fragments, delay, eager, codec)`` of a setting (:data:`SETTING`); ``ValueError`` for anything else."""
    match = SETTING.match(text)
    if match is None:
        raise ValueError(f"setting {text!r}: use diloco, eager, F<fragments> or F<fragments>t<delay>, "
                         "optionally with +topk-sign")
    codec = match.group(4) or "fp32"
    if match.group(1) in ("diloco", "eager"):
        return 1, 0, match.group(1) == "eager", codec
    return int(match.group(2)), int(match.group(3) or 0), False, codec


def label(case: dict[str, Any]) -> str:
    """How a case is named in the table (runs stored before settings had names: by their F)."""
    if "setting" not in case:
        return "DiLoCo" if case["fragments"] == 1 else f"F={case['fragments']}, τ=0"
    fragments, delay, eager, codec = parse_setting(case["setting"])
    name = "eager" if eager else "DiLoCo" if fragments == 1 else f"F={fragments}, τ={delay}"
    return name if codec == "fp32" else f"{name}, {codec}"


def _case(setting: str, rate: float, steps: int, rounds: int) -> dict[str, Any]:
    fragments, delay, eager, codec = parse_setting(setting)
    out = fresh(f"stream-{setting.replace('+', '-')}")
    args = [*PEER_BASE, "--run-id", f"stream-{setting.replace('+', '-')}", "--local-steps", str(steps), "--min-local-steps",
            str(steps), "--max-rounds", str(rounds * fragments), "--eval-every", "0", "--fragments", str(fragments),
            "--fragment-delay", str(delay), "--overlap", "eager" if eager else "none", *CODECS[codec],
            "--matchmaking-time-s", "5", "--matchmaking-timeout-s", "60", "--request-timeout-s", "4"]
    # every peer from epoch 0 together: the first one up must not apply rounds alone (the fault start_together:
    # each begins once it sees every peer's progress record)
    together = {i: {"P2P_DILOCO_FAULTS": f"start_together@0={PEERS}"} for i in range(1, PEERS + 1)}
    began = time.time()
    with Testbed(PEERS + 1, rate) as bed:
        procs = start_swarm(bed, out, PEERS, args, peer_env=together)
        codes = wait_peers(procs, 900)
    return dict(setting=setting, fragments=fragments, codes=codes, peers=read_case(out, fragments, began))


def read_case(out: Path, fragments: int, began: float) -> list[dict[str, Any]]:
    """Each peer's figures from its run log in ``out`` (see the module docstring)."""
    peers = []
    for i in range(1, PEERS + 1):
        rows = read_log(out / f"peer{i}.jsonl")
        start = read_log(out / f"peer{i}.jsonl", "start")
        t0 = start[0]["time"] if start else began
        times = [t0] + [r["time"] for r in rows]
        steady = [(r, t1 - t0_) for r, t0_, t1 in zip(rows, times, times[1:], strict=False)][fragments:]
        full = [(r, wall) for r, wall in steady if r["outcome"] == "averaged" and r["group_size"] == PEERS]
        # the steady part: from the end of the first F rounds (start-up, and the start-together slow steps) on
        sent = sum(r.get("bytes_sent") or 0 for r, _ in steady)
        wall = rows[-1]["time"] - rows[fragments - 1]["time"] if len(rows) > fragments else float("nan")
        peers.append(dict(
            outcomes=[r["outcome"] for r in rows],
            bytes_per_round=[r["bytes_sent"] for r, _ in full],
            allreduce_s=[r["allreduce_seconds"] for r, _ in full],
            blocked_s=[r["blocked_seconds"] for r, _ in steady],
            utilization=[r["inner_seconds"] / w for r, w in steady if w > 0],
            sent=sent, wall_s=wall))
    return peers


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(data: dict[str, Any]) -> list[str]:
    lines = [f"Swarm (`benchmarks/streaming_swarm.py`): {PEERS} `run_peer` processes on the namespace testbed, "
             f"{data['rate_mbit']:g} Mbit/s per link each way, tiny preset (837k parameters; fp32 unless the setting "
             f"names a codec), H = "
             f"{data['local_steps']}, {data['rounds']} whole rounds of inner steps per peer (R·F fragment rounds); "
             f"rounds of all {PEERS} after the first F. Run of {data['when']}. Plot: "
             f"`benchmarks/results/{data.get('name', 'streaming_swarm')}.png`.", "",
             "| setting | rounds of all 4 (of R·F per peer) | bytes sent per round per peer | all-reduce s per round | "
             "rate while sending (Mbit/s) | mean bytes/s per peer | training blocked per H steps (s) | "
             "compute utilization |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for case in data["cases"]:
        peers = case["peers"]
        per_round = [b for p in peers for b in p["bytes_per_round"]]
        seconds = [s for p in peers for s in p["allreduce_s"]]
        rates = [b * 8 / s / 1e6 for p in peers for b, s in zip(p["bytes_per_round"], p["allreduce_s"], strict=True)
                 if s > 0]
        mean_rate = _median([p["sent"] / p["wall_s"] for p in peers if p["wall_s"] > 0])
        util = _median([u for p in peers for u in p["utilization"]])
        blocked = _median([b for p in peers for b in p.get("blocked_s", [])]) * case["fragments"]
        name = label(case)
        full = _median([len(p["bytes_per_round"]) for p in peers])
        lines.append(f"| {name} | {full:g} of {data['rounds'] * case['fragments']} | {_median(per_round):,.0f} | "
                     f"{_median(seconds):.2f} | {_median(rates):.1f} | {mean_rate:,.0f} | {blocked:.2f} | {util:.1%} |")
    lines += ["", READINGS.get(data.get("name", "streaming_swarm"), "")]
    return lines


READING = """Reading it (the run of 2026-11-28 08:31 UTC, on an otherwise idle machine). Each fragment round sends
its fragment's share: 1/2 and 1/4 of DiLoCo's bytes per round at F = 2 and 4, and every setting sent 14.8-15.5 MB
per peer over the rounds counted. That burst is what Streaming DiLoCo shrinks. On this fixed link the rate
while sending is capped by the link whatever F is, and it fell with F (13.9, 11.7, 9.4 Mbit/s): a shorter
all-reduce spends a larger share of its time setting up. With τ = 0 each fragment round blocks training like a
whole round, and what a round costs besides its bytes (matchmaking, the group's set-up and completion check)
is paid F times per H steps: training was blocked 3.26 s per 40 steps with DiLoCo, 5.16 s at F = 2 and 5.80 s
at F = 4, so utilization fell (47.9%, 42.4%, 40.1%; 40 tiny steps take about 3 s, so every setting here is
bound by the network). So in the swarm today fragments trade compute for a smaller burst: use them where the
burst itself is the problem (a router or uplink that drops or stalls under a long saturating transfer, other
traffic that must get through), not to train faster, unless each fragment's all-reduce overlaps the next τ
steps (next section: 96.7% at τ = H / 2F with 400-step phases). An earlier run (04:01 UTC, with two stray
processes using about one core) measured 3.35, 4.08 and 5.73 s blocked: the ordering holds, the F = 2 figure
moves by a second between runs."""

READING_OVERLAP = """Reading it (the run of 2026-11-28 11:44-12:07 UTC, on an otherwise idle machine; phases of 400 steps, as
the eager measurement above, so each fragment phase is 100 steps, about 9 s of tiny steps on a core shared by
two peers). A blocking DiLoCo round took 6.6 s of every 40 s from training (82.4%); eager hid it (99.7%). Four
fragments at τ = 0 blocked longest (13.8 s per H: four rounds' set-up, each about 1 s of matchmaking and
completion beside a 2.5 s all-reduce): 70.7%. With τ = 50 steps (half a fragment phase, about 4.5 s) each
fragment's round ran behind the next 50 steps and the training thread waited 0-1.5 s at a merge (1.28 s per
H): 96.7%, every round a group of all 4. With τ = 100 (= H / F: the sync at the phase's start) nothing
waited (99.3%), but nothing held the peers together either: rounds took 4-10 s to match as the peers' phases
drifted apart, peer 4 fell out of a group in the 6th round and resynced five rounds in a row, and only 1 of the
8 steady rounds had all 4 (each phase ends where its own exchange lands, so a peer that is late stays late).
So in the swarm choose τ at about half of H / F: it hides most of the round, and the wait at the merge keeps
the peers in step. Numbers are one run each; from the eager case on the run used the working tree of commit
5c87b45 (a cut peer's record proves it alive); no round of the first four cases cut a peer, so that change did
not act there."""

READING_TAU = """Reading it (the run of 2026-11-28 12:16-12:23 UTC, same testbed and flags as the τ = 0 table two sections
up, whose DiLoCo, F = 2 and F = 4 rows it completes; a 30-second unit test ran beside its first case). These
phases are short (H / F = 20 or 10 steps, 1.5 or 0.75 s of tiny steps), so τ = H / 2F hides only part of a round:
with it, training was blocked 5.13 s per H at F = 2 and 5.54 s at F = 4 (5.16 and 5.80 at τ = 0), and
utilization rose to 52.8% and 51.1% (42.4% and 40.1% at τ = 0, 47.9% DiLoCo): each round's bytes and set-up still
take longer than τ steps. With the sparse codec (topk-sign, error feedback) a round sends about 1/128 of fp32
(38,860 bytes against 4,960,360) and a fragment round 10,243 bytes, so the set-up is nearly all that is left:
DiLoCo blocked 0.96 s per H (77.1%), four fragments 2.19 s at τ = 0 (60.8%) and 2.08 s at τ = 5 (67.6%). With
a codec this small, fragments lower a burst that was already small and pay four set-ups; use them at fp32 or
at the low-bit codecs, where the burst is what hurts."""

READINGS = {"streaming_swarm": READING, "streaming_swarm_overlap": READING_OVERLAP, "streaming_swarm_tau": READING_TAU}
"""What each stored run showed, by ``--name`` (written once its numbers were seen)."""


def plot(data: dict[str, Any], path: Path) -> None:
    """Per setting: bytes a peer sends per round (the burst) and training blocked per H steps, medians."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, burst, blocked = [], [], []
    for case in data["cases"]:
        peers = case["peers"]
        names.append(label(case))
        burst.append(_median([b for p in peers for b in p["bytes_per_round"]]) / 1e6)
        blocked.append(_median([b for p in peers for b in p.get("blocked_s", [])]) * case["fragments"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.bar(names, burst, color="tab:blue")
    left.set_ylabel("MB sent per round per peer")
    left.set_title("burst")
    right.bar(names, blocked, color="tab:red")
    right.set_ylabel(f"s blocked per H = {data['local_steps']} steps")
    right.set_title("training blocked")
    fig.suptitle(f"{PEERS} peers, {data['rate_mbit']:g} Mbit/s links, tiny preset ({data['when']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=20.0, help="Mbit/s per link, each way")
    parser.add_argument("--local-steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=4, help="whole rounds of inner steps per peer")
    parser.add_argument("--settings", nargs="+", default=["diloco", "F2", "F4"],
                        help="cases: diloco, eager, F<fragments>, F<fragments>t<delay> (e.g. F4t100)")
    parser.add_argument("--name", default="streaming_swarm", help="the results' file names and BENCHMARKS.md section")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    for setting in args.settings:
        try:
            parse_setting(setting)
        except ValueError as e:
            parser.error(str(e))
    if not re.fullmatch(r"[a-z0-9_]+", args.name):
        parser.error(f"--name {args.name!r}: use lower-case letters, digits and _")
    logging.basicConfig(level=logging.INFO)
    store = STORE.with_name(f"{args.name}.json")
    if not args.report_only:
        cases = [_case(s, args.rate, args.local_steps, args.rounds) for s in args.settings]
        data = dict(name=args.name, rate_mbit=args.rate, local_steps=args.local_steps, rounds=args.rounds,
                    when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), cases=cases)
        store.write_text(json.dumps(data, indent=1))
    data = json.loads(store.read_text())
    lines = report(data)
    plot(data, store.with_suffix(".png"))
    replace_section(ROOT / "BENCHMARKS.md", args.name.replace("_", "-"), "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
