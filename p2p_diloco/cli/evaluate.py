"""``run_peer eval``: loss and perplexity of the run's model on the held-out split.

::

    run_peer eval --model small --checkpoint-dir ckpt                  # a checkpoint
    run_peer eval --model small --initial-peers MADDR                  # the live swarm's current state
    run_peer eval --model my-model --dataset data.txt --json           # an exported folder, as JSON

The held-out batches are built exactly as a training peer builds them (``build.held_out_batches``: same
split, ``--eval-batches``, ``--seq-len`` and micro-batch size) and the loss is the same function the peer
logs (``trainer.evaluate_model``), so on the same parameters the two report the same number. Perplexity is
``exp(loss)``, the loss being the mean next-token cross-entropy in nats.

Exit codes: 0 done, 1 the swarm did not answer, 2 usage error (flags, data, model, checkpoint).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Sequence
from typing import Any

from p2p_diloco.build import held_out_batches
from p2p_diloco.cli.common import Parser, make_parser, parse_config, setup_logging, usage_error
from p2p_diloco.cli.model_source import SourceError, add_source_argument, load_model, quiet_progress_bars
from p2p_diloco.data.sources import DataSourceError
from p2p_diloco.device import autocast_dtype, select_device
from p2p_diloco.peer.config import PeerConfig
from p2p_diloco.trainer import evaluate_model

logger = logging.getLogger(__name__)
PROG = "run_peer eval"


def perplexity(loss: float) -> float:
    """``exp(loss)``, infinite instead of an overflow for an untrained or diverged model."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def build_parser() -> Parser:
    """``run_peer``'s flags plus ``--source`` and ``--json``."""
    parser = make_parser(PROG, "Loss and perplexity of the run's model on the held-out split.", PeerConfig)
    add_source_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a line of text")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    cfg, args = parse_config(build_parser(), PeerConfig, sys.argv[1:] if argv is None else list(argv))
    setup_logging(args.verbose)
    quiet_progress_bars()
    try:
        loaded = load_model(cfg, args.source)
        batches = held_out_batches(cfg, loaded.tokenizer)
    except (DataSourceError, ValueError) as e:
        usage_error(PROG, str(e))
    except SourceError as e:
        if e.usage:
            usage_error(PROG, str(e))
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    device = select_device(cfg.inner.device)
    model = loaded.model.to(device)
    loss = evaluate_model(model, batches, device, autocast_dtype(device, cfg.inner.precision))
    result: dict[str, Any] = {
        "loss": loss if math.isfinite(loss) else None,
        "perplexity": perplexity(loss) if math.isfinite(perplexity(loss)) else None,
        "batches": len(batches),
        "tokens": sum(b.numel() for b in batches),
        "dataset": cfg.data.dataset,
        "model": cfg.model.model,
        "source": loaded.source,
        "origin": loaded.origin,
        "epoch": loaded.epoch,
        "params_sha256": loaded.params_sha256,
        "device": str(device),
    }
    if args.json:
        print(json.dumps(result, sort_keys=True), flush=True)
    else:
        epoch = "" if loaded.epoch is None else f" at epoch {loaded.epoch}"
        print(f"{cfg.model.model}{epoch} from {loaded.source} ({loaded.origin}): eval loss {loss:.4f}, "
              f"perplexity {perplexity(loss):.2f} on {result['tokens']:,} held-out tokens of {cfg.data.dataset} "
              f"({len(batches)} batches)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
