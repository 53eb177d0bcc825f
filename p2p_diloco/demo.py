"""``python -m p2p_diloco.demo``: the quickstart's first command, on the embedded defaults."""

from __future__ import annotations

import sys

from p2p_diloco.cli import train_local

DEFAULTS = ["--model", "tiny", "--dataset", "embedded", "--max-rounds", "6", "--local-steps", "100",
            "--inner-lr", "1e-3", "--warmup-steps", "50", "--batch-size", "16", "--seq-len", "128"]


def main(argv: list[str] | None = None) -> int:
    return train_local.main(DEFAULTS + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
