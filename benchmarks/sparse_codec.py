"""The sparse codec against none and 4bit in the simulator: final eval loss and bytes per peer per round.

Runs ``python -m p2p_diloco.simulate`` (diloco mode, tiny preset, 4 workers, H = 10, 6 rounds (``--rounds``), batch 4 x 64,
outer lr 1 and momentum 0: a short run that a shared 2-core machine finishes in minutes) once per codec and seed, through the same core code the swarm
runs (codec, error feedback, the reducers' reply codec), and writes ``results/sparse_codec.json`` and the
``sparse-codec`` section of BENCHMARKS.md::

    python benchmarks/sparse_codec.py --seeds 0              # runs every codec (minutes each on a CPU)
    python benchmarks/sparse_codec.py --rounds 20            # a longer horizon; each horizon keeps its table
    python benchmarks/sparse_codec.py --reuse DIR --seeds 0  # reads DIR/{label}_s{seed}.json written by
                                                             # `python -m p2p_diloco.simulate ... --json`
                                                             # with the same settings (missing labels skipped)

Bytes are the simulator's count of what each peer sends (its parts and, as a reducer, its share of the
replies), per round; a peer receives as much.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

from benchmarks.report import replace_section

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = {
    "none": ["--compression", "none"],
    "4bit": ["--compression", "4bit"],
    "topk_ef095": ["--compression", "topk", "--error-feedback", "--error-feedback-decay", "0.95"],
    "topk_ef1": ["--compression", "topk", "--error-feedback", "--error-feedback-decay", "1"],
    "topk256_ef095": ["--compression", "topk", "--topk-k", "256", "--error-feedback", "--error-feedback-decay", "0.95"],
}
LABELS = {"none": "none", "4bit": "4bit", "topk_ef095": "topk 64/4096 + error feedback 0.95",
          "topk_ef1": "topk 64/4096 + error feedback 1.0", "topk256_ef095": "topk 256/4096 + error feedback 0.95"}
BASE = ["--mode", "diloco", "--workers", "4", "--local-steps", "10", "--batch-size", "4", "--seq-len", "64",
        "--eval-batches", "2"]


def _run(label: str, seed: int, rounds: int) -> dict:
    from p2p_diloco.simulate.__main__ import main

    out = RESULTS / f"sparse_codec_{label}_r{rounds}_s{seed}.json"
    code = main([*BASE, "--rounds", str(rounds), *RUNS[label], "--seed", str(seed), "--json", str(out)])
    if code:
        raise SystemExit(f"simulator run {label} seed {seed} failed with {code}")
    return json.loads(out.read_text())


def report(rows: dict[str, list[dict]], rounds: int) -> list[str]:
    none = rows["none"]
    fp32_per_round = none[0]["total_bytes_sent_per_worker"] / len(none[0]["rounds"])
    base_loss = sum(r["final_eval_loss"] for r in none) / len(none)
    lines = [
        f"### {rounds} rounds",
        "",
        f"Simulator (`benchmarks/sparse_codec.py --rounds {rounds}`): diloco mode, tiny preset, 4 workers, H = 10,"
        f" {rounds} rounds, batch 4 x 64,",
        f"outer lr 1, momentum 0; seeds {sorted({r['seed'] for runs in rows.values() for r in runs})}. Bytes per peer per round"
        " both ways (its parts, and its share of the reducers' replies); a peer receives as much.",
        "",
        "| codec | final eval loss | vs none | bytes sent per peer per round | / fp32 |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, runs in rows.items():
        loss = sum(r["final_eval_loss"] for r in runs) / len(runs)
        per_round = sum(r["total_bytes_sent_per_worker"] / len(r["rounds"]) for r in runs) / len(runs)
        lines.append(f"| {LABELS[label]} | {loss:.4f} | {100 * (loss / base_loss - 1):+.2f}% | "
                     f"{per_round:,.0f} | 1/{fp32_per_round / per_round:.1f} |")
    if "topk_ef095" in rows:
        runs = rows["topk_ef095"]
        loss = sum(r["final_eval_loss"] for r in runs) / len(runs)
        ratio = fp32_per_round / (sum(r["total_bytes_sent_per_worker"] / len(r["rounds"]) for r in runs) / len(runs))
        lines += [
            "",
            "| target (issue 35) | measured (topk 64/4096, error feedback 0.95) | met |",
            "| --- | --- | --- |",
            f"| bytes sent per peer per round <= 1/100 of fp32 | 1/{ratio:.1f} | {'yes' if ratio >= 100 else 'no'} |",
            f"| final eval loss within 1% of none | {100 * (loss / base_loss - 1):+.2f}% | "
            f"{'yes' if loss <= 1.01 * base_loss else 'no'} |",
            "",
        ]
    if "topk_ef095" in rows and rounds == 6:
        lines += [
            "Why the bytes target is missed: a sender's own parts are 1/140 of fp32, but in the butterfly all-reduce",
            "each reducer sends the aggregate of its slice back to every member, and that aggregate is the union of",
            "the senders' entries (up to 4 x 64 per chunk here) with 12-bit offsets (or a bitmap) and int8 values:",
            "most of the bytes. Sending the aggregate back as its own top-k would bring both directions to about",
            "1/140, at the price of the entries it drops (not measured). Why the loss target is missed here: in",
            "6 rounds each worker sends 1.56% of its values per round, and what waits in the residual has not reached",
            "the shared parameters the next inner phase starts from; the published results are from far longer runs.",
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reuse", type=Path, help="read {label}_s{seed}.json from here instead of running")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows: dict[str, list[dict]] = {}
    for label in RUNS:
        for seed in args.seeds:
            if args.reuse:
                path = args.reuse / f"{label}_s{seed}.json"
                if not path.exists():
                    continue
                data = json.loads(path.read_text())
            else:
                data = _run(label, seed, args.rounds)
            assert math.isfinite(data["final_eval_loss"]) and len(data["rounds"]) == args.rounds, path
            rows.setdefault(label, []).append(data)
    RESULTS.mkdir(parents=True, exist_ok=True)
    store = RESULTS / "sparse_codec.json"
    horizons = json.loads(store.read_text()) if store.exists() else {}
    if "none" in horizons:  # the first format held one horizon's rows
        horizons = {"6": horizons}
    horizons[str(args.rounds)] = rows
    store.write_text(json.dumps(horizons, indent=1))
    lines = [line for key in sorted(horizons, key=int) for line in [*report(horizons[key], int(key)), ""]]
    replace_section(ROOT / "BENCHMARKS.md", "sparse-codec", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
