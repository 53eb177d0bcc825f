"""``run_peer``: join or start a p2p_diloco swarm."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("run_peer: the swarm is not implemented yet; use python -m p2p_diloco.demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
