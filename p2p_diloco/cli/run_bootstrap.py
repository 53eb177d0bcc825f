"""``run_bootstrap``: a DHT node that helps volunteers find each other; it does not train."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("run_bootstrap: not implemented yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
