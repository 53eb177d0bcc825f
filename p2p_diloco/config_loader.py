"""Map CLI flags, an optional YAML/TOML file and environment variables onto one dataclass tree.

Precedence, lowest to highest: dataclass defaults < config file < environment < command line.

Every leaf field of the tree (except those with ``metadata={"cli": False}``) becomes a flag ``--name-with-dashes`` (or the name given in the field's
``metadata={"flag": ...}``), an environment variable ``P2P_DILOCO_NAME_WITH_UNDERSCORES`` and a key
``section.field`` in the config file. The help text of a flag is the docstring written right under its
field, so the dataclass stays the single source of truth.

We parse the docstrings with :mod:`ast` instead of keeping a second table of help strings, because two
tables drift apart.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import sys
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENV_PREFIX = "P2P_DILOCO_"

T = TypeVar("T")


class ConfigError(ValueError):
    """A user-facing configuration problem: one line naming the field and how to fix it."""


@dataclasses.dataclass(frozen=True)
class _Leaf:
    path: tuple[str, ...]
    field: dataclasses.Field
    annotation: Any
    help: str

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def flag(self) -> str:
        return self.field.metadata.get("flag", self.path[-1].replace("_", "-"))

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag.replace("-", "_").upper()


def field_docstrings(cls: type) -> dict[str, str]:
    """Return ``{field name: docstring}`` for the string literals written right under each field."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def _leaves(cls: type, prefix: tuple[str, ...] = ()) -> list[_Leaf]:
    hints = typing.get_type_hints(cls)
    docs = field_docstrings(cls)
    out: list[_Leaf] = []
    for f in dataclasses.fields(cls):
        ann = hints[f.name]
        if f.metadata.get("cli") is False:
            continue  # set by the enclosing config, not by the user
        if dataclasses.is_dataclass(ann):
            out.extend(_leaves(ann, prefix + (f.name,)))
        else:
            out.append(_Leaf(prefix + (f.name,), f, ann, docs.get(f.name, "")))
    return out


def _unwrap_optional(ann: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(ann)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(ann)) == 2:
            return args[0], True
    return ann, False


def coerce(leaf: _Leaf, raw: Any, source: str) -> Any:
    """Convert ``raw`` (a string from a flag/env, or a value from a file) to the field's type."""
    ann, optional = _unwrap_optional(leaf.annotation)
    where = f"{leaf.dotted} (from {source})"
    if raw is None or (optional and isinstance(raw, str) and raw.lower() in ("", "none", "null")):
        if optional:
            return None
        raise ConfigError(f"{where}: a value is required")
    origin = typing.get_origin(ann)
    try:
        if ann is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if ann is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw)
        if ann is float:
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if ann is str:
            if not isinstance(raw, (str, int, float)):
                raise ValueError
            return str(raw)
        if origin in (list, Sequence, tuple):
            if isinstance(raw, str):
                items = [x for x in raw.replace(",", " ").split() if x]
            elif isinstance(raw, (list, tuple)):
                items = list(raw)
            else:
                raise ValueError
            (inner,) = typing.get_args(ann)[:1] or (str,)
            return [inner(x) for x in items]
        if origin is typing.Literal:
            choices = typing.get_args(ann)
            if raw not in choices:
                raise ConfigError(f"{where}: got {raw!r}; allowed values are {', '.join(map(str, choices))}")
            return raw
    except ConfigError:
        raise
    except (TypeError, ValueError):
        kind = getattr(ann, "__name__", str(ann))
        raise ConfigError(f"{where}: cannot read {raw!r} as {kind}") from None
    return raw


def _bool_flag(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per leaf field of ``cls``; every flag defaults to "not given" (``SUPPRESS``)."""
    seen: dict[str, str] = {}
    for leaf in _leaves(cls):
        if leaf.flag in seen:
            raise RuntimeError(f"flag --{leaf.flag} used by both {seen[leaf.flag]} and {leaf.dotted}")
        seen[leaf.flag] = leaf.dotted
        ann, _ = _unwrap_optional(leaf.annotation)
        default = leaf.field.default
        if default is dataclasses.MISSING and leaf.field.default_factory is not dataclasses.MISSING:
            default = leaf.field.default_factory()
        # argparse %-formats help strings; a docstring's own "%" (e.g. "costs 10%") must stay literal
        help_text = f"{leaf.help} [default: {default!r}; env {leaf.env}]".replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": leaf.dotted, "default": argparse.SUPPRESS, "help": help_text,
                                  "metavar": leaf.flag.replace("-", "_").upper()}
        if ann is bool:
            # `--client-mode` alone means true; `--client-mode false` is also accepted.
            kwargs.update(nargs="?", const=True, type=_bool_flag, metavar="BOOL")
        elif typing.get_origin(ann) in (list, Sequence, tuple):
            kwargs.update(nargs="*", metavar="VALUE")
        elif typing.get_origin(ann) is typing.Literal:
            kwargs.update(metavar="{" + ",".join(map(str, typing.get_args(ann))) + "}")
        parser.add_argument(f"--{leaf.flag}", **kwargs)


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or TOML (``.toml``) file into a nested dict."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing .yaml or .toml file")
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(p.read_text())
        elif p.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(p.read_text()) or {}
        else:
            raise ConfigError(f"config file {str(p)!r}: unknown extension; use .yaml, .yml or .toml")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"config file {str(p)!r} is not valid: {first}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _flatten_file(data: Mapping[str, Any], leaves: Mapping[str, _Leaf], path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, Mapping) and dotted not in leaves:
                walk(value, dotted + ".")
            elif dotted in leaves:
                out[dotted] = value
            else:
                known = ", ".join(sorted(leaves))
                raise ConfigError(f"config file {path!r}: unknown key {dotted!r}; known keys: {known}")

    walk(data, "")
    return out


def build(cls: type[T], args: argparse.Namespace | None = None, config_file: str | None = None,
          environ: Mapping[str, str] | None = None, base: Mapping[str, Any] | None = None) -> T:
    """Build ``cls`` from defaults (``base`` overrides the dataclass's), the file, the environment, flags."""
    leaves = {leaf.dotted: leaf for leaf in _leaves(cls)}
    values: dict[str, Any] = {k: coerce(leaves[k], v, "program defaults") for k, v in (base or {}).items()}
    if config_file:
        for dotted, raw in _flatten_file(read_config_file(config_file), leaves, config_file).items():
            values[dotted] = coerce(leaves[dotted], raw, f"config file {config_file}")
    env = os.environ if environ is None else environ
    for leaf in leaves.values():
        if leaf.env in env:
            values[leaf.dotted] = coerce(leaf, env[leaf.env], f"${leaf.env}")
    if args is not None:
        for dotted, raw in vars(args).items():
            if dotted in leaves:
                values[dotted] = coerce(leaves[dotted], raw, f"--{leaves[dotted].flag}")
    return _instantiate(cls, values, ())


def _instantiate(cls: type[T], values: Mapping[str, Any], prefix: tuple[str, ...]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        ann = hints[f.name]
        dotted = ".".join(prefix + (f.name,))
        if dataclasses.is_dataclass(ann):
            kwargs[f.name] = _instantiate(ann, values, prefix + (f.name,))
        elif dotted in values:
            kwargs[f.name] = values[dotted]
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        # Validators start their message with the field name; name the flag too, since that is what
        # the user typed.
        message = str(e)
        name, sep, rest = message.partition(":")
        dotted = ".".join(prefix + (name.strip(),))
        leaf = {leaf.dotted: leaf for leaf in _leaves(cls, prefix)}.get(dotted)
        if sep and leaf is not None:
            raise ConfigError(f"--{leaf.flag} ({dotted}):{rest}") from None
        raise ConfigError(message) from None


def to_dict(obj: Any) -> dict[str, Any]:
    """A plain nested dict of a config, for logs and manifests."""
    return dataclasses.asdict(obj)
