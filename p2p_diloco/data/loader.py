"""Per-peer token streams: which data a peer reads, packed into fixed-length training sequences.

How peers split the data. The dataset is cut into ``S`` virtual shards (``--virtual-shards``). A peer
starts at shard ``sha256(peer_id) mod S`` and walks the ring ``start, start+1, ...``, reading each shard
in an order shuffled by (seed, peer id, shard). Two peers read disjoint data until one walk reaches the
other's start, which takes about S/P shards for P peers. Nothing is coordinated, so:

- a peer that joins picks its own start and needs no re-partitioning of anyone else;
- a peer that leaves leaves its unread shards to be reached by the walk of the peer before it;
- a peer that restarts with ``--resume`` continues from the (shard, row) position saved in its checkpoint.

A streamed hub dataset is split the same way with ``datasets.distributed.split_dataset_by_node``
(world size S, rank = the peer's start), and its position is the number of rows consumed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from p2p_diloco.data.tokenizer import Tokenizer

if TYPE_CHECKING:  # imported where a stream is built: ``DataPosition`` alone (checkpoints, the swarm
    import datasets  # session) must not pull in datasets, pandas and pyarrow (about 180 MB and 0.4 s a process)

TOKENIZE_BATCH = 256


def peer_start_shard(peer_id: str, num_shards: int) -> int:
    """Where ``peer_id`` starts its walk over the shard ring."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big") % num_shards


def _peer_seed(seed: int, peer_id: str, shard: int) -> int:
    digest = hashlib.sha256(f"{seed}:{peer_id}:{shard}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


@dataclass
class DataPosition:
    """Where a peer's stream stands; saved in checkpoints so ``--resume`` does not re-read data."""

    walk: int = 0
    """How many shards of the walk were finished."""
    row: int = 0
    """Rows of the current shard already read (or rows consumed, for a streamed dataset)."""

    def as_dict(self) -> dict[str, int]:
        return {"walk": self.walk, "row": self.row}

    @classmethod
    def from_dict(cls, d: dict) -> DataPosition:
        walk, row = d.get("walk", 0), d.get("row", 0)
        if not (isinstance(walk, int) and isinstance(row, int) and walk >= 0 and row >= 0):
            raise ValueError(f"data position must hold non-negative integers walk and row, got {d!r}")
        return cls(walk, row)


class PeerTokenStream:
    """Yields ``[batch, seq_len]`` LongTensors of packed text for one peer, forever.

    Documents are joined with the EOS token and cut into ``seq_len`` tokens; a sequence may span
    documents, as in GPT-style pretraining. After a resume, text that was read ahead into the packing
    buffer but not yet trained on is skipped (at most 16 documents).
    """

    def __init__(
        self,
        dataset: datasets.Dataset | datasets.IterableDataset,
        tokenizer: Tokenizer,
        seq_len: int,
        batch_size: int,
        peer_id: str,
        *,
        text_field: str = "text",
        num_shards: int = 256,
        seed: int = 0,
        position: DataPosition | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.peer_id = peer_id
        self.text_field = text_field
        self.seed = seed
        self.position = position or DataPosition()
        import datasets

        self.streaming = isinstance(dataset, datasets.IterableDataset)
        if self.streaming:
            self.num_shards = num_shards
        else:
            if len(dataset) == 0:
                raise ValueError("the training split is empty")
            self.num_shards = max(1, min(num_shards, len(dataset)))
        self.start = peer_start_shard(peer_id, self.num_shards)
        self.dataset = dataset
        self._buffer: list[int] = []
        self._rows = self._row_iter()

    def shard_index(self, walk: int) -> int:
        return (self.start + walk) % self.num_shards

    def shard_rows(self, walk: int) -> np.ndarray:
        """Row indices of the walk's ``walk``-th shard, in this peer's order."""
        shard = self.shard_index(walk)
        n = len(self.dataset)
        lo, hi = shard * n // self.num_shards, (shard + 1) * n // self.num_shards
        rng = np.random.default_rng(_peer_seed(self.seed, self.peer_id, shard))
        return lo + rng.permutation(hi - lo)

    def _row_iter(self) -> Iterator[str]:
        if self.streaming:
            from datasets.distributed import split_dataset_by_node

            ds = split_dataset_by_node(self.dataset, rank=self.start, world_size=self.num_shards)
            ds = ds.skip(self.position.row)
            for row in ds:
                self.position.row += 1
                yield row[self.text_field]
            return
        while True:
            rows = self.shard_rows(self.position.walk)
            while self.position.row < len(rows):
                chunk = rows[self.position.row : self.position.row + TOKENIZE_BATCH]
                texts = self.dataset[chunk.tolist()][self.text_field]
                for text in texts:
                    self.position.row += 1
                    yield text
            self.position.walk += 1
            self.position.row = 0

    def _fill(self, n_tokens: int) -> None:
        eos = self.tokenizer.eos_token_id
        while len(self._buffer) < n_tokens:
            texts = []
            for text in self._rows:
                texts.append(text)
                if len(texts) >= 16:
                    break
            if not texts:
                raise RuntimeError("the data stream ended; use a larger dataset or fewer steps")
            for ids in self.tokenizer.encode_batch(texts):
                self._buffer.extend(ids)
                self._buffer.append(eos)

    def next_batch(self) -> torch.Tensor:
        need = self.batch_size * self.seq_len
        self._fill(need)
        batch = torch.tensor(self._buffer[:need], dtype=torch.long).view(self.batch_size, self.seq_len)
        del self._buffer[:need]
        return batch

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_batch()


def eval_batches(
    dataset: datasets.Dataset | datasets.IterableDataset,
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    num_batches: int,
    text_field: str = "text",
) -> list[torch.Tensor]:
    """The first ``num_batches`` packed batches of the held-out split, the same on every peer.

    A held-out split too small for one ``batch_size`` x ``seq_len`` batch (a small local file) gives one
    batch of as many whole sequences as it holds; one with less than a sequence is an error naming the fix.
    """
    eos = tokenizer.eos_token_id
    need = num_batches * batch_size * seq_len
    buffer: list[int] = []
    texts: list[str] = []
    for row in dataset:
        texts.append(row[text_field])
        if len(texts) == 64:
            for ids in tokenizer.encode_batch(texts):
                buffer.extend(ids + [eos])
            texts = []
            if len(buffer) >= need:
                break
    for ids in tokenizer.encode_batch(texts):
        buffer.extend(ids + [eos])
    usable = len(buffer) // (batch_size * seq_len)
    if usable == 0:
        # A small local dataset: evaluate on one smaller batch rather than refuse it.
        rows = len(buffer) // seq_len
        if rows == 0:
            raise ValueError(
                f"the held-out split has {len(buffer)} tokens, fewer than one sequence of --seq-len {seq_len}; "
                "use more data, a smaller --seq-len, or --eval-every 0 to train without evaluation"
            )
        return [torch.tensor(buffer[: rows * seq_len], dtype=torch.long).view(rows, seq_len)]
    n = min(num_batches, usable)
    flat = torch.tensor(buffer[: n * batch_size * seq_len], dtype=torch.long)
    return list(flat.view(n, batch_size, seq_len))
