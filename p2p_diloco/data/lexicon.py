"""The fixed lexicon of the embedded corpus's invented language: word forms, categories and ranks.

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

The lexicon depends on nothing but ``_LEXICON_SEED``, so every process builds the same one; changing a table
or a count here changes the corpus text and needs a new ``CORPUS_VERSION`` (see ``corpus``).  How often each
word is drawn, and which words a topic favours, is decided by the sampling tables in ``grammar``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Generic, TypeVar

import numpy as np

_LEXICON_SEED = 0x5EED_1E81

SG, PL = 0, 1

# Rows of (spelling, weight) read best as a table, so the formatter leaves them as written.
# fmt: off
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
# fmt: on
_SYLLABLE_COUNTS: tuple[tuple[int, int], ...] = ((1, 2), (2, 6), (3, 4), (4, 1))

N_NOUNS = 1_200
N_IRREGULAR_NOUNS = 24
N_INTRANSITIVE = 260
N_TRANSITIVE = 400
N_CLAUSAL = 40
N_ADJECTIVES = 450
N_ADVERBS = 120
N_NAMES = 100

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
    *DETERMINERS[SG],
    *DETERMINERS[PL],
    *PREPOSITIONS,
    *CONJUNCTIONS,
    *SUBORDINATORS,
    RELATIVE,
    COMPLEMENTIZER,
    NEGATION,
    QUESTION,
    *AUXILIARIES,
    *PRONOUNS,
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
        return (
            len(self.noun_forms[SG])
            + len(self.verb_frames)
            + len(self.adjectives)
            + len(self.adverbs)
            + len(self.names)
            + len(FUNCTION_WORDS)
        )

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
    for frame, count in (
        (FRAME_INTRANSITIVE, N_INTRANSITIVE),
        (FRAME_TRANSITIVE, N_TRANSITIVE),
        (FRAME_CLAUSAL, N_CLAUSAL),
    ):
        group = [b.fresh(_verb_class_a if b.rng.random() < 0.55 else _verb_class_b) for _ in range(count)]
        verbs.extend(b.rank(group))
        frames.extend([frame] * count)

    adjectives = [f[0] for f in b.rank([b.fresh(lambda s: (s,)) for _ in range(N_ADJECTIVES)])]
    adverbs = [f[0] for f in b.rank([b.fresh(lambda s: (s + "mo",)) for _ in range(N_ADVERBS)])]
    names = [
        f[0] for f in b.rank([b.fresh(lambda s: (s.capitalize(),), min_syllables=2) for _ in range(N_NAMES)])
    ]
    return Lexicon(
        noun_forms=(tuple(n[0] for n in nouns), tuple(n[1] for n in nouns)),
        verb_forms=(tuple(v[0] for v in verbs), tuple(v[1] for v in verbs)),
        participles=tuple(v[2] for v in verbs),
        verb_frames=tuple(frames),
        adjectives=tuple(adjectives),
        adverbs=tuple(adverbs),
        names=tuple(names),
    )
