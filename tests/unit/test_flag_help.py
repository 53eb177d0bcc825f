"""Every CLI flag's help is at most two sentences, and every guide it points to has the section it names.

The help of a config-dataclass flag is the docstring under its field (``config_loader``); the depth (the
reasoning, the measured numbers, the caveats) lives in the guides, which the help points to as
``peers/README.md#anchor`` or ``BENCHMARKS.md, "Section"``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from p2p_diloco.cli import evaluate, export, plot
from p2p_diloco.cli.common import make_parser
from p2p_diloco.cli.run_bootstrap import BootstrapConfig
from p2p_diloco.config import TrainConfig
from p2p_diloco.config_loader import _leaves
from p2p_diloco.peer.config import PeerConfig

ROOT = Path(__file__).resolve().parents[2]
MAX_SENTENCES = 2
CONFIGS = (PeerConfig, TrainConfig, BootstrapConfig)
"""Every config dataclass a CLI turns into flags: run_peer (and its doctor, eval, export), train_local and the
simulator (``TrainConfig``), run_bootstrap."""

_CODE = re.compile(r"``.*?``|`[^`]*`")
_ABBREVIATIONS = re.compile(r"\b(?:e\.g|i\.e|etc|vs|cf|approx|resp)\.", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.?!][\"')\]]*(?:\s+|$)")
_ANCHOR_POINTER = re.compile(r"([\w./-]+\.md)#([\w-]+)")
_SECTION_POINTER = re.compile(r"([\w./-]+\.md),? \"([^\"]+)\"")


def sentences(text: str) -> list[str]:
    """``text`` cut into sentences: a '.', '?' or '!' followed by a space or the end closes one, except inside
    code (backticks), in a number (0.9) or after an abbreviation (e.g., i.e.)."""
    masked = _CODE.sub(lambda m: "x" * len(m.group()), text)
    masked = _ABBREVIATIONS.sub(lambda m: "x" * len(m.group()), masked)
    out, start = [], 0
    for m in _SENTENCE_END.finditer(masked):
        out.append(text[start:m.end()].strip())
        start = m.end()
    if text[start:].strip():
        out.append(text[start:].strip())
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(path: Path) -> list[str]:
    in_fence = False
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and (m := re.match(r"#{1,6} (.+)", line)):
            out.append(m.group(1).strip())
    return out


def _config_helps() -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    for cls in CONFIGS:
        for leaf in _leaves(cls):
            seen.setdefault(f"{cls.__name__} --{leaf.flag}", leaf.help)
    return sorted(seen.items())


def _parser_helps() -> list[tuple[str, str]]:
    """The flags the CLIs add by hand, beside the config's (``--config``, ``--source``, ``--output``, ...)."""
    from_config = {leaf.dotted for cls in CONFIGS for leaf in _leaves(cls)}
    parsers = {"common": make_parser("p", "", PeerConfig)} | {m.PROG: m.build_parser() for m in (evaluate, export, plot)}
    out = []
    for prog, parser in parsers.items():
        for action in parser._actions:
            if action.dest not in from_config | {"help"} and action.help not in (None, argparse.SUPPRESS):
                out.append((f"{prog} {'/'.join(action.option_strings) or action.dest}", str(action.help)))
    return out


ALL_HELPS = _config_helps() + _parser_helps()


def test_the_sentence_rule_reads_code_numbers_and_abbreviations() -> None:
    assert len(sentences("One. Two? Three! Four")) == 4
    assert len(sentences("Keep 0.9 (e.g. for H = 500, i.e. long rounds). Default: ``a. b`` and `x. y`.")) == 2
    assert len(sentences("It ends here.")) == 1
    assert len(sentences("Ends (with a parenthesis.) Then more.")) == 2


def test_the_walk_sees_every_cli_config() -> None:
    flags = {name.split()[-1] for name, _ in ALL_HELPS}
    assert {"--outer-lr", "--initial-peers", "--relay-check-starts", "--monitor-run-ids", "--node-parallel",
            "--source", "--output"} <= flags


@pytest.mark.parametrize("name,text", ALL_HELPS, ids=[n for n, _ in ALL_HELPS])
def test_every_flag_help_is_at_most_two_sentences(name: str, text: str) -> None:
    assert text, f"{name} has no help"
    found = sentences(text)
    assert len(found) <= MAX_SENTENCES, f"{name}: {len(found)} sentences (move the rest to a guide):\n" + "\n".join(
        found)


def test_every_pointer_in_a_help_names_an_existing_section() -> None:
    pointers = 0
    for name, text in ALL_HELPS:
        for doc, anchor in _ANCHOR_POINTER.findall(text):
            pointers += 1
            path = ROOT / doc
            assert path.is_file(), f"{name} points to {doc}, which does not exist"
            assert anchor in {slug(h) for h in headings(path)}, f"{name} points to {doc}#{anchor}: no such heading"
        for doc, section in _SECTION_POINTER.findall(text):
            pointers += 1
            path = ROOT / doc
            assert path.is_file(), f"{name} points to {doc}, which does not exist"
            assert any(h.startswith(section) for h in headings(path)), \
                f"{name} points to {doc}, \"{section}\": no heading starts so"
    assert pointers, "no help points to a guide; the rule above would check nothing"


def test_every_link_within_the_peer_guide_names_an_existing_section() -> None:
    guide = ROOT / "peers" / "README.md"
    anchors = {slug(h) for h in headings(guide)}
    links = re.findall(r"\]\(#([\w-]+)\)", guide.read_text(encoding="utf-8"))
    assert links and not [a for a in links if a not in anchors]
