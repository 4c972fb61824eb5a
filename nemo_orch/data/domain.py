"""Domain environments: a database of tables, typed read and write tools over it, and a policy.

A domain is declared as data (:class:`DomainSpec`, JSON), the form the ToolScale synthesis
pipeline asks an LLM to write and the offline generator builds: tables with typed fields, and
tools that are one of a few database operations::

    {"name": "shop", "policy": "...",
     "tables": {"orders": {"key": "order_id", "id_prefix": "#O",
                           "fields": {"order_id": "string", "customer_id": "string",
                                      "status": {"enum": ["pending", "delivered", "cancelled"]},
                                      "total": "number"}}},
     "tools": [{"name": "cancel_pending_order", "description": "...", "op": "update",
                "table": "orders", "set": {"status": "cancelled"},
                "require": {"status": "pending"}}]}

Operations (arguments in brackets): ``get`` [key] -> the record; ``find`` [match fields] -> the
keys of matching records; ``list`` [match fields] -> matching records; ``update`` [key, ``args``
fields] sets those fields and the constants in ``set``; ``create`` [``args`` fields] -> a new
record with the next key; ``delete`` [key]; ``increment`` [key, ``amount``] adds to the numeric
``field``, kept within ``minimum`` when given. ``require`` (field -> value) guards writes.
The reference's synthesis has the LLM write Python tool code; declared operations instead give
typed, validated, sandbox-free tools whose effects the validation filters can replay.

State is plain JSON (``{table: {key: record}}``); its hash is SHA-256 over canonical JSON, so two
databases hash equal exactly when they hold the same records. A tool call validates its arguments
(a pydantic model per tool) and its preconditions before it writes anything: a failed call leaves
the state untouched.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pydantic

from nemo_orch.data.jsonl import DataError

OPERATIONS = ("get", "find", "list", "update", "create", "delete", "increment")
WRITE_OPERATIONS = frozenset({"update", "create", "delete", "increment"})
_FIELD_TYPES: dict[str, type] = {"string": str, "integer": int, "number": float, "boolean": bool}
_TOOL_KEYS = {
    "name",
    "description",
    "op",
    "table",
    "match",
    "args",
    "set",
    "require",
    "field",
    "minimum",
}

Database = dict[str, dict[str, dict[str, Any]]]


class ActionError(ValueError):
    """A tool call the database refuses (bad arguments, unknown key, a failed precondition); the
    message is what the agent is told."""


@dataclass(frozen=True)
class FieldSpec:
    """A column: a JSON type, or an enum of strings; ``ref`` names the table a key points to."""

    type: str
    enum: tuple[str, ...] | None = None
    ref: str | None = None

    def python_type(self) -> Any:
        return Literal[self.enum] if self.enum else _FIELD_TYPES[self.type]

    def to_json(self) -> Any:
        if self.enum is None and self.ref is None:
            return self.type
        record: dict[str, Any] = {"type": self.type}
        if self.enum is not None:
            record["enum"] = list(self.enum)
        if self.ref is not None:
            record["ref"] = self.ref
        return record


@dataclass(frozen=True)
class TableSpec:
    key: str
    fields: dict[str, FieldSpec]
    id_prefix: str = ""


@dataclass(frozen=True)
class ToolDef:
    """One declared tool (see the module docstring for the operations)."""

    name: str
    description: str
    op: str
    table: str
    match: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    set: dict[str, Any] | None = None
    require: dict[str, Any] | None = None
    field: str | None = None
    minimum: float | None = None

    @property
    def writes(self) -> bool:
        return self.op in WRITE_OPERATIONS

    def to_json(self) -> dict[str, Any]:
        record = {
            "name": self.name,
            "description": self.description,
            "op": self.op,
            "table": self.table,
            "match": list(self.match),
            "args": list(self.args),
            "set": self.set,
            "require": self.require,
            "field": self.field,
            "minimum": self.minimum,
        }
        return {key: value for key, value in record.items() if value not in (None, [])}


def _field_spec(raw: Any, where: str) -> FieldSpec:
    if isinstance(raw, str):
        raw = {"type": raw}
    if not isinstance(raw, dict) or not raw.keys() <= {"type", "enum", "ref"}:
        raise DataError(f"{where}: a field is a type name or {{type, enum, ref}}")
    enum = raw.get("enum")
    kind = raw.get("type", "string")
    if kind not in _FIELD_TYPES:
        raise DataError(f"{where}: unknown field type {kind!r} (one of {sorted(_FIELD_TYPES)})")
    if enum is not None and (
        kind != "string" or not enum or not all(isinstance(v, str) for v in enum)
    ):
        raise DataError(f"{where}: enum must be a non-empty list of strings on a string field")
    return FieldSpec(kind, None if enum is None else tuple(enum), raw.get("ref"))


class DomainSpec:
    """A validated domain declaration: tables, tools (each with a pydantic argument model) and
    the policy the agent must follow. Build with :meth:`from_json`."""

    def __init__(
        self, name: str, policy: str, tables: dict[str, TableSpec], tools: list[ToolDef]
    ) -> None:
        self.name, self.policy, self.tables = name, policy, tables
        self.tools = {tool.name: tool for tool in tools}
        self._fields = {tool.name: self._argument_fields(tool) for tool in tools}
        self._models = {name: self._argument_model(name) for name in self.tools}

    # ------------------------------------------------------------------ declaration
    @classmethod
    def from_json(cls, raw: Any, where: str = "domain") -> DomainSpec:
        if not isinstance(raw, dict) or not {"name", "tables", "tools"} <= raw.keys():
            raise DataError(f"{where}: a domain needs name, tables and tools")
        tables: dict[str, TableSpec] = {}
        for table_name, table in raw["tables"].items():
            at = f"{where}: table {table_name!r}"
            if not isinstance(table, dict) or not isinstance(table.get("fields"), dict):
                raise DataError(f"{at}: needs key and fields")
            fields = {
                name: _field_spec(value, f"{at} field {name!r}")
                for name, value in table["fields"].items()
            }
            if table.get("key") not in fields:
                raise DataError(f"{at}: key {table.get('key')!r} is not one of its fields")
            tables[table_name] = TableSpec(table["key"], fields, table.get("id_prefix", ""))
        for table_name, table in tables.items():
            for name, spec in table.fields.items():
                if spec.ref is not None and spec.ref not in tables:
                    raise DataError(
                        f"{where}: {table_name}.{name} refers to unknown table {spec.ref!r}"
                    )
        tools = [
            cls._tool(raw_tool, tables, f"{where}: tool #{index}")
            for index, raw_tool in enumerate(raw["tools"])
        ]
        names = [tool.name for tool in tools]
        duplicated = sorted({name for name in names if names.count(name) > 1})
        if duplicated:
            raise DataError(f"{where}: tools declared twice: {duplicated}")
        return cls(raw["name"], raw.get("policy", ""), tables, tools)

    @staticmethod
    def _tool(raw: Any, tables: dict[str, TableSpec], where: str) -> ToolDef:
        if not isinstance(raw, dict):
            raise DataError(f"{where}: a tool is an object")
        unknown = raw.keys() - _TOOL_KEYS
        if unknown:
            raise DataError(f"{where}: unknown keys {sorted(unknown)}")
        name = raw.get("name")
        if not isinstance(name, str) or not name.isidentifier():
            raise DataError(f"{where}: name must be an identifier, got {name!r}")
        where = f"{where} ({name})"
        if raw.get("op") not in OPERATIONS:
            raise DataError(f"{where}: op must be one of {OPERATIONS}, got {raw.get('op')!r}")
        table = tables.get(raw.get("table"))
        if table is None:
            raise DataError(f"{where}: unknown table {raw.get('table')!r}")
        tool = ToolDef(
            name,
            raw.get("description", ""),
            raw["op"],
            raw["table"],
            tuple(raw.get("match", ())),
            tuple(raw.get("args", ())),
            raw.get("set"),
            raw.get("require"),
            raw.get("field"),
            raw.get("minimum"),
        )
        named = [*tool.match, *tool.args, *(tool.set or {}), *(tool.require or {})]
        if tool.field is not None:
            named.append(tool.field)
        missing = [field for field in named if field not in table.fields]
        if missing:
            raise DataError(f"{where}: fields {missing} are not in table {tool.table!r}")
        if tool.op == "find" and not tool.match:
            raise DataError(f"{where}: find needs match fields")
        if tool.op == "increment" and (
            tool.field is None or table.fields[tool.field].type not in ("integer", "number")
        ):
            raise DataError(f"{where}: increment needs a numeric field")
        if tool.op == "update" and not (tool.args or tool.set):
            raise DataError(f"{where}: update needs args or set")
        if tool.op == "create" and table.key in tool.args:
            raise DataError(
                f"{where}: create assigns the key itself; do not take it as an argument"
            )
        return tool

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "policy": self.policy,
            "tables": {
                name: {
                    "key": table.key,
                    "id_prefix": table.id_prefix,
                    "fields": {field: spec.to_json() for field, spec in table.fields.items()},
                }
                for name, table in self.tables.items()
            },
            "tools": [tool.to_json() for tool in self.tools.values()],
        }

    # ------------------------------------------------------------------ arguments
    def _argument_fields(self, tool: ToolDef) -> dict[str, FieldSpec]:
        table = self.tables[tool.table]
        if tool.op in ("get", "delete", "update", "increment"):
            names = [table.key, *tool.args]
        elif tool.op in ("find", "list"):
            names = list(tool.match)
        else:
            names = list(tool.args)
        fields = {name: table.fields[name] for name in names}
        if tool.op == "increment":
            fields["amount"] = FieldSpec(table.fields[tool.field].type)
        return fields

    def _argument_model(self, name: str) -> type[pydantic.BaseModel]:
        fields = {field: (spec.python_type(), ...) for field, spec in self._fields[name].items()}
        return pydantic.create_model(  # strict: "3" is not an integer, as in a JSON schema
            f"{name}_arguments",
            __config__=pydantic.ConfigDict(extra="forbid", strict=True),
            **fields,
        )

    def parameters(self, name: str) -> dict[str, Any]:
        """The tool's JSON-schema ``parameters`` (what the agent sees)."""
        schema = self._models[name].model_json_schema()
        properties = {
            field: {key: value for key, value in prop.items() if key != "title"}
            for field, prop in schema["properties"].items()
        }
        return {
            "type": "object",
            "properties": properties,
            "required": schema.get("required", []),
            "additionalProperties": False,
        }

    def validate_arguments(self, name: str, arguments: Any) -> dict[str, Any]:
        """The arguments as the tool's model accepts them; :class:`ActionError` otherwise."""
        if name not in self.tools:
            raise ActionError(f"unknown tool {name!r}")
        if not isinstance(arguments, dict):
            raise ActionError(f"{name}: arguments must be an object")
        # JSON numbers: an integer is a valid number (strict mode would refuse 3 for float).
        fields = self._fields[name]
        coerced = {
            key: float(value)
            if key in fields
            and fields[key].type == "number"
            and isinstance(value, int)
            and not isinstance(value, bool)
            else value
            for key, value in arguments.items()
        }
        try:
            return self._models[name].model_validate(coerced).model_dump()
        except pydantic.ValidationError as error:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in error.errors()
            )
            raise ActionError(f"{name}: {problems}") from None

    # ------------------------------------------------------------------ state
    def check_database(self, database: Any, where: str = "database") -> Database:
        """``database`` if every record fits its table (fields, types, key); else DataError."""
        if not isinstance(database, dict) or set(database) - set(self.tables):
            raise DataError(f"{where}: tables must be among {sorted(self.tables)}")
        for table_name, records in database.items():
            table = self.tables[table_name]
            if not isinstance(records, dict):
                raise DataError(f"{where}: {table_name} must map keys to records")
            for key, record in records.items():
                at = f"{where}: {table_name}[{key!r}]"
                if not isinstance(record, dict) or set(record) != set(table.fields):
                    raise DataError(f"{at}: fields must be exactly {sorted(table.fields)}")
                if record[table.key] != key:
                    raise DataError(f"{at}: its {table.key} is {record[table.key]!r}")
                for field, spec in table.fields.items():
                    if not fits(record[field], spec):
                        raise DataError(
                            f"{at}.{field}: {record[field]!r} is not a {spec.type}"
                            + (f" in {list(spec.enum)}" if spec.enum else "")
                        )
        return database

    def execute(self, database: Database, name: str, arguments: Any) -> Any:
        """Run one tool call on ``database`` (mutated in place by writes) and return its
        result; :class:`ActionError` (the database untouched) if the call is refused."""
        arguments = self.validate_arguments(name, arguments)
        tool = self.tools[name]
        table = self.tables[tool.table]
        records = database.setdefault(tool.table, {})
        if tool.op in ("find", "list"):
            matching = [
                record
                for record in records.values()
                if all(record[field] == arguments[field] for field in tool.match)
            ]
            if tool.op == "find":
                if not matching:
                    raise ActionError(f"{name}: no {tool.table} record matches {arguments}")
                return [record[table.key] for record in matching]
            return [dict(record) for record in matching]
        if tool.op == "create":
            key = _next_key(records, table.id_prefix)
            record = {field: None for field in table.fields}
            record.update(arguments)
            record.update(tool.set or {})
            record[table.key] = key
            missing = [field for field, value in record.items() if value is None]
            if missing:
                raise ActionError(f"{name}: the new record has no value for {missing}")
            records[key] = record
            return dict(record)
        key = arguments[table.key]
        record = records.get(key)
        if record is None:
            raise ActionError(f"{name}: no {tool.table} record with {table.key} {key!r}")
        for field, required in (tool.require or {}).items():
            if record[field] != required:
                raise ActionError(
                    f"{name}: {tool.table} {key!r} has {field} {record[field]!r};"
                    f" this needs {required!r}"
                )
        if tool.op == "get":
            return dict(record)
        if tool.op == "delete":
            del records[key]
            return {"deleted": key}
        if tool.op == "increment":
            value = record[tool.field] + arguments["amount"]
            if tool.minimum is not None and value < tool.minimum:
                raise ActionError(
                    f"{name}: {tool.field} would fall to {value}, below {tool.minimum}"
                )
            record[tool.field] = round(value, 2) if isinstance(value, float) else value
            return dict(record)
        for field in tool.args:
            record[field] = arguments[field]
        record.update(tool.set or {})
        return dict(record)


def fits(value: Any, spec: FieldSpec) -> bool:
    """Whether ``value`` is a valid value of a field of type ``spec``."""
    if spec.type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if not isinstance(value, _FIELD_TYPES[spec.type]) or (
        spec.type == "integer" and isinstance(value, bool)
    ):
        return False
    return spec.enum is None or value in spec.enum


def _next_key(records: dict[str, Any], prefix: str) -> str:
    """The next free ``<prefix><number>`` key, numbered after the table's size (deterministic,
    so a replay on a fresh copy creates the same keys)."""
    number = len(records) + 1
    while f"{prefix}{number}" in records:
        number += 1
    return f"{prefix}{number}"


def state_hash(database: Database) -> str:
    """SHA-256 of the database's canonical JSON (sorted keys, no whitespace)."""
    canonical = json.dumps(database, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def result_text(result: Any) -> str:
    """A tool result as the agent sees it: JSON (strings as they are)."""
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)


@dataclass(frozen=True)
class Domain:
    """A domain ready to run: its spec and its initial database."""

    spec: DomainSpec
    database: Database

    @property
    def name(self) -> str:
        return self.spec.name

    def fresh_database(self, update: dict[str, Any] | None = None) -> Database:
        """A private copy of the initial database, with a task's ``update`` merged in (a
        tau2 ``initialization_data.agent_data``: nested objects merge, other values replace)."""
        # Fields hold scalars only (check_database), so copying each record is a deep copy.
        database = {
            table: {key: dict(record) for key, record in records.items()}
            for table, records in self.database.items()
        }
        if update:
            _merge(database, copy.deepcopy(update))
            self.spec.check_database(database, f"domain {self.name}: updated database")
        return database

    def to_json(self) -> dict[str, Any]:
        return {"domain": self.spec.to_json(), "database": self.database}

    @classmethod
    def from_json(cls, raw: Any, where: str = "domain") -> Domain:
        if not isinstance(raw, dict) or set(raw) != {"domain", "database"}:
            raise DataError(f"{where}: a domain file holds {{domain, database}}")
        spec = DomainSpec.from_json(raw["domain"], where)
        return cls(spec, spec.check_database(raw["database"], f"{where}: database"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), ensure_ascii=False, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Domain:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as error:
            raise DataError(f"{path}: cannot read the domain file: {error}") from None
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{error.lineno}: not valid JSON ({error.msg})") from None
        return cls.from_json(raw, str(path))


def _merge(target: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value
