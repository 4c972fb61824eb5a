"""HLE and FRAMES, read from a local file into :class:`~nemo_orch.data.tasks.Task` rows.

Nothing is downloaded: evaluation is handed the benchmark's file, a ``.jsonl`` (one object per
line), a ``.json`` (an array of objects) or a ``.parquet`` file (needs ``pyarrow``). Every problem
names its row: ``file:line`` for JSONL, ``file[row N]`` (N counted from 0) for JSON and parquet.

Columns read (others are ignored). Each benchmark's published names come first; our canonical
``id`` / ``question`` / ``answer`` are accepted in their place, so a user's own export works too.

* HLE (``cais/hle``): ``id``, ``question``, ``answer`` (required, non-empty), ``answer_type``
  (``exactMatch`` or ``multipleChoice``; absent: exact match), ``image`` (empty or null for a
  text-only question) and ``category``. The orchestrators are text-only, as in ToolOrchestra's
  HLE evaluation, so a row with an image is skipped and counted in ``skipped["image"]``. A
  multiple-choice question tells the model to answer with the letter of its chosen option.
* FRAMES (``google/frames-benchmark``): ``Prompt`` or ``question``, ``Answer`` or ``answer``
  (required), ``wiki_links`` (a list of URLs, or a string holding a Python-literal list, as in
  the published TSV/CSV export), ``reasoning_types`` (``"A | B"``, optional) and the id column
  ``Unnamed: 0`` or ``id`` (absent: the row's index). Task ids are ``frames-<id>``. A question's
  ``wiki_links`` are read as its own documents (``allowed_documents``), which only the oracle
  retrieval setting uses (``env.retrieval.scope=oracle``: a corpus whose document ids are the
  Wikipedia page URLs, exactly as written in ``wiki_links``); the reference's setting, and the
  preset's, searches the whole index.

A whitelist (:func:`read_whitelist`, ``env.retrieval.whitelist``) maps question ids to the
document ids each may retrieve, as the reference's ``examples.json`` does for HLE.

Every task's system prompt asks for the final answer inside ``<answer></answer>``, the tag the
rollout parser reads.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_orch.data.jsonl import DataError
from nemo_orch.data.records import read_records
from nemo_orch.data.tasks import Task

SYSTEM_PROMPT = (
    "You are an orchestrator that answers questions by calling tools. "
    "Finish with the final answer inside <answer></answer> tags."
)
MULTIPLE_CHOICE_INSTRUCTION = (
    "This is a multiple-choice question: the answer is the letter of the option you choose."
)
HLE_ANSWER_TYPES = ("exactMatch", "multipleChoice")
REASONING_TYPE_SEPARATOR = " | "

_HLE_COLUMNS = ("id", "question", "answer", "answer_type", "image", "category")
_FRAMES_IDS = ("Unnamed: 0", "id")
_FRAMES_COLUMNS = (
    *_FRAMES_IDS,
    "Prompt",
    "question",
    "Answer",
    "answer",
    "wiki_links",
    "reasoning_types",
)


@dataclass(frozen=True)
class QABenchmark:
    """A benchmark's tasks, in file order, and how many rows were skipped for which reason
    (e.g. ``{"image": 3}``), so a report can say what was not evaluated."""

    name: str
    tasks: list[Task]
    skipped: dict[str, int]


def _first(row: dict[str, Any], names: tuple[str, ...]) -> Any:
    """The value of the first of ``names`` the row has a non-null value for (None: none)."""
    return next((row[name] for name in names if row.get(name) is not None), None)


def _text(row: dict[str, Any], names: tuple[str, ...], where: str, numbers: bool = False) -> str:
    """A required non-empty string field (an integer too, with ``numbers``: ids, answers)."""
    value = _first(row, names)
    if numbers and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value.strip():
        raise DataError(
            f"{where}: {' or '.join(names)} must be a non-empty "
            f"{'string or integer' if numbers else 'string'}, got {value!r}"
        )
    return value.strip()


def _optional_string(row: dict[str, Any], name: str, where: str) -> str | None:
    value = row.get(name)
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: {name} must be a string, got {value!r}")
    return value or None


def _check_limit(limit: int | None) -> None:
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be None or >= 1, got {limit}")


class _Ids:
    """Task ids seen so far: a repeat is an error naming both rows."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def add(self, task_id: str, where: str) -> None:
        if task_id in self.seen:
            raise DataError(
                f"{where}: duplicate task id {task_id!r} (first at {self.seen[task_id]})"
            )
        self.seen[task_id] = where


def read_hle(path: str | Path, limit: int | None = None) -> QABenchmark:
    """Humanity's Last Exam's text-only questions (see the module docstring); ``limit``: stop
    after that many tasks (``skipped`` then counts the rows passed over before it)."""
    _check_limit(limit)
    tasks: list[Task] = []
    skipped: dict[str, int] = {}
    ids = _Ids()
    for where, row in read_records(path, _HLE_COLUMNS):
        if limit is not None and len(tasks) == limit:
            break
        image = row.get("image")
        if image is not None and not (isinstance(image, str) and not image.strip()):
            skipped["image"] = skipped.get("image", 0) + 1
            continue
        task_id = _text(row, ("id",), where, numbers=True)
        question = _text(row, ("question",), where)
        answer = _text(row, ("answer",), where, numbers=True)
        answer_type = _optional_string(row, "answer_type", where)
        if answer_type is not None and answer_type not in HLE_ANSWER_TYPES:
            raise DataError(
                f"{where}: answer_type must be one of {list(HLE_ANSWER_TYPES)}, got {answer_type!r}"
            )
        if answer_type == "multipleChoice":
            question = f"{question}\n\n{MULTIPLE_CHOICE_INSTRUCTION}"
        category = _optional_string(row, "category", where)
        ids.add(task_id, where)
        metadata = {"benchmark": "hle", "answer_type": answer_type, "category": category}
        tasks.append(
            Task(
                id=task_id,
                question=question,
                system=SYSTEM_PROMPT,
                answer=answer,
                metadata={k: v for k, v in metadata.items() if v is not None},
            )
        )
    return QABenchmark("hle", tasks, skipped)


def _wiki_links(value: Any, where: str) -> frozenset[str] | None:
    """The URLs of a ``wiki_links`` cell: a list, or the string of a Python-literal list."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise DataError(f"{where}: wiki_links is not a list literal: {value[:80]!r}") from None
    if (
        not isinstance(value, (list, tuple))
        or not value
        or not all(isinstance(link, str) and link.strip() for link in value)
    ):
        raise DataError(f"{where}: wiki_links must be a non-empty list of URLs, got {value!r}")
    return frozenset(link.strip() for link in value)


def read_frames(path: str | Path, limit: int | None = None) -> QABenchmark:
    """FRAMES questions, each limited to retrieving its own Wikipedia pages (see the module
    docstring); ``limit``: only the first that many tasks."""
    _check_limit(limit)
    tasks: list[Task] = []
    ids = _Ids()
    for index, (where, row) in enumerate(read_records(path, _FRAMES_COLUMNS)):
        if limit is not None and len(tasks) == limit:
            break
        task_id = "frames-" + (
            str(index)
            if _first(row, _FRAMES_IDS) is None
            else _text(row, _FRAMES_IDS, where, numbers=True)
        )
        question = _text(row, ("Prompt", "question"), where)
        answer = _text(row, ("Answer", "answer"), where, numbers=True)
        reasoning = _optional_string(row, "reasoning_types", where)
        metadata: dict[str, Any] = {"benchmark": "frames"}
        if reasoning:
            metadata["reasoning_types"] = [
                kind.strip() for kind in reasoning.split(REASONING_TYPE_SEPARATOR) if kind.strip()
            ]
        ids.add(task_id, where)
        tasks.append(
            Task(
                id=task_id,
                question=question,
                system=SYSTEM_PROMPT,
                answer=answer,
                allowed_documents=_wiki_links(row.get("wiki_links"), where),
                metadata=metadata,
            )
        )
    return QABenchmark("frames", tasks, {})


def read_qa(
    path: str | Path,
    *,
    id_column: str = "id",
    question_columns: tuple[str, ...] = ("question",),
    answer_columns: tuple[str, ...] = ("answer",),
    documents_column: str | None = None,
    limit: int | None = None,
) -> QABenchmark:
    """Question / reference-answer rows with the columns named (GeneralThought-430K's
    ``question`` and ``reference_answer``, a user's own): the first present of
    ``question_columns`` and of ``answer_columns``, the id in ``id_column`` (absent: ``qa-<row
    index>``), and in ``documents_column`` (when named) the ids retrieval may return."""
    _check_limit(limit)
    columns = (
        id_column,
        *question_columns,
        *answer_columns,
        *((documents_column,) if documents_column else ()),
    )
    tasks: list[Task] = []
    ids = _Ids()
    for index, (where, row) in enumerate(read_records(path, columns)):
        if limit is not None and len(tasks) == limit:
            break
        task_id = (
            f"qa-{index}"
            if row.get(id_column) is None
            else _text(row, (id_column,), where, numbers=True)
        )
        documents = None if documents_column is None else row.get(documents_column)
        if documents is not None and (
            not isinstance(documents, list)
            or not all(isinstance(document, str) for document in documents)
        ):
            raise DataError(f"{where}: {documents_column} must be a list of document ids")
        ids.add(task_id, where)
        tasks.append(
            Task(
                id=task_id,
                question=_text(row, question_columns, where),
                system=SYSTEM_PROMPT,
                answer=_text(row, answer_columns, where, numbers=True),
                allowed_documents=None if documents is None else frozenset(documents),
                metadata={"benchmark": "qa"},
            )
        )
    return QABenchmark("qa", tasks, {})


def read_whitelist(path: str | Path) -> dict[str, frozenset[str]]:
    """A JSON object ``{question id: [document id, ...]}``; ids may be strings or integers (kept
    as decimal strings, as corpus ids are read). Problems name the file and the question."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path}: cannot read the whitelist: {error}") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path}: a whitelist is a JSON object of question id -> document ids")

    def identifier(value: Any) -> str | None:
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return value if isinstance(value, str) and value else None

    whitelist = {}
    for question, documents in raw.items():
        ids = (
            [identifier(document) for document in documents]
            if isinstance(documents, list)
            else [None]
        )
        if None in ids:
            raise DataError(
                f"{path}: question {question!r}: the documents must be a list of "
                f"ids (strings or integers), got {str(documents)[:80]}"
            )
        whitelist[question] = frozenset(ids)
    return whitelist
