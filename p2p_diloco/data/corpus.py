"""Embedded synthetic corpus: a small invented language generated on the fly, no network needed.

Every peer of a swarm must see the same data distribution, including peers on machines that cannot reach
the Hugging Face hub.  This module therefore generates its corpus deterministically from a seed: the same
``(split, seed, CORPUS_VERSION)`` yields byte-identical text on every run, process and platform.

The language lives in two modules: ``lexicon`` builds its words (forms, categories, frequency ranks) from
a fixed seed, and ``grammar`` holds the sampling tables and the probabilistic grammar that writes one
document from one random stream.  This module numbers the documents of each split, gives each its own
stream, wraps a split as a cached ``datasets.Dataset`` and draws the subject-verb agreement probe.

Sizes (seed 0)
--------------
* train: 20,000 documents, 10.0 MB of ASCII text (10,031,192 bytes);
* eval: 800 documents, 408 KB (407,689 bytes);
* documents run 200-1,500 characters (median about 330), i.e. 2-15 sentences of about 11 words; the
  question particle ``esk`` opens the 6% of sentences that end in "?".

The whole train split generates in about 2 s on one CPU core, so every peer can rebuild it locally.
Changing anything that alters the output must come with a new ``CORPUS_VERSION``, which keys the
``datasets`` cache.

Only ``Generator.random()`` on PCG64 streams seeded through ``SeedSequence`` feeds the text: numpy keeps
that bit stream fixed across versions and platforms, unlike samplers such as ``choice`` or ``integers``.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import datasets
import numpy as np

from p2p_diloco.data.grammar import (
    _P_ONE_ADJ,
    MAX_DOCUMENT_CHARS,
    MIN_DOCUMENT_CHARS,
    N_TOPICS,
    AnnotatedSentence,
    _tables,
    _Writer,
)
from p2p_diloco.data.lexicon import (
    FRAME_INTRANSITIVE,
    FRAME_TRANSITIVE,
    FUNCTION_WORDS,
    RELATIVE,
    SG,
    Lexicon,
    get_lexicon,
)

__all__ = [
    "CORPUS_VERSION",
    "FUNCTION_WORDS",
    "MAX_DOCUMENT_CHARS",
    "MIN_DOCUMENT_CHARS",
    "SPLIT_SIZES",
    "AgreementPair",
    "AnnotatedDocument",
    "AnnotatedSentence",
    "Lexicon",
    "agreement_probe",
    "annotate_document",
    "generate_documents",
    "get_lexicon",
    "load_embedded_corpus",
]

CORPUS_VERSION = "synthlang-1"

SplitName = Literal["train", "eval"]
SPLIT_SIZES: dict[str, int] = {"train": 20_000, "eval": 800}

# Each split (and the probe) draws from its own random stream, so eval is not a replay of train.
_STREAM_CODES: dict[str, int] = {"train": 1, "eval": 2, "probe": 3}
_DOCUMENT_SALT = 0xD1_10C0


@dataclass(frozen=True)
class AnnotatedDocument:
    text: str
    sentences: tuple[AnnotatedSentence, ...]


def _document_rng(split: str, index: int, seed: int) -> np.random.Generator:
    if split not in _STREAM_CODES:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(_STREAM_CODES)}")
    # Keying by document index makes any range of documents reproducible without generating its prefix.
    return np.random.Generator(np.random.PCG64([_DOCUMENT_SALT, seed, _STREAM_CODES[split], index]))


def generate_documents(
    split: SplitName = "train", num_documents: int | None = None, seed: int = 0, start: int = 0
) -> Iterator[str]:
    """Yield documents ``start .. start + num_documents - 1`` of ``split`` (default: the whole split)."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"split must be one of {sorted(SPLIT_SIZES)}, got {split!r}")
    if num_documents is None:
        num_documents = SPLIT_SIZES[split]
    tables = _tables()
    for index in range(start, start + num_documents):
        yield _Writer(tables, _document_rng(split, index, seed)).document()


def annotate_document(split: SplitName, index: int, seed: int = 0) -> AnnotatedDocument:
    """Document ``index`` of ``split`` with its token structure; ``text`` equals the plain generator's."""
    sink: list[AnnotatedSentence] = []
    text = _Writer(_tables(), _document_rng(split, index, seed), annotate=True).document(sink)
    return AnnotatedDocument(text, tuple(sink))


def _rows(split: SplitName, num_documents: int, seed: int, version: str) -> Iterator[dict[str, str]]:
    # ``version`` only feeds the cache fingerprint; a stale cache from another grammar must not be reused.
    if version != CORPUS_VERSION:
        raise ValueError(f"corpus version {version!r} requested, this package generates {CORPUS_VERSION!r}")
    for text in generate_documents(split, num_documents, seed):
        yield {"text": text}


def load_embedded_corpus(
    split: SplitName = "train",
    num_documents: int | None = None,
    seed: int = 0,
    cache_dir: str | None = None,
    keep_in_memory: bool = False,
) -> datasets.Dataset:
    """The embedded corpus as a ``datasets.Dataset`` with one ``text`` column; cached after the first call."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"split must be one of {sorted(SPLIT_SIZES)}, got {split!r}")
    n = SPLIT_SIZES[split] if num_documents is None else int(num_documents)
    gen_kwargs = {"split": split, "num_documents": n, "seed": int(seed), "version": CORPUS_VERSION}
    kwargs: dict[str, object] = {}
    if "fingerprint" in inspect.signature(datasets.Dataset.from_generator).parameters:
        # An explicit fingerprint keys the cache by what determines the output, not by pickled code.
        key = f"{CORPUS_VERSION}|{split}|{n}|{int(seed)}".encode()
        kwargs["fingerprint"] = "p2p-diloco-corpus-" + hashlib.sha256(key).hexdigest()[:16]
    return datasets.Dataset.from_generator(
        _rows,
        features=datasets.Features({"text": datasets.Value("string")}),
        gen_kwargs=gen_kwargs,
        cache_dir=cache_dir,
        keep_in_memory=keep_in_memory,
        split=datasets.NamedSplit(split),
        **kwargs,
    )


@dataclass(frozen=True)
class AgreementPair:
    """A sentence prefix ending right before the main verb, and two continuations that differ only in it.

    The prefix holds the subject, then an intervening phrase whose nouns (attractors) have the opposite
    number, so choosing the verb form by the nearest noun picks the wrong one.
    """

    prefix: str
    grammatical: str
    ungrammatical: str
    subject_number: Literal["singular", "plural"]
    intervening_words: int

    @property
    def sentences(self) -> tuple[str, str]:
        """``(grammatical sentence, ungrammatical sentence)``."""
        return self.prefix + self.grammatical, self.prefix + self.ungrammatical


def agreement_probe(
    num_pairs: int = 256, seed: int = 0, min_intervening_words: int = 4
) -> list[AgreementPair]:
    """Minimal pairs for subject-verb agreement across an intervening clause full of attractors.

    Drawn from their own random stream (not the train or eval stream) with the corpus lexicon and
    frequencies; half have a singular subject, half a plural one.
    """
    tables = _tables()
    lex = tables.lexicon
    pairs: list[AgreementPair] = []
    for index in range(num_pairs):
        w = _Writer(tables, _document_rng("probe", index, seed))
        w.topic = int(w.u() * N_TOPICS)
        num = index % 2
        other = 1 - num
        out: list[str] = [w.pick(tables.determiners[num])]
        if w.u() < _P_ONE_ADJ:
            out.append(w.adjective())
        out.append(w.noun(num))
        head = len(out) - 1
        template = int(w.u() * 3)
        if template == 0:  # prepositional phrase, whose noun may carry its own relative clause
            out += [w.pick(tables.prepositions), w.pick(tables.determiners[other]), w.noun(other)]
            if w.u() < 0.5:
                out.append(RELATIVE)
                w.verb(FRAME_INTRANSITIVE, other, out)
        elif template == 1:  # object relative clause with an attractor subject
            out += [RELATIVE, w.pick(tables.determiners[other]), w.noun(other)]
            w.verb(FRAME_TRANSITIVE, other, out)
        else:  # subject relative clause with an attractor object
            out.append(RELATIVE)
            w.verb(FRAME_TRANSITIVE, num, out)
            out += [w.pick(tables.determiners[other]), w.noun(other)]
        while len(out) - head - 1 < min_intervening_words:
            out += [w.pick(tables.prepositions), w.pick(tables.determiners[other]), w.noun(other)]
        lexeme = w.verb_lexeme(FRAME_INTRANSITIVE)
        tail = (" " + w.pick(tables.adverbs) if w.u() < 0.5 else "") + "."
        out[0] = out[0][0].upper() + out[0][1:]
        pairs.append(
            AgreementPair(
                prefix=" ".join(out),
                grammatical=" " + lex.verb_forms[num][lexeme] + tail,
                ungrammatical=" " + lex.verb_forms[other][lexeme] + tail,
                subject_number="singular" if num == SG else "plural",
                intervening_words=len(out) - head - 1,
            )
        )
    return pairs
