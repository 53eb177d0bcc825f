"""Local datasets: a folder may mix file kinds, and a file that cannot be read is named with its cause."""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets
import pytest

from p2p_diloco.data.sources import DataSourceError, open_text_dataset


def _texts(dataset: str) -> list[str]:
    return [row["text"] for split in ("train", "eval") for row in open_text_dataset(dataset, split)]


def test_a_folder_mixing_jsonl_parquet_and_txt_is_read_whole(tmp_path: Path) -> None:
    with open(tmp_path / "a.jsonl", "w") as f:
        for i in range(50):
            f.write(json.dumps({"text": f"json line {i}", "id": i}) + "\n")
    nested = tmp_path / "more"
    nested.mkdir()
    datasets.Dataset.from_dict({"text": [f"parquet row {i}" for i in range(40)],
                                "score": [0.5] * 40}).to_parquet(str(nested / "b.parquet"))
    (tmp_path / "c.txt").write_text("".join(f"text line {i}\n" for i in range(30)))
    texts = _texts(str(tmp_path))
    assert sorted(texts) == sorted([f"json line {i}" for i in range(50)] + [f"parquet row {i}" for i in range(40)]
                                   + [f"text line {i}" for i in range(30)])


def test_empty_txt_is_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataSourceError, match=r"dataset file '.*empty\.txt' is empty"):
        open_text_dataset(str(empty), "train")


def test_binary_txt_is_named_with_the_offending_byte(tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("hello\nworld\n" * 20)
    binary = tmp_path / "photo.txt"
    binary.write_bytes(b"ok\n" + os.urandom(16).replace(b"\n", b"") + b"\xff\xfe\x00\x8c" * 64)
    with pytest.raises(DataSourceError) as info:
        open_text_dataset(str(tmp_path), "train")
    message = str(info.value)
    assert "photo.txt" in message and "is not UTF-8 text" in message and "binary" in message, message
    assert "good.txt" not in message
