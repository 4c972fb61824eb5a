"""Row files every task source reads alike: ``.jsonl`` (one object per line), ``.json`` (an
array of objects) or ``.parquet`` (needs ``pyarrow``), each problem naming its row: ``file:line``
for JSONL, ``file[row N]`` (N counted from 0) for JSON and parquet. A directory stands for the
row files directly inside it, read in name order: a dataset split's shards
(``train-00000-of-00003.parquet``, ...), as a Hugging Face dataset repository holds them, with
its metadata (``dataset_infos.json``, ...) left out."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from nemo_orch.config.hub import DATA_SUFFIXES, is_data_file
from nemo_orch.data.jsonl import DataError, read_jsonl


def _parquet_rows(path: Path, columns: Collection[str] | None) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise DataError(
            f"{path}: reading parquet needs pyarrow (pip install pyarrow): {error}"
        ) from None
    try:
        if columns is not None:
            names = set(pq.read_schema(path).names)
            columns = [name for name in columns if name in names]
        return pq.read_table(path, columns=columns).to_pylist()
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: cannot read the parquet file: {error}") from None


def _json_rows(path: Path) -> list[Any]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: cannot read the file: {error}") from None
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{error.lineno}: not valid JSON ({error.msg})") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: a .json benchmark file must hold an array of objects")
    return rows


def row_files(path: str | Path) -> list[Path]:
    """``path`` itself, or for a directory the row files directly inside it, in name order (the
    datasets library's metadata beside them left out)."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    files = sorted(file for file in path.iterdir() if is_data_file(file))
    if not files:
        raise DataError(f"{path}: a directory without row files ({', '.join(DATA_SUFFIXES)})")
    return files


def _located_rows(path: Path, columns: Collection[str] | None) -> Iterable[tuple[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return read_jsonl(path, "benchmark row")
    if suffix == ".json":
        return ((f"{path}[row {i}]", row) for i, row in enumerate(_json_rows(path)))
    if suffix == ".parquet":
        return ((f"{path}[row {i}]", row) for i, row in enumerate(_parquet_rows(path, columns)))
    raise DataError(
        f"{path}: unknown benchmark file type {path.suffix!r}; expected .jsonl, .json or .parquet"
    )


def read_records(
    path: str | Path, columns: Collection[str] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for every row of a ``.jsonl``, ``.json`` or ``.parquet`` file (or of a
    directory's row files), ``where`` naming the row for error messages.
    ``columns`` limits what parquet decodes (HLE's image columns are most of its bytes); rows of
    the text formats keep every key. An unknown suffix, an unreadable file, a row that is not an
    object or no rows at all is a :class:`DataError`."""
    records = []
    for file in row_files(path):
        for where, row in _located_rows(file, columns):
            if not isinstance(row, dict):
                raise DataError(
                    f"{where}: a benchmark row must be a JSON object, not {type(row).__name__}"
                )
            records.append((where, row))
    if not records:
        raise DataError(f"{path}: no benchmark rows")
    return records
