"""ToolScale as published (``nvidia/ToolScale`` on the Hugging Face Hub, one parquet file), read
into :class:`~nemo_orch.data.domain_tasks.DomainTask` objects for the domains installed here.

Nothing is downloaded: the reader is handed the file. Its layout is tau2-bench ``Task`` rows
with every nested object stored as a parquet struct (the Hub's JSON-to-parquet conversion)::

    id                   string
    description          struct<purpose, relevant_policies, notes>
    user_scenario        struct<persona, instructions: struct<task_instructions, reason_for_call,
                                known_info, unknown_info, domain>>
    initial_state        null
    evaluation_criteria  struct<actions: list<struct<arguments: struct<...>, name, action_id,
                                info, requestor?>>, communicate_info: list<string>,
                                nl_assertions, env_assertions, ...>

The domain is named only by ``user_scenario.instructions.domain``. A struct has every field of
its type in every row, so a key a task did not have reads as null; ``arguments`` is one struct
merging every argument of every tool of every domain (each action carries dozens of null keys),
and that merged column has one type per argument name (``start_date`` ``timestamp[s]``,
``min_amount`` float64, ``active_only`` bool, ...). Each row of an installed domain becomes a
task thus:

* a null key is dropped (absent and null cannot be told apart; an optional field then takes its
  schema default), at every depth of the action arguments too (maps of structs, lists of
  structs: the union struct holds every key any row used), except that a null stays where the
  named tool's schema accepts null there. A required parameter given null is therefore
  missing, and the validation filters (:mod:`.validate`) reject the task naming it;
* a non-null argument the tool does not take is kept, for the validation filters to name;
* a timestamp is written back as an ISO-8601 string: a naive midnight as its date
  (``2026-03-04``: pyarrow's JSON reader types a date string as ``timestamp[s]``), any other
  naive one as the UTC instant it is (``2026-03-04T10:30:00Z``: the same reader converts a
  string with a zone, ``...Z`` or ``...+02:00``, to naive UTC), a zoned one with its zone
  (UTC as ``Z``);
* a field whose type differs between domains (a struct in one, a string in another) cannot be
  both in one parquet column: the published file holds it as a string, the struct as its JSON
  text, which is decoded where the named tool's schema expects an object or array there;
* an integral float becomes an integer where the tool's parameter is an integer (the merged
  column may hold another tool's float argument of the same name).

Rows of a domain that is not installed are counted by domain in ``skipped`` and not parsed
further, never scored. A row that does not parse is a :class:`DataError` naming ``file[row N]``
(N counted from 0).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_orch.data.domain import Domain
from nemo_orch.data.domain_tasks import DomainTask, task_from_record
from nemo_orch.data.jsonl import DataError
from nemo_orch.data.records import read_records


@dataclass(frozen=True)
class LoadedToolScale:
    """The tasks of each installed domain (every one a key, file order) and the rows of the
    domains not installed, counted by domain."""

    path: Path
    tasks: dict[str, list[DomainTask]]
    skipped: dict[str, int]

    @property
    def counts(self) -> dict[str, int]:
        """Rows per domain named in the file, installed or not."""
        rows = {name: len(tasks) for name, tasks in self.tasks.items() if tasks}
        return dict(sorted({**rows, **self.skipped}.items()))

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "rows": self.counts, "skipped_domains": self.skipped}


def installed_domains(directory: str | Path) -> dict[str, Domain]:
    """The domains of ``<directory>/<domain>/domain.json`` (as ``write_offline`` and
    ``nemo-orch synth`` write them), by name."""
    files = sorted(Path(directory).glob("*/domain.json"))
    if not files:
        raise DataError(f"{directory}: no domains (write them with `nemo-orch synth`)")
    domains = (Domain.load(file) for file in files)
    return {domain.name: domain for domain in domains}


def read_toolscale_parquet(path: str | Path, domains: Mapping[str, Domain]) -> LoadedToolScale:
    """The tasks of the published ToolScale file at ``path`` for the installed ``domains``
    (see the module docstring); a row that does not parse is a :class:`DataError` naming the
    file and row."""
    path = Path(path)
    parameters = {
        name: {tool: domain.spec.parameters(tool) for tool in domain.spec.tools}
        for name, domain in domains.items()
    }
    tasks: dict[str, list[DomainTask]] = {name: [] for name in domains}
    skipped: dict[str, int] = {}
    seen: set[str] = set()
    for where, row in read_records(path):
        name = domain_of(row, where)
        if name not in domains:
            skipped[name] = skipped.get(name, 0) + 1
            continue
        task = task_from_record(published_record(row, parameters[name]), where)
        if task.id in seen:
            raise DataError(f"{where}: duplicate task id {task.id!r}")
        seen.add(task.id)
        tasks[name].append(task)
    return LoadedToolScale(path, tasks, dict(sorted(skipped.items())))


def _plain(value: Any) -> Any:
    """A decoded parquet value with its timestamps as ISO-8601 strings."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            if value.time() == datetime.time():
                return value.date().isoformat()
            value = value.replace(tzinfo=datetime.UTC)
        return value.isoformat().replace("+00:00", "Z")
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    return value


def published_record(row: dict[str, Any], tools: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A published row as its tau2 task's record, by the rules of the module docstring (also
    for tau2 domains read from this layout); ``tools``: each tool's JSON-schema
    ``parameters``."""
    return _task_record(_plain(row), tools)


def domain_of(record: dict[str, Any], where: str) -> str:
    """The domain a row names (``user_scenario.instructions.domain``); ``where`` names the row
    in the error a row without one is."""
    scenario = record.get("user_scenario")
    instructions = scenario.get("instructions") if isinstance(scenario, dict) else None
    name = instructions.get("domain") if isinstance(instructions, dict) else None
    if not isinstance(name, str) or not name:
        raise DataError(
            f"{where}: user_scenario.instructions.domain must name the task's domain, got {name!r}"
        )
    return name


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _task_record(record: dict[str, Any], tools: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The task's record, null keys dropped; each action's arguments fitted to its tool."""
    task = _without_nulls(record)
    criteria = record.get("evaluation_criteria")
    raw_actions = criteria.get("actions") if isinstance(criteria, dict) else None
    if isinstance(raw_actions, list):  # _without_nulls keeps list positions: the two align
        for action, raw in zip(task["evaluation_criteria"]["actions"], raw_actions):
            if isinstance(raw, dict) and isinstance(raw.get("arguments"), dict):
                parameters = tools.get(raw.get("name"), {})
                action["arguments"] = _fitted(
                    raw["arguments"], parameters, parameters.get("$defs", {})
                )
    return task


def _resolved(schema: Any, defs: dict[str, Any], value: Any) -> dict[str, Any]:
    """The subschema ``value`` is read under: ``$ref`` followed into ``defs``, and of an
    ``anyOf``/``oneOf`` the first option of ``value``'s JSON type (else the first not null)."""
    if not isinstance(schema, dict):
        return {}
    reference = schema.get("$ref")
    if isinstance(reference, str) and reference.startswith("#/$defs/"):
        return _resolved(defs.get(reference.removeprefix("#/$defs/"), {}), defs, value)
    options = [
        _resolved(option, defs, value) for option in schema.get("anyOf", schema.get("oneOf", ()))
    ]
    if options:
        return next(
            (option for option in options if _of_type(value, option)),
            next((option for option in options if "null" not in _types(option)), options[0]),
        )
    return schema


def _types(schema: dict[str, Any]) -> set[str]:
    kinds = schema.get("type", ())
    return {kinds} if isinstance(kinds, str) else set(kinds)


def _of_type(value: Any, schema: dict[str, Any]) -> bool:
    """Whether ``value`` is of one of the schema's JSON types."""
    kinds = _types(schema)
    if value is None or isinstance(value, bool):
        return ("null" if value is None else "boolean") in kinds
    if isinstance(value, (int, float)):
        return "number" in kinds or ("integer" in kinds and float(value).is_integer())
    return (
        "object" if isinstance(value, dict) else "array" if isinstance(value, list) else "string"
    ) in kinds


def _fitted(value: Any, schema: Any, defs: dict[str, Any]) -> Any:
    """A decoded value of the merged ``arguments`` struct as the tool's schema expects it, at
    every depth: the nulls the union schema added dropped (but where the schema takes null),
    JSON text decoded where an object or array is expected (a field that is a struct in one
    domain and a string in another is published as text), an integral float an integer where
    an integer is expected."""
    schema = _resolved(schema, defs, value)
    if isinstance(value, str) and _types(schema) & {"object", "array"}:
        try:
            decoded = json.loads(value)
        except ValueError:
            decoded = None
        if isinstance(decoded, (dict, list)) and _of_type(decoded, schema):
            value = decoded
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        fitted = {}
        for key, item in value.items():
            field_schema = properties.get(key, extra if isinstance(extra, dict) else {})
            if item is None and not _accepts_null(field_schema, defs):
                continue
            fitted[key] = _fitted(item, field_schema, defs)
        return fitted
    if isinstance(value, list):
        return [_fitted(item, schema.get("items", {}), defs) for item in value]
    if isinstance(value, float) and value.is_integer() and "integer" in _types(schema):
        return int(value)
    return value


def _accepts_null(schema: Any, defs: dict[str, Any]) -> bool:
    if not isinstance(schema, dict):
        return False
    reference = schema.get("$ref")
    if isinstance(reference, str) and reference.startswith("#/$defs/"):
        return _accepts_null(defs.get(reference.removeprefix("#/$defs/"), {}), defs)
    return "null" in _types(schema) or any(
        _accepts_null(option, defs) for option in schema.get("anyOf", schema.get("oneOf", ()))
    )
