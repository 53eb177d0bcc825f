"""The embedded synthetic corpus: determinism, sizes, vocabulary, agreement and the datasets wrapper."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import datasets
import pytest

from p2p_diloco.data import corpus
from p2p_diloco.data.corpus import (
    CORPUS_VERSION,
    FUNCTION_WORDS,
    MAX_DOCUMENT_CHARS,
    MIN_DOCUMENT_CHARS,
    SPLIT_SIZES,
    agreement_probe,
    annotate_document,
    generate_documents,
    get_lexicon,
    load_embedded_corpus,
)

PUNCTUATION = ",.?!"
# Pinned output: if this changes, the grammar changed, and CORPUS_VERSION must change with it so that no peer
# mixes cached data from two grammars.
GOLDEN_VERSION = "synthlang-1"
GOLDEN_DIGEST = "946ec8a323fb8d90130173a5e9c22fccd0c44fa57b6321010fcfaaa0fc459bcc"


def _digest(docs: list[str]) -> str:
    return hashlib.sha256("\x00".join(docs).encode("ascii")).hexdigest()


def _word(token: str) -> str:
    return token.strip(PUNCTUATION).lower()


@pytest.fixture(scope="module")
def splits() -> dict[str, tuple[list[str], float]]:
    out = {}
    for split in ("train", "eval"):
        start = time.perf_counter()
        docs = list(generate_documents(split))
        out[split] = (docs, time.perf_counter() - start)
    return out


@pytest.fixture(scope="module")
def forms() -> dict[str, tuple[str, int | None]]:
    return get_lexicon().surface_forms()


def test_lexicon_size_and_unambiguous_forms(forms: dict[str, tuple[str, int | None]]) -> None:
    lex = get_lexicon()
    assert 2_000 <= lex.num_lexemes <= 4_000
    expected = (2 * len(lex.noun_forms[0]) + 3 * len(lex.verb_frames) + len(lex.adjectives)
                + len(lex.adverbs) + len(lex.names) + len(FUNCTION_WORDS))
    # Equal counts mean no two lexemes or inflections share a spelling.
    assert len(forms) == expected
    for word in forms:
        assert word.isascii() and word.isalpha() and word == word.lower()
    assert all(name[0].isupper() and name[1:].islower() for name in lex.names)


def test_generation_is_deterministic_and_random_access() -> None:
    first = list(generate_documents("train", 40))
    assert first == list(generate_documents("train", 40))
    assert list(generate_documents("train", 5, start=17)) == first[17:22]
    assert first != list(generate_documents("train", 40, seed=1))


def test_same_output_in_a_fresh_process() -> None:
    code = (
        "import hashlib; from p2p_diloco.data.corpus import generate_documents as g;"
        "print(hashlib.sha256('\\x00'.join(g('eval', 30)).encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == _digest(list(generate_documents("eval", 30)))


def test_golden_digest() -> None:
    assert CORPUS_VERSION == GOLDEN_VERSION, "update GOLDEN_DIGEST together with CORPUS_VERSION"
    assert _digest(list(generate_documents("train", 20))) == GOLDEN_DIGEST


def test_split_sizes_and_disjointness(splits: dict[str, tuple[list[str], float]]) -> None:
    # (how long generating a split takes is a benchmark figure, not a test: timed asserts fail on loaded CI)
    train, _ = splits["train"]
    evaluation, _ = splits["eval"]
    assert len(train) == SPLIT_SIZES["train"] and len(evaluation) == SPLIT_SIZES["eval"]
    assert 8_000_000 <= sum(map(len, train)) <= 12_000_000
    assert 300_000 <= sum(map(len, evaluation)) <= 500_000
    assert not set(train) & set(evaluation)
    assert len(set(train)) == len(train)


def test_documents_are_ascii_well_formed_and_in_vocabulary(
    splits: dict[str, tuple[list[str], float]], forms: dict[str, tuple[str, int | None]]
) -> None:
    for doc in splits["eval"][0]:
        assert doc.isascii()
        assert MIN_DOCUMENT_CHARS <= len(doc) <= MAX_DOCUMENT_CHARS
        assert doc[0].isupper() and doc[-1] in ".?!"
        for token in doc.split():
            assert _word(token) in forms, token
    train_docs = splits["train"][0]
    assert all(doc.isascii() and MIN_DOCUMENT_CHARS <= len(doc) <= MAX_DOCUMENT_CHARS for doc in train_docs)


def test_annotation_matches_text_and_agreement_holds(forms: dict[str, tuple[str, int | None]]) -> None:
    plain = list(generate_documents("eval", 150))
    links = long_links = attracted = 0
    for index, text in enumerate(plain):
        doc = annotate_document("eval", index)
        assert doc.text == text
        for sentence in doc.sentences:
            assert " ".join(sentence.tokens) in text
            words = [_word(t) for t in sentence.tokens]
            agreeing = {v for _, v in sentence.agreements}
            # Every finite verb or auxiliary is the target of exactly one agreement link.
            finite = [i for i, w in enumerate(words) if forms[w][0] in ("verb", "aux")]
            assert sorted(agreeing) == finite and len(agreeing) == len(sentence.agreements)
            for head, verb in sentence.agreements:
                assert forms[words[head]][0] in ("noun", "pron", "name")
                assert forms[words[head]][1] == forms[words[verb]][1]
                links += 1
                long_links += verb - head > 3
                attracted += any(
                    forms[w][0] == "noun" and forms[w][1] != forms[words[head]][1]
                    for w in words[head + 1:verb]
                )
    assert links > 1_000
    assert long_links / links > 0.2  # agreement often spans several words
    assert attracted / links > 0.1  # and often crosses a noun of the other number


def test_determiners_agree_with_their_nouns(
    splits: dict[str, tuple[list[str], float]], forms: dict[str, tuple[str, int | None]]
) -> None:
    checked = 0
    for doc in splits["eval"][0][:200]:
        words = [_word(t) for t in doc.split()]
        for i, w in enumerate(words):
            if forms[w][0] != "det":
                continue
            j = i + 1
            while forms[words[j]][0] == "adj":
                j += 1
            assert forms[words[j]] == ("noun", forms[w][1])
            checked += 1
    assert checked > 1_000


def test_agreement_probe(forms: dict[str, tuple[str, int | None]]) -> None:
    pairs = agreement_probe(64, min_intervening_words=4)
    assert pairs == agreement_probe(64, min_intervening_words=4)
    assert sum(p.subject_number == "singular" for p in pairs) == 32
    for pair in pairs:
        good, bad = pair.grammatical.split(), pair.ungrammatical.split()
        assert len(good) == len(bad) and sum(g != b for g, b in zip(good, bad, strict=True)) == 1
        assert good[1:] == bad[1:]
        subject = 0 if pair.subject_number == "singular" else 1
        assert forms[_word(good[0])] == ("verb", subject)
        assert forms[_word(bad[0])] == ("verb", 1 - subject)
        prefix = [_word(t) for t in pair.prefix.split()]
        assert forms[prefix[0]] == ("det", subject)
        assert pair.intervening_words >= 4
        assert any(forms[w] == ("noun", 1 - subject) for w in prefix[2:])  # an attractor is present
        good_sentence, bad_sentence = pair.sentences
        assert good_sentence.endswith(".") and good_sentence != bad_sentence


def test_load_embedded_corpus_is_a_cached_dataset(tmp_path) -> None:
    assert os.environ.get("HF_DATASETS_OFFLINE") == "1"
    ds = load_embedded_corpus("eval", num_documents=60, cache_dir=str(tmp_path))
    assert isinstance(ds, datasets.Dataset)
    assert ds.column_names == ["text"] and len(ds) == 60
    assert ds["text"] == list(generate_documents("eval", 60))
    again = load_embedded_corpus("eval", num_documents=60, cache_dir=str(tmp_path))
    assert [f["filename"] for f in again.cache_files] == [f["filename"] for f in ds.cache_files]
    other = load_embedded_corpus("eval", num_documents=60, seed=3, cache_dir=str(tmp_path))
    assert other["text"] != ds["text"]


def test_unknown_split_is_rejected() -> None:
    with pytest.raises(ValueError):
        next(generate_documents("test"))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        load_embedded_corpus("validation")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        next(corpus._rows("eval", 1, 0, "synthlang-0"))
