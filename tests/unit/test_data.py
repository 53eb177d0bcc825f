"""Data sources through `datasets`, per-peer sharding and packing."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from p2p_diloco.data.loader import DataPosition, PeerTokenStream, eval_batches, peer_start_shard
from p2p_diloco.data.sources import DataSourceError, open_text_dataset
from p2p_diloco.data.tokenizer import ByteTokenizer

DOCS = [f"document number {i} says hello to the swarm." for i in range(300)]


def _write(tmp_path, kind: str):
    if kind == "txt":
        p = tmp_path / "data.txt"
        p.write_text("\n".join(DOCS) + "\n")
    elif kind == "jsonl":
        p = tmp_path / "data.jsonl"
        p.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    else:
        p = tmp_path / "data.parquet"
        pq.write_table(pa.table({"text": DOCS}), p)
    return p


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_local_sources_split_train_and_held_out(tmp_path, kind: str) -> None:
    path = _write(tmp_path, kind)
    train = open_text_dataset(str(path), "train")
    held = open_text_dataset(str(path), "eval")
    assert len(train) + len(held) == len(DOCS)
    assert len(held) >= 1
    assert set(train["text"]).isdisjoint(held["text"])
    assert set(train["text"]) | set(held["text"]) == set(DOCS)


def test_folder_source_and_errors(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.txt").write_text("\n".join(DOCS[:150]))
    (tmp_path / "a" / "two.txt").write_text("\n".join(DOCS[150:]))
    assert len(open_text_dataset(str(tmp_path / "a"), "train")) > 250
    with pytest.raises(DataSourceError, match="neither 'embedded'"):
        open_text_dataset(str(tmp_path / "missing.txt"), "train")
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "x"}) + "\n" + json.dumps({"body": "y"}) + "\n")
    with pytest.raises(DataSourceError, match="no column 'text'"):
        open_text_dataset(str(tmp_path / "b.jsonl"), "train")


def test_embedded_source_has_disjoint_held_out_split() -> None:
    train = open_text_dataset("embedded", "train")
    held = open_text_dataset("embedded", "eval")
    assert len(train) > 10 * len(held) > 0
    assert set(held["text"][:200]).isdisjoint(train["text"][:5000])


def _docs_read(stream: PeerTokenStream, n_batches: int, tok: ByteTokenizer) -> set[str]:
    text = "".join(tok.decode(stream.next_batch().flatten().tolist()) for _ in range(n_batches))
    return {d.strip() for d in text.split("\x00") if d.strip()}


def test_two_peers_read_disjoint_data(tmp_path) -> None:
    train = open_text_dataset(str(_write(tmp_path, "jsonl")), "train")
    tok = ByteTokenizer()
    ids = ("12D3KooWPeerAlpha", "12D3KooWPeerBravo")
    assert peer_start_shard(ids[0], 16) != peer_start_shard(ids[1], 16)
    rows = []
    for pid in ids:
        s = PeerTokenStream(train, tok, seq_len=32, batch_size=2, peer_id=pid, num_shards=16)
        s.next_batch()
        s.next_batch()
        # rows of the shards this peer walked so far
        rows.append({int(r) for w in range(s.position.walk + 1) for r in s.shard_rows(w)[: s.position.row or None]})
    assert rows[0] and rows[1]
    assert rows[0].isdisjoint(rows[1])


def test_stream_resumes_from_position(tmp_path) -> None:
    train = open_text_dataset(str(_write(tmp_path, "jsonl")), "train")
    tok = ByteTokenizer()
    a = PeerTokenStream(train, tok, seq_len=16, batch_size=2, peer_id="p", num_shards=4)
    for _ in range(5):
        a.next_batch()
    saved = DataPosition.from_dict(a.position.as_dict())
    b = PeerTokenStream(train, tok, seq_len=16, batch_size=2, peer_id="p", num_shards=4, position=saved)
    a_next = tok.decode(a.next_batch().flatten().tolist())
    b_next = tok.decode(b.next_batch().flatten().tolist())
    # b skips what a had buffered but not trained on, then reads the same rows: its text is in a's future.
    future = "".join(tok.decode(a.next_batch().flatten().tolist()) for _ in range(30))
    assert b_next[-20:] in a_next + future
    with pytest.raises(ValueError):
        DataPosition.from_dict({"walk": -1, "row": 0})


def test_eval_batches_are_deterministic_and_shaped() -> None:
    held = open_text_dataset("embedded", "eval")
    tok = ByteTokenizer()
    a = eval_batches(held, tok, seq_len=64, batch_size=4, num_batches=3)
    b = eval_batches(held, tok, seq_len=64, batch_size=4, num_batches=3)
    assert len(a) == 3 and a[0].shape == (4, 64)
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
