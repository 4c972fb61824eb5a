"""Reading JSONL files whose every problem names ``file:line``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """Malformed data; the message says where (file and line, or record index)."""


def read_jsonl(
    path: str | Path, what: str, error: type[Exception] = DataError
) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` for each non-blank line, ``where`` being ``file:line``. An unreadable
    file, a line that is not JSON or a file with no records raises ``error`` naming it."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as problem:
        raise error(f"{path}: cannot read the {what} file: {problem}") from None
    found = False
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as problem:
            raise error(f"{where}: not valid JSON ({problem.msg})") from None
        found = True
        yield where, record
    if not found:
        raise error(f"{path}: no {what}s")
