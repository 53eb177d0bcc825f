"""Embedded synthetic corpus: a small invented language generated on the fly, no network needed.

Every peer of a swarm must see the same data distribution, including peers on machines that cannot reach
the Hugging Face hub.  This module therefore generates its corpus deterministically from a seed: the same
``(split, seed, CORPUS_VERSION)`` yields byte-identical text on every run, process and platform.

Lexicon
-------
About 2,600 lexemes (roughly 5,200 distinct surface forms), all lowercase ASCII words built from syllables
(onset + vowel + coda) with a fixed lexicon seed:

* nouns (1,200) in two regular classes, ``stem``/``stem+i`` and ``stem+u``/``stem+ar``, except that the
  24 most frequent nouns have an unrelated plural, as irregulars cluster among frequent words in natural
  languages;
* verbs (700), each intransitive, transitive or clausal (takes an ``ut`` complement clause), in two
  conjugations: singular ``stem+s`` / plural ``stem``, and singular ``stem+et`` / plural ``stem+on``; a
  participle (``stem+ado`` / ``stem+ido``) follows the agreeing auxiliary ``ha`` (sg) / ``han`` (pl);
* adjectives (450), adverbs (120, ending in ``-mo``) and capitalised proper names (100, singular);
* closed-class words written by hand: determiners that agree in number (``le un ko sa`` singular,
  ``li dei kos sai du tri`` plural), prepositions, coordinating and subordinating conjunctions, the
  invariant relative pronoun ``ke``, the negation ``ne``, subject pronouns ``on``/``oni`` and the question
  particle ``esk``.

Every surface form maps back to exactly one lexeme and number, so agreement can be checked from text.
Within each category word frequencies follow a Zipf-Mandelbrot law (weight ``1 / (rank + 2.7)``) and more
frequent words tend to be shorter.

Grammar
-------
A probabilistic context-free grammar with number features (``n``, ``m`` in {sg, pl}, drawn independently
with P(pl) = 0.42)::

    Document  -> Sentence+                      topic drawn once per document
    Sentence  -> [esk] [Subord Clause(1) "," | PP(1) ","] Clause(0)
                 ["," Conj Clause(1) | Subord Clause(1)] ("." | "?" | "!")
    Clause(d) -> Subj(n, d) VP(n, d)            the verb agrees with the subject head
    Subj(n,d) -> Pron(n) | NP(n, d)
    NP(n, d)  -> Name (n = sg) | Det(n) Adj{0..2} Noun(n) [PP(d+1) | RC(n, d+1)]
    PP(d)     -> Prep NP(m, d)
    RC(n, d)  -> ke VP(n, d)                    subject relative: agrees with the modified noun
               | ke NP(m, d) [ne] Vt(m)         object relative: agrees with its own subject
    VP(n, d)  -> [ne] Vi(n) [Adv] [PP(d+1)] | [ne] Vt(n) NP(m, d+1) [Adv] | [ne] Vc(n) ut Clause(d+1)
    V(n)      -> Verb(n) | Aux(n) Participle

Post-modifier probabilities shrink with depth and stop at depth 3, which bounds nesting.  Subjects get a
post-modifier more often than other noun phrases, so a subject head and its verb are frequently separated
by a prepositional phrase or a (possibly nested) relative clause whose nouns have their own, independent
number.  Those nouns are *attractors*: a model that just copies the number of the nearest noun gets the
verb wrong, so predicting verb forms well requires tracking the subject across the intervening clause.
That is the long-range dependency ``agreement_probe`` measures.

Documents are coherent: each draws one of 40 topics that favours its own subset of nouns, verbs and
adjectives, keeps a small cast of proper names and tends to reuse nouns it already mentioned.  A tiny
byte-level model first picks up spelling and word frequencies, then local syntax (determiner-noun number,
word order), and only later the long-range agreement.

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
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Generic, Literal, TypeVar

import datasets
import numpy as np

__all__ = [
    "CORPUS_VERSION",
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
MIN_DOCUMENT_CHARS = 200
MAX_DOCUMENT_CHARS = 1_500

# Each split (and the probe) draws from its own random stream, so eval is not a replay of train.
_STREAM_CODES: dict[str, int] = {"train": 1, "eval": 2, "probe": 3}
_LEXICON_SEED = 0x5EED_1E81
_DOCUMENT_SALT = 0xD1_10C0

SG, PL = 0, 1
_P_PLURAL = 0.42

# ---------------------------------------------------------------------------------------------------------
# Lexicon
# ---------------------------------------------------------------------------------------------------------

_ONSETS: tuple[tuple[str, int], ...] = (
    ("", 5), ("b", 3), ("d", 4), ("f", 2), ("g", 3), ("k", 5), ("l", 4), ("m", 4), ("n", 4), ("p", 3),
    ("r", 4), ("s", 5), ("t", 5), ("v", 3), ("z", 1), ("h", 2), ("j", 1), ("w", 1), ("br", 1), ("dr", 1),
    ("gr", 1), ("kl", 1), ("pl", 1), ("st", 1), ("tr", 1), ("sk", 1), ("sh", 1), ("ch", 1), ("th", 1),
)
_VOWELS: tuple[tuple[str, int], ...] = (
    ("a", 6), ("e", 5), ("i", 4), ("o", 5), ("u", 3), ("ae", 1), ("ou", 1), ("ia", 1),
)
_CODAS: tuple[tuple[str, int], ...] = (
    ("", 14), ("n", 3), ("r", 3), ("l", 3), ("s", 1), ("m", 2), ("k", 1), ("t", 1), ("nd", 1), ("rk", 1),
)
_SYLLABLE_COUNTS: tuple[tuple[int, int], ...] = ((1, 2), (2, 6), (3, 4), (4, 1))

N_NOUNS = 1_200
N_IRREGULAR_NOUNS = 24
N_INTRANSITIVE = 260
N_TRANSITIVE = 400
N_CLAUSAL = 40
N_ADJECTIVES = 450
N_ADVERBS = 120
N_NAMES = 100
N_TOPICS = 40
_TOPIC_SIZES = {"noun": 60, "intr": 20, "trans": 30, "adj": 24}

DETERMINERS: tuple[tuple[str, ...], tuple[str, ...]] = (
    ("le", "un", "ko", "sa"),
    ("li", "dei", "kos", "sai", "du", "tri"),
)
_DETERMINER_WEIGHTS: tuple[tuple[int, ...], tuple[int, ...]] = ((8, 5, 2, 2), (8, 4, 2, 2, 1, 1))
PREPOSITIONS = ("ad", "de", "sur", "pel", "kon", "sin", "ultra", "nim", "bo", "fen", "intra", "pos")
CONJUNCTIONS = ("et", "mas", "ol")
SUBORDINATORS = ("kan", "kar", "si")
RELATIVE = "ke"
COMPLEMENTIZER = "ut"
NEGATION = "ne"
QUESTION = "esk"
AUXILIARIES = ("ha", "han")
PRONOUNS = ("on", "oni")
FUNCTION_WORDS: tuple[str, ...] = (
    *DETERMINERS[SG], *DETERMINERS[PL], *PREPOSITIONS, *CONJUNCTIONS, *SUBORDINATORS,
    RELATIVE, COMPLEMENTIZER, NEGATION, QUESTION, *AUXILIARIES, *PRONOUNS,
)

FRAME_INTRANSITIVE, FRAME_TRANSITIVE, FRAME_CLAUSAL = 0, 1, 2


@dataclass(frozen=True)
class Lexicon:
    """All words of the language; list position is frequency rank within the category (0 = commonest)."""

    noun_forms: tuple[tuple[str, ...], tuple[str, ...]]  # [number][noun]
    verb_forms: tuple[tuple[str, ...], tuple[str, ...]]  # [number][verb]
    participles: tuple[str, ...]
    verb_frames: tuple[int, ...]
    adjectives: tuple[str, ...]
    adverbs: tuple[str, ...]
    names: tuple[str, ...]

    @property
    def num_lexemes(self) -> int:
        return (len(self.noun_forms[SG]) + len(self.verb_frames) + len(self.adjectives) + len(self.adverbs)
                + len(self.names) + len(FUNCTION_WORDS))

    def surface_forms(self) -> dict[str, tuple[str, int | None]]:
        """Map each lowercase surface form to ``(category, number)``; number is None where it has none."""
        table: dict[str, tuple[str, int | None]] = {}
        for num in (SG, PL):
            for word in self.noun_forms[num]:
                table[word] = ("noun", num)
            for word in self.verb_forms[num]:
                table[word] = ("verb", num)
            for word in DETERMINERS[num]:
                table[word] = ("det", num)
            table[AUXILIARIES[num]] = ("aux", num)
            table[PRONOUNS[num]] = ("pron", num)
        for word in self.participles:
            table[word] = ("participle", None)
        for word in self.adjectives:
            table[word] = ("adj", None)
        for word in self.adverbs:
            table[word] = ("adv", None)
        for word in self.names:
            table[word.lower()] = ("name", SG)
        for word in PREPOSITIONS:
            table[word] = ("prep", None)
        for word in (*CONJUNCTIONS, *SUBORDINATORS):
            table[word] = ("conj", None)
        for word in (RELATIVE, COMPLEMENTIZER, NEGATION, QUESTION):
            table[word] = ("particle", None)
        return table


def _cumulative_edges(weights: Sequence[float]) -> tuple[list[float], float]:
    """Running sums without the last one: ``bisect_right(edges, u * total)`` is then always in range."""
    edges: list[float] = []
    acc = 0.0
    for w in weights:
        acc += w
        edges.append(acc)
    return edges[:-1], acc


def _zipf_weights(n: int, offset: float = 2.7) -> list[float]:
    # Exponent 1 keeps this to one correctly rounded division per rank: no libm pow whose last bit could
    # differ between platforms.
    return [1.0 / (rank + offset) for rank in range(n)]


T = TypeVar("T")


class _IntChoice(Generic[T]):
    """Weighted choice over a small hand-written table of integer weights."""

    def __init__(self, table: Sequence[tuple[T, int]]) -> None:
        self.items = [item for item, _ in table]
        self.edges: list[int] = []
        self.total = 0
        for _, weight in table:
            self.total += weight
            self.edges.append(self.total)
        self.edges.pop()


class _LexiconBuilder:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.taken: set[str] = set(FUNCTION_WORDS)  # membership only; never iterated
        self.onsets = _IntChoice(_ONSETS)
        self.vowels = _IntChoice(_VOWELS)
        self.codas = _IntChoice(_CODAS)
        self.syllable_counts = _IntChoice(_SYLLABLE_COUNTS)

    def _draw(self, c: _IntChoice[T]) -> T:
        return c.items[bisect_right(c.edges, int(self.rng.random() * c.total))]

    def stem(self, min_syllables: int = 1) -> str:
        count = max(self._draw(self.syllable_counts), min_syllables)
        return "".join(
            self._draw(self.onsets) + self._draw(self.vowels) + self._draw(self.codas) for _ in range(count)
        )

    def fresh(self, make: Callable[[str], tuple[str, ...] | None], min_syllables: int = 1) -> tuple[str, ...]:
        """Draw stems until every form ``make(stem)`` yields is new, so forms never become ambiguous."""
        while True:
            forms = make(self.stem(min_syllables))
            if forms is None or len(set(forms)) != len(forms):
                continue
            if any(len(f) < 2 or f.lower() in self.taken for f in forms):
                continue
            self.taken.update(f.lower() for f in forms)
            return forms

    def rank(self, entries: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
        """Order by length plus noise so that frequent (low-rank) words tend to be short."""
        noise = self.rng.random(len(entries)).tolist()
        keys = [(len(e[0]) + 4.0 * noise[i], i) for i, e in enumerate(entries)]
        return [entries[i] for _, i in sorted(keys)]


def _noun_class_a(stem: str) -> tuple[str, str]:
    return (stem, stem + "i")


def _noun_class_b(stem: str) -> tuple[str, str]:
    return (stem + "u", stem + "ar")


def _verb_class_a(stem: str) -> tuple[str, str, str] | None:
    if stem.endswith("s"):  # "-ss" would blur the singular marker
        return None
    return (stem + "s", stem, stem + "ado")


def _verb_class_b(stem: str) -> tuple[str, str, str]:
    return (stem + "et", stem + "on", stem + "ido")


@lru_cache(maxsize=1)
def get_lexicon() -> Lexicon:
    """The fixed lexicon of the language (built once per process, identical everywhere)."""
    b = _LexiconBuilder(_LEXICON_SEED)

    nouns = [b.fresh(_noun_class_a if b.rng.random() < 0.6 else _noun_class_b) for _ in range(N_NOUNS)]
    nouns = b.rank(nouns)
    # Suppletive plurals only on the commonest nouns: irregularity survives where it is heard most.
    for i in range(N_IRREGULAR_NOUNS):
        nouns[i] = (nouns[i][0], b.fresh(lambda s: (s,))[0])

    frames: list[int] = []
    verbs: list[tuple[str, ...]] = []
    for frame, count in ((FRAME_INTRANSITIVE, N_INTRANSITIVE), (FRAME_TRANSITIVE, N_TRANSITIVE),
                         (FRAME_CLAUSAL, N_CLAUSAL)):
        group = [b.fresh(_verb_class_a if b.rng.random() < 0.55 else _verb_class_b) for _ in range(count)]
        verbs.extend(b.rank(group))
        frames.extend([frame] * count)

    adjectives = [f[0] for f in b.rank([b.fresh(lambda s: (s,)) for _ in range(N_ADJECTIVES)])]
    adverbs = [f[0] for f in b.rank([b.fresh(lambda s: (s + "mo",)) for _ in range(N_ADVERBS)])]
    names = [f[0] for f in b.rank([b.fresh(lambda s: (s.capitalize(),), min_syllables=2)
                                    for _ in range(N_NAMES)])]
    return Lexicon(
        noun_forms=(tuple(n[0] for n in nouns), tuple(n[1] for n in nouns)),
        verb_forms=(tuple(v[0] for v in verbs), tuple(v[1] for v in verbs)),
        participles=tuple(v[2] for v in verbs),
        verb_frames=tuple(frames),
        adjectives=tuple(adjectives),
        adverbs=tuple(adverbs),
        names=tuple(names),
    )


# ---------------------------------------------------------------------------------------------------------
# Sampling tables
# ---------------------------------------------------------------------------------------------------------


class _Choice(Generic[T]):
    """A fixed distribution over ``items`` sampled by inverse CDF on one uniform draw."""

    __slots__ = ("items", "edges", "total")

    def __init__(self, items: Sequence[T], weights: Sequence[float]) -> None:
        self.items = list(items)
        self.edges, self.total = _cumulative_edges(weights)


@dataclass(frozen=True)
class _Tables:
    lexicon: Lexicon
    nouns: _Choice[int]  # items are lexeme ids
    verbs: tuple[_Choice[int], ...]  # [frame]
    adjectives: _Choice[int]
    adverbs: _Choice[str]
    names: _Choice[str]
    prepositions: _Choice[str]
    conjunctions: _Choice[str]
    subordinators: _Choice[str]
    determiners: tuple[_Choice[str], _Choice[str]]
    topic_nouns: tuple[_Choice[int], ...]
    topic_verbs: tuple[tuple[_Choice[int], ...], tuple[_Choice[int], ...]]  # [frame][topic], intr/trans only
    topic_adjectives: tuple[_Choice[int], ...]


@lru_cache(maxsize=1)
def _tables() -> _Tables:
    lex = get_lexicon()
    rng = np.random.Generator(np.random.PCG64(_LEXICON_SEED + 1))

    def topical(ids: list[int], size: int) -> tuple[_Choice[int], ...]:
        # Each topic favours its own random subset, with its own Zipf ranking inside the subset.
        out = []
        for _ in range(N_TOPICS):
            pool = list(ids)
            for i, u in enumerate(rng.random(size).tolist()):  # partial Fisher-Yates shuffle
                j = i + int(u * (len(pool) - i))
                pool[i], pool[j] = pool[j], pool[i]
            out.append(_Choice(pool[:size], _zipf_weights(size, 1.5)))
        return tuple(out)

    by_frame = [[i for i, f in enumerate(lex.verb_frames) if f == frame] for frame in range(3)]
    noun_ids = list(range(len(lex.noun_forms[SG])))
    adj_ids = list(range(len(lex.adjectives)))
    return _Tables(
        lexicon=lex,
        nouns=_Choice(noun_ids, _zipf_weights(len(noun_ids))),
        verbs=tuple(_Choice(ids, _zipf_weights(len(ids))) for ids in by_frame),
        adjectives=_Choice(adj_ids, _zipf_weights(len(adj_ids))),
        adverbs=_Choice(lex.adverbs, _zipf_weights(len(lex.adverbs))),
        names=_Choice(lex.names, _zipf_weights(len(lex.names))),
        prepositions=_Choice(PREPOSITIONS, _zipf_weights(len(PREPOSITIONS), 1.0)),
        conjunctions=_Choice(CONJUNCTIONS, (5, 3, 2)),
        subordinators=_Choice(SUBORDINATORS, (3, 3, 2)),
        determiners=(_Choice(DETERMINERS[SG], _DETERMINER_WEIGHTS[SG]),
                     _Choice(DETERMINERS[PL], _DETERMINER_WEIGHTS[PL])),
        topic_nouns=topical(noun_ids, _TOPIC_SIZES["noun"]),
        topic_verbs=(topical(by_frame[0], _TOPIC_SIZES["intr"]), topical(by_frame[1], _TOPIC_SIZES["trans"])),
        topic_adjectives=topical(adj_ids, _TOPIC_SIZES["adj"]),
    )


# ---------------------------------------------------------------------------------------------------------
# Grammar
# ---------------------------------------------------------------------------------------------------------

MAX_DEPTH = 3
MAX_CLAUSE_DEPTH = 2
# Post-modifier probability by depth; subjects get more of them so agreement spans longer distances.
_P_POST_SUBJECT = (0.6, 0.3, 0.12)
_P_POST_OTHER = (0.3, 0.18, 0.08)
_P_RC_GIVEN_POST = 0.5
_P_SUBJECT_RC = 0.55
_P_ONE_ADJ, _P_TWO_ADJ = 0.35, 0.08
_P_NAME = 0.06
_P_PRONOUN = 0.08
_P_CACHED_NOUN, _P_TOPIC_NOUN = 0.2, 0.55
_P_TOPIC_VERB, _P_TOPIC_ADJ = 0.55, 0.5
_P_CLAUSAL, _P_TRANSITIVE = 0.08, 0.5
_P_NEGATION, _P_PERFECT = 0.06, 0.15
_P_ADVERB, _P_INTR_PP = 0.2, 0.35
_P_QUESTION, _P_EXCLAMATION = 0.06, 0.03
_P_FRONT_SUBORD, _P_FRONT_PP = 0.07, 0.07
_P_COORD, _P_TRAIL_SUBORD = 0.12, 0.07
_P_PARAGRAPH = 0.12
_BUFFER = 512


class _Writer:
    """Generates one document; all randomness comes from one PCG64 stream consumed in a fixed order."""

    def __init__(self, tables: _Tables, rng: np.random.Generator, annotate: bool = False) -> None:
        self.t = tables
        self.lex = tables.lexicon
        self.rng = rng
        self.buf: list[float] = []
        self.i = _BUFFER
        self.records: list[tuple[int, int]] | None = [] if annotate else None
        self.topic = 0
        self.cache: list[int] = []
        self.cast: list[str] = []
        self.sentences = 0

    # Uniforms are drawn in blocks: one numpy call per 512 draws instead of one per word.
    def u(self) -> float:
        i = self.i
        if i == _BUFFER:
            self.buf = self.rng.random(_BUFFER).tolist()
            i = 0
        self.i = i + 1
        return self.buf[i]

    def pick(self, c: _Choice[T]) -> T:
        return c.items[bisect_right(c.edges, self.u() * c.total)]

    def number(self) -> int:
        return PL if self.u() < _P_PLURAL else SG

    def noun(self, num: int) -> str:
        r = self.u()
        if r < _P_CACHED_NOUN and self.cache:
            lexeme = self.cache[int(self.u() * len(self.cache))]
        elif r < _P_CACHED_NOUN + _P_TOPIC_NOUN:
            lexeme = self.pick(self.t.topic_nouns[self.topic])
        else:
            lexeme = self.pick(self.t.nouns)
        self.cache.append(lexeme)
        return self.lex.noun_forms[num][lexeme]

    def adjective(self) -> str:
        c = self.t.topic_adjectives[self.topic] if self.u() < _P_TOPIC_ADJ else self.t.adjectives
        return self.lex.adjectives[self.pick(c)]

    def verb_lexeme(self, frame: int) -> int:
        if frame != FRAME_CLAUSAL and self.u() < _P_TOPIC_VERB:
            return self.pick(self.t.topic_verbs[frame][self.topic])
        return self.pick(self.t.verbs[frame])

    def verb(self, frame: int, num: int, out: list[str]) -> int:
        """Append a finite verb group; return the position of the word that carries agreement."""
        if self.u() < _P_NEGATION:
            out.append(NEGATION)
        lexeme = self.verb_lexeme(frame)
        if self.u() < _P_PERFECT:
            out.append(AUXILIARIES[num])
            out.append(self.lex.participles[lexeme])
            return len(out) - 2
        out.append(self.lex.verb_forms[num][lexeme])
        return len(out) - 1

    def np(self, num: int, depth: int, out: list[str], post: tuple[float, ...]) -> int:
        """Append a noun phrase; return the position of its head."""
        if num == SG and self.u() < _P_NAME:
            if not self.cast:
                self.cast = [self.pick(self.t.names), self.pick(self.t.names)]
            out.append(self.cast[int(self.u() * 2)])
            return len(out) - 1
        out.append(self.pick(self.t.determiners[num]))
        r = self.u()
        if r < _P_ONE_ADJ:
            out.append(self.adjective())
            if r < _P_TWO_ADJ:
                out.append(self.adjective())
        out.append(self.noun(num))
        head = len(out) - 1
        if depth < MAX_DEPTH and self.u() < post[depth]:
            if self.u() < _P_RC_GIVEN_POST:
                self.rc(num, depth + 1, head, out)
            else:
                self.pp(depth + 1, out)
        return head

    def pp(self, depth: int, out: list[str]) -> None:
        out.append(self.pick(self.t.prepositions))
        self.np(self.number(), depth, out, _P_POST_OTHER)

    def rc(self, num: int, depth: int, head: int, out: list[str]) -> None:
        out.append(RELATIVE)
        if self.u() < _P_SUBJECT_RC:
            agree = self.vp(num, depth, out)
            if self.records is not None:
                self.records.append((head, agree))
        else:
            inner_num = self.number()
            inner_head = self.np(inner_num, depth, out, _P_POST_OTHER)
            agree = self.verb(FRAME_TRANSITIVE, inner_num, out)
            if self.records is not None:
                self.records.append((inner_head, agree))

    def vp(self, num: int, depth: int, out: list[str]) -> int:
        r = self.u()
        if r < _P_CLAUSAL and depth < MAX_CLAUSE_DEPTH:
            agree = self.verb(FRAME_CLAUSAL, num, out)
            out.append(COMPLEMENTIZER)
            self.clause(depth + 1, out)
        elif r < _P_CLAUSAL + _P_TRANSITIVE:
            agree = self.verb(FRAME_TRANSITIVE, num, out)
            self.np(self.number(), depth + 1, out, _P_POST_OTHER)
            if self.u() < _P_ADVERB:
                out.append(self.pick(self.t.adverbs))
        else:
            agree = self.verb(FRAME_INTRANSITIVE, num, out)
            if self.u() < _P_ADVERB:
                out.append(self.pick(self.t.adverbs))
            if depth < MAX_DEPTH and self.u() < _P_INTR_PP:
                self.pp(depth + 1, out)
        return agree

    def clause(self, depth: int, out: list[str]) -> None:
        num = self.number()
        if self.sentences and self.u() < _P_PRONOUN:
            out.append(PRONOUNS[num])
            head = len(out) - 1
        else:
            head = self.np(num, depth, out, _P_POST_SUBJECT)
        agree = self.vp(num, depth, out)
        if self.records is not None:
            self.records.append((head, agree))

    def sentence(self) -> list[str]:
        out: list[str] = []
        r = self.u()
        ending = "?" if r < _P_QUESTION else "!" if r < _P_QUESTION + _P_EXCLAMATION else "."
        if ending == "?":
            out.append(QUESTION)
        r = self.u()
        if r < _P_FRONT_SUBORD:
            out.append(self.pick(self.t.subordinators))
            self.clause(1, out)
            out[-1] += ","
        elif r < _P_FRONT_SUBORD + _P_FRONT_PP:
            self.pp(1, out)
            out[-1] += ","
        self.clause(0, out)
        r = self.u()
        if r < _P_COORD:
            out[-1] += ","
            out.append(self.pick(self.t.conjunctions))
            self.clause(1, out)
        elif r < _P_COORD + _P_TRAIL_SUBORD:
            out.append(self.pick(self.t.subordinators))
            self.clause(1, out)
        out[-1] += ending
        out[0] = out[0][0].upper() + out[0][1:]
        self.sentences += 1
        return out

    def document(self, sink: list[AnnotatedSentence] | None = None) -> str:
        self.topic = int(self.u() * N_TOPICS)
        # A fourth power skews lengths towards short documents while keeping a long tail.
        v = self.u()
        target = MIN_DOCUMENT_CHARS + int((MAX_DOCUMENT_CHARS - MIN_DOCUMENT_CHARS) * v * v * v * v)
        parts: list[str] = []
        total = 0
        while total < target:
            if self.records is not None:
                self.records = []
            tokens = self.sentence()
            text = " ".join(tokens)
            sep = "" if not parts else ("\n" if self.u() < _P_PARAGRAPH else " ")
            if total + len(sep) + len(text) > MAX_DOCUMENT_CHARS:
                if total >= MIN_DOCUMENT_CHARS:
                    break
                continue
            parts.append(sep)
            parts.append(text)
            total += len(sep) + len(text)
            if sink is not None and self.records is not None:
                sink.append(AnnotatedSentence(tuple(tokens), tuple(self.records)))
        return "".join(parts)


# ---------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AnnotatedSentence:
    """Tokens as joined into the text (punctuation attached, first word capitalised) plus agreement links.

    Each link is ``(subject_head_position, agreeing_verb_position)``; the agreeing word is the finite verb
    or, in the perfect, the auxiliary.
    """

    tokens: tuple[str, ...]
    agreements: tuple[tuple[int, int], ...]


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
