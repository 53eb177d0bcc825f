"""The grammar of the embedded corpus: sampling tables over the lexicon and the document writer.

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

Word frequencies within each category follow the Zipf-Mandelbrot weights built here over the lexicon's
rank order.  Every draw comes from one PCG64 stream per document, consumed in a fixed order, through
``Generator.random()`` only: reordering or adding a draw changes the corpus text and needs a new
``CORPUS_VERSION`` (see ``corpus``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Generic, TypeVar

import numpy as np

from p2p_diloco.data.lexicon import (
    _DETERMINER_WEIGHTS,
    _LEXICON_SEED,
    AUXILIARIES,
    COMPLEMENTIZER,
    CONJUNCTIONS,
    DETERMINERS,
    FRAME_CLAUSAL,
    FRAME_INTRANSITIVE,
    FRAME_TRANSITIVE,
    NEGATION,
    PL,
    PREPOSITIONS,
    PRONOUNS,
    QUESTION,
    RELATIVE,
    SG,
    SUBORDINATORS,
    Lexicon,
    get_lexicon,
)

MIN_DOCUMENT_CHARS = 200
MAX_DOCUMENT_CHARS = 1_500
_P_PLURAL = 0.42

N_TOPICS = 40
_TOPIC_SIZES = {"noun": 60, "intr": 20, "trans": 30, "adj": 24}

# ---------------------------------------------------------------------------------------------------------
# Sampling tables
# ---------------------------------------------------------------------------------------------------------


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
        determiners=(
            _Choice(DETERMINERS[SG], _DETERMINER_WEIGHTS[SG]),
            _Choice(DETERMINERS[PL], _DETERMINER_WEIGHTS[PL]),
        ),
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


@dataclass(frozen=True)
class AnnotatedSentence:
    """Tokens as joined into the text (punctuation attached, first word capitalised) plus agreement links.

    Each link is ``(subject_head_position, agreeing_verb_position)``; the agreeing word is the finite verb
    or, in the perfect, the auxiliary.
    """

    tokens: tuple[str, ...]
    agreements: tuple[tuple[int, int], ...]


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
