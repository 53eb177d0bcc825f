"""What every entry point shares: one-line usage errors with exit code 2, and logging set-up."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, TypeVar

from p2p_diloco.config_loader import ConfigError, add_arguments, build

T = TypeVar("T")
USAGE_ERROR = 2


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the problem and where to read more."""

    def error(self, message: str) -> NoReturn:
        usage_error(self.prog, f"{message} (see {self.prog} --help)")


def usage_error(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


def make_parser(prog: str, description: str, cls: type) -> Parser:
    parser = Parser(prog=prog, description=description,
                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="YAML or TOML file with sections matching the flags; flags and env override it")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    add_arguments(parser, cls)
    return parser


def parse_config(parser: Parser, cls: type[T], argv: Sequence[str] | None,
                 base: Mapping[str, Any] | None = None) -> tuple[T, argparse.Namespace]:
    """Parse flags and build ``cls``; ``base`` holds this program's own defaults (below file/env/flags)."""
    args = parser.parse_args(argv)
    try:
        return build(cls, args, args.config, base=base), args
    except ConfigError as e:
        usage_error(parser.prog, str(e))


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    import datasets

    datasets.disable_progress_bars()
    # hivemind and the HTTP stack are chatty at INFO; their warnings still show.
    for name in ("hivemind", "httpx", "urllib3", "filelock", "datasets"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.WARNING)
