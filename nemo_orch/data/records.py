"""Row files every task source reads alike: ``.jsonl`` (one object per line), ``.json`` (an
array of objects) or ``.parquet`` (needs ``pyarrow``), each problem naming its row: ``file:line``
for JSONL, ``file[row N]`` (N counted from 0) for JSON and parquet."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from nemo_orch.data.jsonl import DataError, read_jsonl


def _parquet_rows(path: Path, columns: Collection[str] | None) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow): "
                        f"{error}") from None
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


def read_records(path: str | Path,
                 columns: Collection[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for every row of a ``.jsonl``, ``.json`` or ``.parquet`` file, ``where``
    naming the row for error messages. ``columns`` limits what parquet decodes (HLE's image
    columns are most of its bytes); rows of the text formats keep every key. An unknown
    suffix, an unreadable file, a row that is not an object or no rows at all is a
    :class:`DataError`."""
    path = Path(path)
    suffix = path.suffix.lower()
    located: Iterable[tuple[str, Any]]
    if suffix == ".jsonl":
        located = read_jsonl(path, "benchmark row")
    elif suffix == ".json":
        located = ((f"{path}[row {i}]", row) for i, row in enumerate(_json_rows(path)))
    elif suffix == ".parquet":
        located = ((f"{path}[row {i}]", row)
                   for i, row in enumerate(_parquet_rows(path, columns)))
    else:
        raise DataError(f"{path}: unknown benchmark file type {path.suffix!r}; expected .jsonl, "
                        ".json or .parquet")
    records = []
    for where, row in located:
        if not isinstance(row, dict):
            raise DataError(f"{where}: a benchmark row must be a JSON object, not "
                            f"{type(row).__name__}")
        records.append((where, row))
    if not records:
        raise DataError(f"{path}: no benchmark rows")
    return records
