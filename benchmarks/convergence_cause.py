"""Why the old convergence table had DiLoCo k=4 worse than one worker: the outer step's amplification.

Runs synchronous DiLoCo through the core (``OuterState.apply``) and records, per round, the eval loss,
the cosine between consecutive averaged pseudo-gradients, the cosine between workers' pseudo-gradients
and the *amplification* ``||θ(t-1) − θ(t)|| / ||Δ̄(t)||``: how far the outer step moved the parameters
relative to the averaged pseudo-gradient (1 for FedAvg; Nesterov with momentum μ approaches
``η (1 + μ/(1 − μ))`` when consecutive Δ̄ point the same way). Tiny preset, batch 8 x 64, H = 20,
20 rounds, inner AdamW lr 1e-3 with warmup 20 and cosine decay over the run. Writes one JSON line per
run (``benchmarks/results/convergence_cause.jsonl``)::

    .venv/bin/python benchmarks/convergence_cause.py single,1,20,20,1.0,0.0 diloco4_p,4,20,20,0.7,0.9
    # LABEL,K,H,ROUNDS,OUTER_LR,OUTER_MOMENTUM[,SEED]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2p_diloco.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, RunConfig, TrainConfig  # noqa: E402
from p2p_diloco.core.delayed import RoundAggregate, summarize_round  # noqa: E402
from p2p_diloco.simulate.engine import SimConfig, build_workers  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "convergence_cause.jsonl"


def cfg(h: int, rounds: int, seed: int = 0, lr: float = 1e-3, warm: int = 20, seq: int = 64,
        bs: int = 8) -> TrainConfig:
    return TrainConfig(model=ModelConfig("tiny", seq_len=seq), data=DataConfig(eval_batches=8),
                       inner=InnerConfig(batch_size=bs, lr=lr, warmup_steps=warm, total_steps=rounds * h),
                       outer=OuterConfig(local_steps=h, min_local_steps=1), run=RunConfig(seed=seed))


def flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def diag(label: str, k: int, h: int, rounds: int, olr: float, mom: float, seed: int = 0) -> dict:
    c = cfg(h, rounds, seed)
    torch.manual_seed(seed)
    ws = build_workers(c, SimConfig("diloco", k, rounds), lr=olr, momentum=mom)
    judge = ws[0]
    t0, prev, recs = time.time(), None, []
    cos = torch.nn.functional.cosine_similarity
    for r in range(1, rounds + 1):
        deltas = []
        for w in ws:
            w.local.trainer.train_steps(h)
            deltas.append([d.clone() for d in w.state.pseudo_gradient(w.params)])
        mean = [sum(ds) / k for ds in zip(*deltas, strict=True)]
        before = flat(ws[0].state.anchors).clone()
        for w in ws:
            w.state.apply(RoundAggregate(mean, None, summarize_round([1.0] * k, [0] * k)), w.params)
        move = before - flat(ws[0].state.anchors)
        m = flat(mean)
        pairs = [float(cos(flat(deltas[i]), flat(deltas[j]), dim=0)) for i in range(k) for j in range(i + 1, k)]
        recs.append(dict(r=r, loss=judge.local.trainer.evaluate(judge.local.eval_batches),
                         cos_prev=float(cos(m, prev, dim=0)) if prev is not None else float("nan"),
                         cos_workers=sum(pairs) / len(pairs) if pairs else float("nan"),
                         amp=float(move.norm() / m.norm()), dnorm=float(m.norm())))
        prev = m
    return dict(label=label, k=k, H=h, R=rounds, olr=olr, mom=mom, seed=seed, ilr=c.inner.lr,
                final=recs[-1]["loss"], wall=time.time() - t0, recs=recs)


if __name__ == "__main__":
    torch.set_num_threads(1)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    for spec in sys.argv[1:]:
        a = spec.split(",")
        out = diag(a[0], int(a[1]), int(a[2]), int(a[3]), float(a[4]), float(a[5]), int(a[6]) if len(a) > 6 else 0)
        print(json.dumps(out), flush=True)
        with OUT.open("a") as f:
            f.write(json.dumps(out) + "\n")
