"""Live red team for the top-k capture (issue 51, finding 3): real ``run_peer`` processes on loopback, three
honest peers and one attacker built from the project's own fault hook (``byzantine@E=SCALE``: the averager
scales its pre-scaled input, which its top-k codec then encodes, so its parts are its pseudo-gradient times
SCALE, inside the 20x norm screen for |SCALE| = 5).

Each case runs the same 4 peers with ``--compression topk --error-feedback`` (chunk 1024, k 16) for
``--rounds`` rounds; the attacker sends ``SCALE`` x its pseudo-gradient in epochs ``0 .. --attack-epochs - 1``
and honestly afterwards. Cases (``CASES``): the old default (``mean``, decay 1.0) and the new open default
with a sparse codec (``centered-clip``, what ``--aggregation auto`` resolves to, and decay 0.95), each with
and without the attacker. Per case: the honest peers' eval loss per round, the final one, and every ban they
recorded. It starts processes and daemons: run it under the shared lock::

    flock /tmp/p2p_live.lock .venv/bin/python -m benchmarks.topk_capture_live --rounds 8 --attack-epochs 5

Writes ``results/topk_capture_live.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from swarm_procs import events, start_bootstrap, start_peer, start_together, wait_all  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SPARSE = ("--compression", "topk", "--error-feedback", "--topk-chunk-size", "1024", "--topk-k", "16",
          "--outer-lr", "1", "--outer-momentum", "0")
CASES = {
    "old_attack": ("mean", 1.0, True),
    "new_attack": ("centered-clip", 0.95, True),
    "old_clean": ("mean", 1.0, False),
    "new_clean": ("centered-clip", 0.95, False),
    "default_attack": ("auto", None, True),
}
"""case -> (aggregation, error-feedback decay, whether x attacks): the old default (mean, 1.0) and the new open
default with a sparse codec (``--aggregation auto`` resolves to centered-clip; decay unset resolves to 0.95);
``default_attack`` passes neither flag's value (decay ``None``: the flag is left out), so the peers' own defaults
decide."""
logger = logging.getLogger("topk_capture_live")


def run_case(tmp: Path, case: str, rounds: int, attack_epochs: int, scale: float, timeout_s: float) -> dict:
    """One swarm of 4 peers (a, b, c honest; x the attacker unless ``case`` is clean)."""
    tmp.mkdir(parents=True)
    aggregation, decay, attacked = CASES[case]
    boot, maddr = start_bootstrap(tmp)
    procs = {}
    began = time.monotonic()
    try:
        decay_flag = () if decay is None else ("--error-feedback-decay", str(decay))
        args = ("--run-id", f"capture-{case.replace('_', '-')}", "--max-rounds", str(rounds), "--aggregation",
                aggregation, *decay_flag, *SPARSE)
        for name in "abcx":
            faults = start_together(4)
            if name == "x" and attacked:
                faults += "," + ",".join(f"byzantine@{e}={scale:g}" for e in range(attack_epochs))
            procs[name] = start_peer(tmp, name, maddr, *args, faults=faults)
        codes = wait_all(procs, timeout_s)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        boot.terminate()
    out: dict = {"case": case, "aggregation": aggregation, "decay": decay, "attacked": attacked, "codes": codes, "wall_s": time.monotonic() - began,
                 "peers": {}}
    for name in "abcx":
        rows = events(tmp, name, "round")
        out["peers"][name] = {
            "eval_loss": [r.get("eval_loss") for r in rows],
            "outcomes": [r["outcome"] for r in rows],
            "group_sizes": [r.get("group_size") for r in rows],
            "rejected": sorted({e for r in rows for e in r.get("rejected", [])}),
        }
    honest = [out["peers"][n]["eval_loss"] for n in "abc"]
    finals = [next((v for v in reversed(losses) if v is not None), None) for losses in honest]
    out["final_eval_loss_honest"] = finals
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--attack-epochs", type=int, default=5)
    parser.add_argument("--scale", type=float, default=-5.0)
    parser.add_argument("--cases", nargs="+", default=list(CASES)[:4], choices=list(CASES))
    parser.add_argument("--timeout-s", type=float, default=420.0, help="per case")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    results = []
    with tempfile.TemporaryDirectory(prefix="topk_capture_live_") as tmp:
        for case in args.cases:
            result = run_case(Path(tmp) / case, case, args.rounds, args.attack_epochs, args.scale, args.timeout_s)
            logger.info("%s", json.dumps(result))
            results.append(result)
    out = RESULTS / "topk_capture_live.json"
    settings = {"rounds": args.rounds, "attack_epochs": args.attack_epochs, "scale": args.scale}
    previous = json.loads(out.read_text()) if out.exists() else {}
    kept = [r for r in previous.get("results", []) if r["case"] not in args.cases] \
        if {k: previous.get(k) for k in settings} == settings else []
    out.write_text(json.dumps({**settings, "results": kept + results}, indent=1) + "\n")
    for r in results:
        print(f"{r['case']}: final eval loss of a, b, c {r['final_eval_loss_honest']}, codes {r['codes']}, "
              f"rejected {[r['peers'][n]['rejected'] for n in 'abc']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
