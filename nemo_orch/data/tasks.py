"""Task files: JSONL, one task per line, what rollouts and evaluation run on.

A line is ``{"id": str, "question": str}`` plus, optionally, ``system`` (the system prompt, e.g.
with a preference instruction), ``tools`` (names of the tools offered; default: all),
``answer`` (the reference), ``allowed_documents`` (ids retrieval may return) and ``metadata``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_orch.data.jsonl import DataError
from nemo_orch.data.records import read_records

_FIELDS = {"id", "question", "system", "tools", "answer", "allowed_documents", "metadata"}


@dataclass(frozen=True)
class Task:
    """A question for the orchestrator (see the module docstring for the fields)."""

    id: str
    question: str
    system: str | None = None
    tools: tuple[str, ...] | None = None
    answer: str | None = None
    allowed_documents: frozenset[str] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        record = {
            "id": self.id,
            "question": self.question,
            "system": self.system,
            "tools": None if self.tools is None else list(self.tools),
            "answer": self.answer,
            "metadata": self.metadata,
            "allowed_documents": None
            if self.allowed_documents is None
            else sorted(self.allowed_documents),
        }
        return {key: value for key, value in record.items() if value is not None}


def _strings(value: Any, key: str, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DataError(f"{where}: {key} must be a list of strings")
    return value


def task_from_json(record: Any, where: str) -> Task:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a task must be a JSON object")
    unknown = record.keys() - _FIELDS
    if unknown:
        raise DataError(f"{where}: unknown task fields {sorted(unknown)}")
    for key in ("id", "question"):
        if not isinstance(record.get(key), str) or not record[key]:
            raise DataError(f"{where}: {key} must be a non-empty string")
    for key in ("system", "answer"):
        if record.get(key) is not None and not isinstance(record[key], str):
            raise DataError(f"{where}: {key} must be a string")
    if not isinstance(record.get("metadata", {}), dict):
        raise DataError(f"{where}: metadata must be an object")
    tools = record.get("tools")
    documents = record.get("allowed_documents")
    return Task(
        id=record["id"],
        question=record["question"],
        system=record.get("system"),
        tools=None if tools is None else tuple(_strings(tools, "tools", where)),
        answer=record.get("answer"),
        allowed_documents=None
        if documents is None
        else frozenset(_strings(documents, "allowed_documents", where)),
        metadata=record.get("metadata", {}),
    )


def read_tasks(path: str | Path) -> list[Task]:
    """Every task of a ``.jsonl``, ``.json`` or ``.parquet`` file, or of a directory of them (a
    split's shards); a bad row is a :class:`DataError` naming file and line (or row)."""
    tasks, seen = [], set()
    for where, record in read_records(path):
        task = task_from_json(record, where)
        if task.id in seen:
            raise DataError(f"{where}: duplicate task id {task.id!r}")
        seen.add(task.id)
        tasks.append(task)
    return tasks


def write_tasks(path: str | Path, tasks: list[Task]) -> None:
    Path(path).write_text("".join(json.dumps(task.to_json()) + "\n" for task in tasks))
