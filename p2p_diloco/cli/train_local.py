"""``python -m p2p_diloco.cli.train_local``: train one peer alone, no swarm (a baseline and a smoke test).

It runs ``max_rounds`` phases of ``local_steps`` inner steps and evaluates after each, so the numbers
line up with a swarm's rounds.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from p2p_diloco.build import build_local
from p2p_diloco.cli.common import make_parser, parse_config, setup_logging, usage_error
from p2p_diloco.config import TrainConfig
from p2p_diloco.data.sources import DataSourceError
from p2p_diloco.models import ModelLoadError, count_parameters

logger = logging.getLogger(__name__)
PROG = "train_local"


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(PROG, "Train the model on this machine alone (no swarm).", TrainConfig)
    cfg, args = parse_config(parser, TrainConfig, argv)
    setup_logging(args.verbose)
    if cfg.run.max_rounds == 0:
        usage_error(PROG, "--max-rounds must be >= 1 for a local run")
    try:
        local = build_local(cfg, peer_id="local")
    except (DataSourceError, ModelLoadError, ValueError) as e:
        usage_error(PROG, str(e))
    print(
        f"model {cfg.model.model}: {count_parameters(local.model):,} parameters on {local.trainer.device}; "
        f"dataset {cfg.data.dataset}; {cfg.run.max_rounds} x {cfg.outer.local_steps} steps",
        flush=True,
    )
    first = local.trainer.evaluate(local.eval_batches)
    print(f"step {0:>6}  eval loss {first:.4f}", flush=True)
    last = first
    for _ in range(cfg.run.max_rounds):
        stats = local.trainer.train_steps(cfg.outer.local_steps)
        last = local.trainer.evaluate(local.eval_batches)
        print(
            f"step {local.trainer.step_count:>6}  train loss {stats.mean_loss:.4f}  eval loss {last:.4f}  "
            f"{stats.tokens_per_second:,.0f} tokens/s",
            flush=True,
        )
    print(f"eval loss {first:.4f} -> {last:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
