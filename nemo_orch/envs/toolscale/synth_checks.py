"""The checks of each ToolScale synthesis step's reply: what a domain, its tables, schema, data
model, records and tools, the user purposes, the drafted tasks and their harder rewrites must be.

A check takes the parsed reply and returns its result as JSON, or raises :class:`InvalidOutput`
with what the model is told on the retry (:mod:`.synth_steps`); a check that builds a
:class:`~nemo_orch.data.domain.DomainSpec` or a task may raise its ``DataError`` too.
"""

from __future__ import annotations

import re
from typing import Any

from nemo_orch.data.domain import Database, Domain, DomainSpec, FieldSpec, fits
from nemo_orch.data.domain_tasks import DomainTask, task_from_record
from nemo_orch.envs.toolscale.synth_steps import InvalidOutput

_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
_FIELD_TYPES = ("string", "integer", "number", "boolean")
_TOOL_SHAPE: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "description": str,
    "op": str,
    "table": str,
    "match": list,
    "args": list,
    "set": dict,
    "require": dict,
    "field": str,
    "minimum": (int, float),
}


def _object(value: Any, *keys: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not set(keys) <= value.keys():
        raise InvalidOutput(f"expected a JSON object with {', '.join(map(repr, keys))}")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidOutput(f"{what} must be a non-empty string")
    return value.strip()


def _names(value: Any, what: str) -> list[str]:
    if not (
        isinstance(value, list)
        and value
        and all(isinstance(name, str) and _NAME.fullmatch(name) for name in value)
    ):
        raise InvalidOutput(f"{what} must be a non-empty list of lowercase snake_case names")
    if len(set(value)) != len(value):
        raise InvalidOutput(f"{what}: a name is repeated")
    return value


def check_about(value: Any, taken: list[str]) -> dict[str, str]:
    """The domain's name (not one of ``taken``), description and policy."""
    about = _object(value, "name", "description", "policy")
    name = about["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidOutput(f"name must be a lowercase snake_case identifier, got {name!r}")
    if name in taken:
        raise InvalidOutput(f"the name {name!r} is taken; invent another domain")
    return {
        "name": name,
        "description": _text(about["description"], "description"),
        "policy": _text(about["policy"], "policy"),
    }


def check_tables(value: Any) -> list[str]:
    """The domain's table names."""
    return _names(_object(value, "tables")["tables"], "tables")


def check_schema(value: Any, tables: list[str]) -> list[dict[str, Any]]:
    """The schema of exactly ``tables``: each table's fields, their types and references, and its
    key."""
    schema = _object(value, "tables")["tables"]
    if not isinstance(schema, list) or not all(isinstance(table, dict) for table in schema):
        raise InvalidOutput("tables must be a list of objects")
    named = [table.get("name") for table in schema]
    if sorted(map(str, named)) != sorted(tables):
        raise InvalidOutput(f"describe exactly the tables {tables}, got {named}")
    for table in schema:
        at = f"table {table['name']!r}"
        fields = table.get("fields")
        if not isinstance(fields, list) or not all(isinstance(field, dict) for field in fields):
            raise InvalidOutput(f"{at}: fields must be a list of objects")
        names = _names([field.get("name") for field in fields], f"{at}: field names")
        if table.get("key") not in names:
            raise InvalidOutput(f"{at}: key {table.get('key')!r} is not one of its fields")
        for field in fields:
            if field.get("type") not in _FIELD_TYPES:
                raise InvalidOutput(f"{at}.{field['name']}: type must be one of {_FIELD_TYPES}")
            if field.get("ref") is not None and field["ref"] not in tables:
                raise InvalidOutput(f"{at}.{field['name']}: ref {field['ref']!r} is not a table")
    return schema


def _spec(
    about: dict[str, str], tables: dict[str, Any], tools: list[Any], where: str
) -> DomainSpec:
    return DomainSpec.from_json(
        {"name": about["name"], "policy": about["policy"], "tables": tables, "tools": tools}, where
    )


def check_data_model(
    value: Any, about: dict[str, str], schema: list[dict[str, Any]]
) -> dict[str, Any]:
    """The ``tables`` of a :class:`~nemo_orch.data.domain.DomainSpec` for ``schema``, keys plain
    strings."""
    tables = _object(value, "tables")["tables"]
    expected = {table["name"]: {field["name"] for field in table["fields"]} for table in schema}
    if not isinstance(tables, dict) or set(tables) != set(expected):
        raise InvalidOutput(f"tables must map exactly the schema's tables {sorted(expected)}")
    for name, table in tables.items():
        at = f"table {name!r}"
        if not (
            isinstance(table, dict)
            and isinstance(table.get("key"), str)
            and isinstance(table.get("id_prefix", ""), str)
            and isinstance(table.get("fields"), dict)
        ):
            raise InvalidOutput(f"{at}: needs key (a field), id_prefix and fields (an object)")
        for field, spec in table["fields"].items():
            if not (
                isinstance(spec, str)
                or isinstance(spec, dict)
                and isinstance(spec.get("type", ""), str)
                and isinstance(spec.get("ref", ""), str)
                and isinstance(spec.get("enum", []), list)
            ):
                raise InvalidOutput(f"{at}.{field}: a field is a type name or {{type, enum, ref}}")
        if set(table["fields"]) != expected[name]:
            raise InvalidOutput(f"{at}: fields must be the schema's {sorted(expected[name])}")
    spec = _spec(about, tables, [], "data model")
    for name, table in spec.tables.items():
        if table.fields[table.key] != FieldSpec("string"):
            raise InvalidOutput(f"table {name!r}: key {table.key!r} must be a plain string")
    return spec.to_json()["tables"]


def check_records(value: Any, about: dict[str, str], tables: dict[str, Any]) -> Database:
    """The database: records that fit the data model ``tables``, their references resolved."""
    spec = _spec(about, tables, [], "data model")
    records = _object(value, "records")["records"]
    if not isinstance(records, dict) or set(records) != set(spec.tables):
        raise InvalidOutput(f"records must list the records of each table {sorted(spec.tables)}")
    database: Database = {}
    for name, rows in records.items():
        key = spec.tables[name].key
        if not (isinstance(rows, list) and rows and all(isinstance(row, dict) for row in rows)):
            raise InvalidOutput(f"records of {name!r} must be a non-empty list of objects")
        keys = [row.get(key) for row in rows]
        if not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
            raise InvalidOutput(f"every record of {name!r} needs its own string {key!r}")
        database[name] = dict(zip(keys, rows))
    spec.check_database(database, "records")
    for name, table in spec.tables.items():
        for field, kind in table.fields.items():
            dangling = [
                key
                for key, record in database[name].items()
                if kind.ref is not None and record[field] not in database[kind.ref]
            ]
            if dangling:
                raise InvalidOutput(
                    f"{name}.{field} of {dangling[:5]} holds no key of {kind.ref!r}"
                )
    return database


def check_tools(value: Any, about: dict[str, str], tables: dict[str, Any]) -> dict[str, Any]:
    """The whole domain spec with its tools: constants that fit their fields, reads and writes
    both."""
    tools = _object(value, "tools")["tools"]
    if not isinstance(tools, list) or not tools:
        raise InvalidOutput("tools must be a non-empty list")
    for index, tool in enumerate(tools):
        at = f"tool #{index}"
        if not isinstance(tool, dict):
            raise InvalidOutput(f"{at} must be an object")
        wrong = [
            key
            for key, kinds in _TOOL_SHAPE.items()
            if key in tool and (not isinstance(tool[key], kinds) or isinstance(tool[key], bool))
        ]
        if wrong or not all(
            isinstance(name, str) for key in ("match", "args") for name in tool.get(key, [])
        ):
            raise InvalidOutput(
                f"{at}: wrong types for {wrong or ['match/args']}: match and "
                "args are lists of fields, set and require objects, minimum a "
                "number"
            )
    spec = _spec(about, tables, tools, "tools")
    for tool in spec.tools.values():
        fields = spec.tables[tool.table].fields
        for field, constant in {**(tool.require or {}), **(tool.set or {})}.items():
            if not fits(constant, fields[field]):
                raise InvalidOutput(
                    f"tool {tool.name}: {constant!r} does not fit "
                    f"{tool.table}.{field} ({fields[field].to_json()})"
                )
    if all(tool.writes for tool in spec.tools.values()) or not any(
        tool.writes for tool in spec.tools.values()
    ):
        raise InvalidOutput("the tools must include reads (get, find, list) and writes")
    return spec.to_json()


def check_purposes(value: Any, count: int) -> list[str]:
    """At most ``count`` distinct user purposes."""
    purposes = _object(value, "purposes")["purposes"]
    if not isinstance(purposes, list) or not purposes:
        raise InvalidOutput("purposes must be a non-empty list of strings")
    purposes = [_text(purpose, "a purpose") for purpose in purposes[:count]]
    if len(set(purposes)) != len(purposes):
        raise InvalidOutput("a purpose is repeated")
    return purposes


def _check_task(record: Any, domain: Domain, task_id: str, where: str) -> DomainTask:
    if not isinstance(record, dict):
        raise InvalidOutput(f"{where} must be an object")
    task = task_from_record({**record, "id": task_id}, where)
    criteria = task.evaluation_criteria
    if criteria is not None and criteria.env_assertions:
        raise InvalidOutput(
            f"{where}: env_assertions are not supported; state the outcome "
            "with actions and communicate_info"
        )
    if task.initial_state is not None and task.initial_state.initialization_actions:
        raise InvalidOutput(
            f"{where}: initialization_actions are not supported; give the "
            "initial state as initial_state.initialization_data.agent_data"
        )
    domain.fresh_database(task.database_update())  # an initial-state update must fit too
    return task


def check_tasks(value: Any, domain: Domain, prefix: str, count: int) -> list[dict[str, Any]]:
    """At most ``count`` tasks of ``domain``, numbered after ``prefix``, as JSON."""
    records = _object(value, "tasks")["tasks"]
    if not isinstance(records, list) or not records:
        raise InvalidOutput("tasks must be a non-empty list")
    return [
        _check_task(record, domain, f"{prefix}-{n}", f"tasks[{n}]").to_json()
        for n, record in enumerate(records[:count])
    ]


def check_evolved(value: Any, domain: Domain, task: DomainTask) -> dict[str, Any]:
    """The rewrite of ``task``, with more gold actions than it, as JSON."""
    evolved = _check_task(_object(value, "task")["task"], domain, task.id, "task")
    if len(evolved.gold_actions) <= len(task.gold_actions):
        raise InvalidOutput(
            f"the rewrite has {len(evolved.gold_actions)} gold actions; it "
            f"needs more than the task's {len(task.gold_actions)}"
        )
    return evolved.to_json()
