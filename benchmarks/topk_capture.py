"""The open-swarm default for the sparse codecs against the old one in the simulator: its cost in loss on clean
runs, and the damage one capturing sender does under each (issue 51, finding 3).

Old default: ``--aggregation mean`` and ``--error-feedback-decay 1.0``. New default in an open swarm with a
sparse codec: ``centered-clip`` (``core.robust.default_aggregation``) and decay 0.95
(``OuterConfig.error_feedback_decay``). Both with ``--compression topk --error-feedback`` and the reply's
leftovers credited, through ``python -m p2p_diloco.simulate`` (diloco mode, tiny preset, 4 workers, H = 10,
batch 4 x 64, the outer defaults). The attacker is worker 3 sending its decoded part times ``--attack-scale``
(default -5: inverted, 5x an honest part's norm, under the 20x norm screen)::

    python benchmarks/topk_capture.py --seeds 0 1 --rounds 20

Writes ``results/topk_capture.json`` (every run's final eval loss and bans) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SPARSE = ["--compression", "topk", "--error-feedback", "--credit-undelivered"]
DEFAULTS = {
    "old": ["--aggregation", "mean", "--error-feedback-decay", "1.0"],
    "new": ["--aggregation", "centered-clip", "--error-feedback-decay", "0.95"],
    "mean_ef095": ["--aggregation", "mean", "--error-feedback-decay", "0.95"],
    "cclip_ef1": ["--aggregation", "centered-clip", "--error-feedback-decay", "1.0"],
}
LABELS = {"old": "old default: mean, EF decay 1.0", "new": "new open default: centered-clip, EF decay 0.95",
          "mean_ef095": "mean, EF decay 0.95", "cclip_ef1": "centered-clip, EF decay 1.0"}
BASE = ["--mode", "diloco", "--workers", "4", "--local-steps", "10", "--batch-size", "4", "--seq-len", "64",
        "--eval-batches", "2"]


def _run(label: str, attack: float | None, seed: int, rounds: int) -> dict:
    from p2p_diloco.simulate.__main__ import main

    tag = "clean" if attack is None else f"attack{attack:g}"
    out = RESULTS / "topk_capture" / f"{label}_{tag}_r{rounds}_s{seed}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        extra = [] if attack is None else ["--byzantine", f"3={attack}"]
        code = main([*BASE, "--rounds", str(rounds), *SPARSE, *DEFAULTS[label], *extra, "--seed", str(seed),
                     "--json", str(out)])
        if code:
            raise SystemExit(f"simulator run {label} {tag} seed {seed} failed with {code}")
    data = json.loads(out.read_text())
    return {"label": label, "attack": attack, "seed": seed, "rounds": rounds,
            "final_eval_loss": data["final_eval_loss"], "bans": data.get("bans", [])}


def table(runs: list[dict]) -> list[str]:
    """Mean final eval loss per default and case over its seeds, and the change against the old default's clean
    runs of the same seeds (paired: seeds differ by more than the rules do)."""
    def losses(label: str, attack: float | None) -> dict[int, float]:
        return {r["seed"]: r["final_eval_loss"] for r in runs if r["label"] == label and r["attack"] == attack}

    base = losses("old", None)
    attacks = sorted({r["attack"] for r in runs if r["attack"] is not None})
    head = "| aggregation, EF decay | seeds | clean | vs old, same seeds |" + "".join(
        f" attacker x{a:g} |" for a in attacks)
    lines = [head, "|" + " --- |" * (4 + len(attacks))]
    for label in DEFAULTS:
        clean = losses(label, None)
        if not clean:
            continue
        paired = [100 * (clean[s] / base[s] - 1) for s in sorted(clean) if s in base]
        cells = [",".join(map(str, sorted(clean))), f"{statistics.fmean(clean.values()):.4f}",
                 f"{statistics.fmean(paired):+.2f}% ({', '.join(f'{p:+.2f}' for p in paired)})" if paired else "-"]
        for a in attacks:
            hit = losses(label, a)
            cells.append(f"{statistics.fmean(hit.values()):.4f} (seeds {','.join(map(str, sorted(hit)))})"
                         if hit else "-")
        lines.append(f"| {LABELS[label]} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--attack-scale", type=float, default=-5.0)
    parser.add_argument("--labels", nargs="+", default=["old", "new"], choices=list(DEFAULTS))
    parser.add_argument("--no-attack", action="store_true", help="clean runs only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    runs = []
    for seed in args.seeds:
        for label in args.labels:
            for attack in [None] + ([] if args.no_attack else [args.attack_scale]):
                runs.append(_run(label, attack, seed, args.rounds))
                logging.warning("%s", runs[-1])
    out = RESULTS / "topk_capture.json"
    previous = json.loads(out.read_text()) if out.exists() else []
    keep = [r for r in previous if (r["label"], r["attack"], r["seed"], r["rounds"]) not in
            {(n["label"], n["attack"], n["seed"], n["rounds"]) for n in runs}]
    out.write_text(json.dumps(keep + runs, indent=1) + "\n")
    print("\n".join(table([r for r in keep + runs if r["rounds"] == args.rounds])))
    plot(RESULTS / "topk_capture", RESULTS / "topk_capture.png")
    return 0


def plot(folder: Path, path: Path, rounds: int = 20, seed: int = 0) -> None:
    """Eval loss against rounds of every run of ``rounds`` rounds and ``seed`` kept in ``folder``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in sorted(folder.glob(f"*_r{rounds}_s{seed}.json")):
        record = json.loads(run.read_text())
        xs = [0] + [r["round"] for r in record["rounds"]]
        ys = [record["initial_eval_loss"]] + [r["eval_loss"] for r in record["rounds"]]
        ax.plot(xs, ys, label=run.stem.removesuffix(f"_r{rounds}_s{seed}"),
                linestyle="--" if "attack" in run.stem else "-")
    ax.set_xlabel("round")
    ax.set_ylabel("eval loss")
    ax.set_yscale("log")
    ax.set_title(f"Top-k, one sender x-5 (dashed) or none; tiny, 4 workers, H = 10, seed {seed}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
