"""Hugging Face assets the tests make themselves (tests never download): a real byte-level BPE tokenizer
trained with the ``tokenizers`` library, a dataset folder laid out like a hub dataset repository, and a
reader for the run files W&B writes in offline mode."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from p2p_diloco.data.corpus import load_embedded_corpus


def corpus(split: str, rows: int) -> list[str]:
    return list(load_embedded_corpus(split)["text"][:rows])


def make_bpe_tokenizer(folder: Path, texts: Sequence[str], vocab_size: int = 384) -> Path:
    """Train a byte-level BPE tokenizer on ``texts`` and save it as a fast tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>").save_pretrained(str(folder))
    return folder


def make_hub_dataset(folder: Path, train: Sequence[str], validation: Sequence[str], shards: int = 2) -> Path:
    """A dataset repository as the hub holds it: parquet shards under data/ and a README with the
    ``configs`` YAML block that names the splits."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        pq.write_table(pa.table({"text": list(train[i::shards])}),
                       folder / "data" / f"train-{i:05d}-of-{shards:05d}.parquet")
    pq.write_table(pa.table({"text": list(validation)}), folder / "data" / "validation-00000-of-00001.parquet")
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n"
        "  - split: validation\n    path: data/validation-*\n---\n\n# A test corpus\n")
    return folder


def _wandb_chunks(data: bytes) -> Iterator[bytes]:
    """Records of a ``run-*.wandb`` file: a 7-byte header (``:W&B``, magic, version), then LevelDB-log
    chunks (crc32c 4 bytes, length 2 bytes little-endian, type 1 byte) in 32 KiB blocks. The wandb package
    no longer ships a Python reader for it."""
    assert data[:4] == b":W&B", data[:8]
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # full
            yield chunk
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            yield pending + chunk
            pending = b""


def wandb_history(run_file: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The logged history rows (``_step`` included) and the run's config of an offline W&B run file."""
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    rows, config = [], {}
    for raw in _wandb_chunks(run_file.read_bytes()):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif kind in ("config", "run"):
            updates = record.config.update if kind == "config" else record.run.config.update
            for item in updates:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
            if kind == "run":
                config["_run_group"], config["_run_name"] = record.run.run_group, record.run.display_name
    return rows, config
