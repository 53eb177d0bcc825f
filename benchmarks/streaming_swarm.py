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


READING = """Reading it (two runs on an otherwise idle machine, 22:30-22:34 and 23:08-23:12 UTC; the table is the second,
whose peers began once every one's record was visible). Each fragment round sends its fragment's share: 1/2 and
1/4 of DiLoCo's bytes per round at F = 2 and 4, and every setting sent 15.1 MB per peer over the rounds counted.
That burst is what Streaming DiLoCo shrinks. On this fixed link the rate while sending is capped by the link
whatever F is, and it fell with F (11.7, 11.3, 8.9 Mbit/s; the first run 12.8, 11.5, 9.4): a shorter all-reduce
spends a larger share of its time setting up. With τ = 0 each fragment round blocks training like a whole round,
and what a round costs besides its bytes (matchmaking, the group's set-up and completion check) is paid F times
per H steps: training was blocked 3.80 s per 40 steps with DiLoCo, 5.09 s at F = 2 and 6.05 s at F = 4 (first
run: 3.71, 4.82, 5.91), so utilization fell (44.2%, 35.0%, 34.5%; first run 43.7%, 38.0%, 34.8%; 40 tiny steps
take about 3 s, so every setting here is bound by the network). So in the swarm today fragments trade compute
for a smaller burst: use them where the burst itself is the problem (a router or uplink that drops or stalls
under a long saturating transfer, other traffic that must get through), not to train faster, unless each
fragment's all-reduce overlaps the next τ steps (next section: 97.4% at τ = H / 2F with 400-step phases). Two
runs in another session (04:01 UTC with two stray processes using about one core, and 08:31 UTC, idle; peers
then began after a fixed 4 s) measured 3.35, 4.08, 5.73 and 3.26, 5.16, 5.80 s blocked, and 47.9%, 42.4%,
40.1% in the idle one: the ordering holds in all four runs, while a figure moves by up to 1.1 s of blocking and
7.4 points of utilization between runs and machines. What made the other session's utilization higher was not
looked into."""

READING_OVERLAP = """Reading it (the run of 2026-11-28 22:44-22:57 UTC, on an otherwise idle machine; phases of 400 steps, as
the eager measurement above, so each fragment phase is 100 steps, about 9 s of tiny steps on a core shared by
two peers). A blocking DiLoCo round took 6.3 s of every 40 s from training (83.7%); eager hid it (99.8%). Four
fragments at τ = 0 blocked longest (12.7 s per H: four rounds' set-up, each about 1 s of matchmaking and
completion beside a 2.2 s all-reduce): 73.7%. With τ = 50 steps (half a fragment phase, about 4.5 s) each
fragment's round ran behind the next 50 steps and the training thread waited 0-2.7 s at a merge (median 0.2 s;
0.78 s per H): 97.4%, every round a group of all 4, matched in 0.2-3.3 s. With τ = 100 (= H / F: the sync at
the phase's start) the training thread seldom waited (97.4%; no wait in most rounds, one of 15.6 s), but
nothing held the peers together either: steady rounds took a median 5.0 s to match (up to 10.6 s, one 22 s) as
the peers' phases drifted apart; from the 7th round groups of 2 and 3 formed, peer 4 resynced three rounds in
a row and peers 2 and 3 once each, and only 2 of the 8 steady rounds had all 4 (each phase ends where its own
exchange lands, so a peer that is late stays late). So in the swarm choose τ at about half of H / F: it hides
most of the round, and the wait at the merge keeps the peers in step. One run per setting; a run in another
session (11:44-12:07 UTC) measured 82.4%, 99.7%, 70.7%, 96.7% and 99.3% with 1 of 8 steady rounds of all 4 at
τ = 100: the same ordering and the same reading."""

READING_TAU = """Reading it (two runs, 22:36-22:43 and 23:12-23:18 UTC, on an otherwise idle machine, same testbed and flags
as the τ = 0 table two sections up, whose DiLoCo, F = 2 and F = 4 rows it completes; the table is the second).
These phases are short (H / F = 20 or 10 steps, 1.5 or 0.75 s of tiny steps), so τ = H / 2F hides only part of
a round: training was still blocked 5.06 s per H at F = 2 (both runs) and 5.95 s at F = 4 (first run 6.42),
against 4.82-5.09 and 5.91-6.05 s at τ = 0, and utilization rose only a little: 41.5% and 36.1% (first run
41.2% and 36.5%) against 35.0-38.0% and 34.5-34.8% at τ = 0 and 43.7-44.2% for DiLoCo. Each round's bytes and
set-up take longer than τ steps. With the sparse codec (topk-sign, error feedback) a round sends about 1/128 of
fp32 (38,860 bytes against 4,960,360) and a fragment round 10,243 bytes, so the set-up is nearly all that is
left: DiLoCo blocked 0.86 s per H (75.2%; first run 0.93 s, 75.0%), four fragments 1.66 s at τ = 0 (61.8%;
first run 2.50 s, 63.8%) and 1.66 s at τ = 5 (66.5%; first run 2.04 s, 67.7%). With a codec this small,
fragments lower a burst that was already small and pay four set-ups; use them at fp32 or at the low-bit codecs,
where the burst is what hurts."""

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
    for axes in (left, right):  # names such as "F=4, τ=100" overlap when level
        axes.tick_params(axis="x", labelrotation=25)
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
