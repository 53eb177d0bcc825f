"""Raw text sources, all opened through the ``datasets`` library.

- ``embedded``: the synthetic corpus generated inside the package (no network);
- a local ``.txt``/``.jsonl``/``.json``/``.parquet`` file, or a folder of files of one kind;
- ``hf:NAME``: a Hugging Face hub dataset, streamed so that a peer never downloads the whole thing.

Local files and streamed datasets without a validation split get a held-out split carved out
deterministically, so every peer evaluates on the same text.
"""

from __future__ import annotations

from pathlib import Path

import datasets

from p2p_diloco.data.corpus import load_embedded_corpus

_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
HELD_OUT_FRACTION = 0.01
HELD_OUT_MAX = 2000
STREAM_HELD_OUT = 1000


class DataSourceError(ValueError):
    """The data source cannot be opened; the message names it and how to fix it."""


def _local_files(path: Path) -> tuple[str, list[str]]:
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _BUILDERS)
        if not files:
            raise DataSourceError(
                f"dataset folder {str(path)!r} holds no {', '.join(_BUILDERS)} files"
            )
    kinds = {_BUILDERS.get(p.suffix) for p in files}
    if None in kinds:
        raise DataSourceError(
            f"dataset file {str(files[0])!r}: unsupported extension; use {', '.join(_BUILDERS)}"
        )
    if len(kinds) > 1:
        raise DataSourceError(f"dataset folder {str(path)!r} mixes file kinds {sorted(kinds)}; use one kind")
    return kinds.pop(), [str(p) for p in files]


def _check_text_column(ds: datasets.Dataset | datasets.IterableDataset, text_field: str, name: str) -> None:
    columns = ds.column_names
    if columns is not None and text_field not in columns:
        raise DataSourceError(
            f"dataset {name!r} has no column {text_field!r} (columns: {', '.join(columns)}); "
            "pass --text-field NAME"
        )


def open_text_dataset(
    dataset: str, split: str, text_field: str = "text", dataset_config: str | None = None
) -> datasets.Dataset | datasets.IterableDataset:
    """Open ``split`` ('train' or 'eval') of a source as a dataset with a text column ``text_field``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if dataset == "embedded":
        return load_embedded_corpus(split)
    if dataset.startswith("hf:"):
        return _open_hub(dataset[3:], split, text_field, dataset_config)
    path = Path(dataset).expanduser()
    if not path.exists():
        raise DataSourceError(
            f"dataset {dataset!r} is neither 'embedded', 'hf:NAME', nor an existing file or folder"
        )
    builder, files = _local_files(path)
    try:
        full = datasets.load_dataset(builder, data_files=files, split="train")
    except (ValueError, datasets.exceptions.DatasetGenerationError) as e:
        raise DataSourceError(f"cannot read dataset {dataset!r}: {str(e).splitlines()[0]}") from None
    _check_text_column(full, text_field, dataset)
    if len(full) < 2:
        raise DataSourceError(f"dataset {dataset!r} has {len(full)} rows; need at least 2 (train + held out)")
    held_out = max(1, min(HELD_OUT_MAX, int(len(full) * HELD_OUT_FRACTION)))
    parts = full.train_test_split(test_size=held_out, seed=0, shuffle=True)
    return parts["train" if split == "train" else "test"]


def _open_hub(name: str, split: str, text_field: str, config: str | None) -> datasets.IterableDataset:
    """Stream a hub dataset. Uses its validation split for eval when it has one, else the first rows."""
    try:
        if split == "eval":
            try:
                ds = datasets.load_dataset(name, config, split="validation", streaming=True)
                return ds.take(STREAM_HELD_OUT * 10)
            except ValueError:
                return datasets.load_dataset(name, config, split="train", streaming=True).take(STREAM_HELD_OUT)
        ds = datasets.load_dataset(name, config, split="train", streaming=True)
    except (OSError, ConnectionError, ValueError, FileNotFoundError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataSourceError(
            f"cannot stream hub dataset {name!r}: {first}. Check the name and network, or use a local file"
        ) from None
    try:
        has_validation = "validation" in datasets.get_dataset_split_names(name, config)
    except Exception:  # noqa: BLE001 - the split listing is best-effort; assume no validation split
        has_validation = False
    _check_text_column(ds, text_field, name)
    return ds if has_validation else ds.skip(STREAM_HELD_OUT)
