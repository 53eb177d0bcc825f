"""Raw text sources, all opened through the ``datasets`` library.

- ``embedded``: the synthetic corpus generated inside the package (no network);
- a local ``.txt``/``.jsonl``/``.json``/``.parquet`` file, or a folder of them (kinds may be mixed: each kind
  is read by its ``datasets`` builder and the text columns are concatenated);
- ``hf:NAME``: a Hugging Face hub dataset, streamed so that a peer never downloads the whole thing.

Local files and streamed datasets without a validation split get a held-out split carved out
deterministically, so every peer evaluates on the same text.
"""

from __future__ import annotations

import codecs
import os
from pathlib import Path

import datasets

from p2p_diloco.data.corpus import load_embedded_corpus

_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
HELD_OUT_FRACTION = 0.01
HELD_OUT_MAX = 2000
STREAM_HELD_OUT = 1000


class DataSourceError(ValueError):
    """The data source cannot be opened; the message names it and how to fix it."""


def _local_files(path: Path) -> dict[str, list[str]]:
    """The files of a local source, grouped by the ``datasets`` builder that reads them."""
    if path.is_file():
        if path.suffix not in _BUILDERS:
            raise DataSourceError(f"dataset file {str(path)!r}: unsupported extension; use {', '.join(_BUILDERS)}")
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _BUILDERS)
        if not files:
            raise DataSourceError(
                f"dataset folder {str(path)!r} holds no {', '.join(_BUILDERS)} files"
            )
    groups: dict[str, list[str]] = {}
    for file in files:
        groups.setdefault(_BUILDERS[file.suffix], []).append(str(file))
    return groups


def _root_cause(error: BaseException) -> str:
    """The innermost error's first line: ``datasets`` wraps the real cause in a generic message."""
    seen = {id(error)}
    while (nxt := error.__cause__ or error.__context__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        error = nxt
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _not_utf8(file: str) -> str | None:
    """Why ``file`` is not UTF-8 text (offset and byte), or None when it is."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                return f"byte 0x{chunk[e.start]:02x} at offset {offset + e.start} is not UTF-8"
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return "it ends inside a UTF-8 character"
    return None


def _diagnose(builder: str, files: list[str], error: Exception) -> str:
    """Which file broke ``datasets.load_dataset`` and why, in words a user can act on."""
    if all(os.path.getsize(f) == 0 for f in files):
        return (f"dataset file {files[0]!r} is empty" if len(files) == 1
                else f"all {len(files)} {builder} files are empty, e.g. {files[0]!r}")
    if builder == "text":
        for file in files:
            why = _not_utf8(file)
            if why is not None:
                return (f"dataset file {file!r} is not UTF-8 text ({why}); is it a binary file? Convert it to "
                        "UTF-8 or move it out of the dataset")
    if len(files) > 1:
        for file in files:
            try:
                datasets.load_dataset(builder, data_files=[file], split="train")
            except (ValueError, datasets.exceptions.DatasetGenerationError) as e:
                return f"dataset file {file!r}: {_root_cause(e)}"
    return f"dataset file {files[0]!r}: {_root_cause(error)}" if len(files) == 1 else _root_cause(error)


def _open_local(dataset: str, path: Path, text_field: str) -> datasets.Dataset:
    """All local files of ``path`` as one dataset; with several kinds, only their text columns."""
    groups = _local_files(path)
    parts = []
    for builder, files in sorted(groups.items()):
        try:
            part = datasets.load_dataset(builder, data_files=files, split="train")
        except (ValueError, datasets.exceptions.DatasetGenerationError) as e:
            raise DataSourceError(f"cannot read dataset {dataset!r}: {_diagnose(builder, files, e)}") from None
        if builder == "text" and text_field != "text":
            part = part.rename_column("text", text_field)  # the text builder always names its column "text"
        _check_text_column(part, text_field, dataset if len(groups) == 1 else f"{dataset} ({builder} files)")
        if len(groups) > 1:
            part = part.select_columns([text_field]).cast_column(text_field, datasets.Value("string"))
        parts.append(part)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


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
    full = _open_local(dataset, path, text_field)
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
