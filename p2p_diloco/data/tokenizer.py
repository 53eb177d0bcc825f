"""Tokenizers: a byte-level one that needs no download, or any Hugging Face tokenizer.

The byte tokenizer uses ByT5's id layout (pad 0, eos 1, unk 2, byte b -> b + 3) so that a model trained
with it can later be paired with transformers' ``ByT5Tokenizer``. We encode with numpy instead of that
class because it is pure Python and about 100x slower on megabytes of text.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save_pretrained(self, path: str) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes shifted by 3; vocabulary of 259."""

    vocab_size = 259
    pad_token_id = 0
    eos_token_id = 1
    offset = 3

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [
            (np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) + self.offset).tolist()
            for t in texts
        ]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.offset for i in ids if i >= self.offset)
        return data.decode("utf-8", errors="replace")

    def save_pretrained(self, path: str) -> None:
        """Write the equivalent ``ByT5Tokenizer`` (no sentinel ids), so ``AutoTokenizer`` loads the folder."""
        from transformers import ByT5Tokenizer

        ByT5Tokenizer(extra_ids=0).save_pretrained(path)


class HFTokenizer:
    """Adapter around ``transformers.AutoTokenizer``."""

    def __init__(self, name: str) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"cannot load tokenizer {name!r}: {first}. Use --tokenizer byte, a local folder, or go online"
            ) from None
        self.vocab_size = len(self._tok)
        eos = self._tok.eos_token_id
        self.eos_token_id = int(eos if eos is not None else 0)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []  # a fast tokenizer raises IndexError on an empty batch; callers may pass one
        return self._tok(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def save_pretrained(self, path: str) -> None:
        self._tok.save_pretrained(path)


def load_tokenizer(name: str | None, model: str, presets: tuple[str, ...]) -> Tokenizer:
    """``name`` if given; else bytes for presets and the model's own tokenizer for a hub model."""
    choice = name or ("byte" if model in presets else model)
    return ByteTokenizer() if choice == "byte" else HFTokenizer(choice)
