"""ToolScale synthesis: an LLM designs domains and user tasks through any OpenAI-compatible
endpoint, and only what validates is kept.

The steps follow the reference pipeline, each one LLM call whose prompt is a file in
``prompts/``: domain (name, description, policy) -> table names -> schema -> data model (the
``tables`` of a :class:`~nemo_orch.data.domain.DomainSpec`) -> database records -> tools
(declared database operations, not code) -> user purposes -> tasks (the ToolScale/tau2 ``Task``
schema) -> "evolve harder" rewrites. A reply is parsed as JSON (a ```json fence is tolerated) and
checked; one that fails is sent back with the error, up to ``max_retries`` times, after which
the run fails naming the step.

What the reference does not do:

* every drafted task and every rewrite must pass the validation filters (:mod:`.validate`); a
  dropped task is counted under its filter with the reason, and a rewrite replaces its task
  only when it passes, so evolving never loses a task;
* records must fit the data model and their references resolve, constants a tool writes must
  fit their fields, and a domain needs read and write tools;
* a budget (``max_llm_calls``; ``max_usd`` at the configured prices, from the token counts the
  server reports) stops the run cleanly: domains that reached their task stage are written with
  the tasks finished so far;
* every step's reply is cached on disk, keyed by a hash of its request, so a killed or stopped
  run resumes without asking again (a cached reply is checked again: a stale one is re-asked).

Outputs under ``out_dir``: ``<domain>/domain.json`` (:meth:`Domain.save`, for
``tools.domains``), ``<domain>/tasks.jsonl``, ``summary.json`` and the cache,
``cache/<step>/<key>.json``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from string import Template
from typing import Any, NoReturn, TypeVar

from nemo_orch.clients.openai import ChatResult, OpenAIClient, run_sync
from nemo_orch.config import ConfigError, SynthConfig
from nemo_orch.data.domain import Database, Domain, DomainSpec, FieldSpec, fits
from nemo_orch.data.domain_tasks import DomainTask, task_from_record, write_domain_tasks
from nemo_orch.data.jsonl import DataError
from nemo_orch.envs.toolscale.validate import Rejection, ValidationSummary, rejection, validated

log = logging.getLogger(__name__)

PROMPTS = Path(__file__).with_name("prompts")
_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)
_THINKING = re.compile(r"\A\s*<think>.*?</think>", re.DOTALL)
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

T = TypeVar("T")


class SynthError(DataError):
    """A step whose replies never validated; the message names the step."""


class InvalidOutput(ValueError):
    """A reply that does not parse or check; the message is what the model is told."""


class _BudgetExhausted(Exception):
    """No request may be sent any more (``synth.max_llm_calls`` or ``synth.max_usd``)."""


@dataclass
class Usage:
    """This run's LLM requests (retries included), steps answered from the cache, tokens and
    USD; a rerun counts only what it sends."""

    calls: int = 0
    retries: int = 0
    cached: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    usd: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "usd": round(self.usd, 6)}


# ---------------------------------------------------------------------- replies and prompts
def parse_json(text: str) -> Any:
    """The JSON value of a reply: the whole text or, when it does not start as an object, the
    inside of its ```json fence (after a leading ``<think>`` block, which reasoning models
    served without a reasoning parser emit)."""
    text = _THINKING.sub("", text).strip()
    fenced = None if text.startswith("{") else _FENCE.search(text)
    try:
        return json.loads(fenced.group(1) if fenced else text)
    except json.JSONDecodeError as error:
        raise InvalidOutput(
            f"not valid JSON ({error.msg} at line {error.lineno} column {error.colno})"
        ) from None


def render(name: str, /, **inputs: Any) -> str:
    """The prompt ``prompts/<name>.txt`` with its ``$inputs`` (non-strings as JSON)."""
    template = Template((PROMPTS / f"{name}.txt").read_text(encoding="utf-8"))
    return template.substitute(
        {
            key: value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            for key, value in inputs.items()
        }
    )


def _read_entry(path: Path) -> dict[str, Any] | None:
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        log.warning("%s: unreadable cache entry (%s); asking again", path, error)
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("raw"), str) else None


def _write_entry(path: Path, entry: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(entry, ensure_ascii=False, indent=1), encoding="utf-8")
    os.replace(partial, path)  # a kill leaves the entry whole or absent, never half written


class _Steps:
    """Runs steps: the cache, retries with the error sent back, the budget and the usage."""

    def __init__(self, config: SynthConfig, client: OpenAIClient, cache_dir: Path) -> None:
        self.config, self.client, self.cache_dir = config, client, cache_dir
        self.usage = Usage()
        self.stopped: str | None = None
        self._slots = asyncio.Semaphore(config.concurrency)

    def _key(self, step: str, messages: list[dict[str, str]]) -> str:
        request = {
            "step": step,
            "model": self.config.model,
            "messages": messages,
            "temperature": self.config.temperature,
            "max_tokens": self.config.max_tokens,
        }
        canonical = json.dumps(request, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(canonical.encode()).hexdigest()[:24]

    async def run(self, step: str, where: str, check: Callable[[Any], T], **inputs: Any) -> T:
        """The checked reply to ``step``'s prompt with ``inputs``: from the cache, or asked
        for (again with the error, at most ``max_retries`` times). ``check`` returns the
        result as JSON, which is cached beside the raw reply."""
        messages = [
            {"role": "system", "content": render("system")},
            {"role": "user", "content": render(step, **inputs)},
        ]
        path = self.cache_dir / step / f"{self._key(step, messages)}.json"
        entry = _read_entry(path)
        if entry is not None:
            try:
                result = check(parse_json(entry["raw"]))
            except (InvalidOutput, DataError) as error:
                log.warning(
                    "synth %s (%s): the cached reply no longer checks (%s); asking again",
                    step,
                    where,
                    error,
                )
            else:
                self.usage.cached += 1
                return result
        rejected: list[dict[str, str]] = []
        for attempt in range(self.config.max_retries + 1):
            reply = await self._ask(messages, retry=attempt > 0)
            try:
                result = check(parse_json(reply.text))
            except (InvalidOutput, DataError) as error:
                rejected.append({"raw": reply.text, "error": str(error)})
                messages = [
                    *messages,
                    {"role": "assistant", "content": reply.text},
                    {"role": "user", "content": render("retry", error=str(error))},
                ]
                continue
            _write_entry(
                path,
                {
                    "step": step,
                    "where": where,
                    "model": self.config.model,
                    "raw": reply.text,
                    "result": result,
                    "rejected": rejected,
                },
            )
            log.info("synth %s (%s): done in %d request(s)", step, where, attempt + 1)
            return result
        raise SynthError(
            f"synth step {step!r} ({where}): no valid output in {len(rejected)} "
            f"attempts (synth.max_retries={self.config.max_retries}); last error: "
            f"{rejected[-1]['error']}"
        )

    async def _ask(self, messages: list[dict[str, str]], retry: bool) -> ChatResult:
        config, usage = self.config, self.usage
        async with self._slots:
            # Requests are counted when sent (exact under concurrency); USD when answered, so
            # the requests in flight may overshoot max_usd.
            if config.max_llm_calls is not None and usage.calls >= config.max_llm_calls:
                self._stop(f"synth.max_llm_calls={config.max_llm_calls} reached")
            if config.max_usd is not None and usage.usd >= config.max_usd:
                self._stop(f"synth.max_usd={config.max_usd:g} reached (${usage.usd:.4f} spent)")
            usage.calls += 1
            usage.retries += retry
            reply = await self.client.chat(
                messages, temperature=config.temperature, max_tokens=config.max_tokens
            )
        usage.input_tokens += reply.input_tokens
        usage.output_tokens += reply.output_tokens
        usage.usd += (
            reply.input_tokens * config.input_usd_per_million
            + reply.output_tokens * config.output_usd_per_million
        ) / 1e6
        return reply

    def _stop(self, reason: str) -> NoReturn:
        self.stopped = self.stopped or reason
        raise _BudgetExhausted(reason)


async def _each(work: Sequence[Awaitable[T]]) -> list[T]:
    """The results of ``work`` run together, in order, less those the budget stopped; another
    failure is raised once all are done (what finished is cached for the rerun)."""
    results = await asyncio.gather(*work, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, _BudgetExhausted):
            raise result
    return [result for result in results if not isinstance(result, _BudgetExhausted)]


# ---------------------------------------------------------------------- checks of the replies
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


def _check_about(value: Any, taken: list[str]) -> dict[str, str]:
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


def _check_tables(value: Any) -> list[str]:
    return _names(_object(value, "tables")["tables"], "tables")


def _check_schema(value: Any, tables: list[str]) -> list[dict[str, Any]]:
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


def _check_data_model(
    value: Any, about: dict[str, str], schema: list[dict[str, Any]]
) -> dict[str, Any]:
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


def _check_records(value: Any, about: dict[str, str], tables: dict[str, Any]) -> Database:
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


def _check_tools(value: Any, about: dict[str, str], tables: dict[str, Any]) -> dict[str, Any]:
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


def _check_purposes(value: Any, count: int) -> list[str]:
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


def _check_tasks(value: Any, domain: Domain, prefix: str, count: int) -> list[dict[str, Any]]:
    records = _object(value, "tasks")["tasks"]
    if not isinstance(records, list) or not records:
        raise InvalidOutput("tasks must be a non-empty list")
    return [
        _check_task(record, domain, f"{prefix}-{n}", f"tasks[{n}]").to_json()
        for n, record in enumerate(records[:count])
    ]


def _check_evolved(value: Any, domain: Domain, task: DomainTask) -> dict[str, Any]:
    evolved = _check_task(_object(value, "task")["task"], domain, task.id, "task")
    if len(evolved.gold_actions) <= len(task.gold_actions):
        raise InvalidOutput(
            f"the rewrite has {len(evolved.gold_actions)} gold actions; it "
            f"needs more than the task's {len(task.gold_actions)}"
        )
    return evolved.to_json()


# ---------------------------------------------------------------------- the pipeline
async def _design(steps: _Steps, config: SynthConfig, index: int, taken: list[str]) -> Domain:
    where = f"domain {index + 1} of {config.num_domains}"
    about = await steps.run(
        "domain",
        where,
        lambda value: _check_about(value, taken),
        index=index + 1,
        count=config.num_domains,
        taken=taken,
    )
    where = f"domain {about['name']}"
    tables = await steps.run("tables", where, _check_tables, domain=about)
    schema = await steps.run(
        "schema", where, lambda value: _check_schema(value, tables), domain=about, tables=tables
    )
    model = await steps.run(
        "data_model",
        where,
        lambda value: _check_data_model(value, about, schema),
        domain=about,
        schema=schema,
    )
    database = await steps.run(
        "records",
        where,
        lambda value: _check_records(value, about, model),
        domain=about,
        data_model=model,
        count=config.records_per_table,
    )
    spec = DomainSpec.from_json(
        await steps.run(
            "tools",
            where,
            lambda value: _check_tools(value, about, model),
            domain=about,
            data_model=model,
        ),
        where,
    )
    return Domain(spec, spec.check_database(database, where))


async def _draft_tasks(
    steps: _Steps,
    config: SynthConfig,
    domain: Domain,
    purposes: list[str],
    summary: ValidationSummary,
) -> list[DomainTask]:
    """The tasks drafted for each purpose that pass the validation filters."""
    spec = domain.spec.to_json()

    def for_purpose(index: int, purpose: str) -> Awaitable[list[dict[str, Any]]]:
        prefix = f"{domain.name}-{index}"
        return steps.run(
            "tasks",
            f"domain {domain.name}, purpose {index + 1}",
            lambda value: _check_tasks(value, domain, prefix, config.tasks_per_purpose),
            domain=spec,
            database=domain.database,
            purpose=purpose,
            count=config.tasks_per_purpose,
            name=domain.name,
        )

    drafted = await _each([for_purpose(index, purpose) for index, purpose in enumerate(purposes)])
    tasks = [
        task_from_record(record, f"domain {domain.name}")
        for records in drafted
        for record in records
    ]
    return list(validated(domain, tasks, config.max_actions, summary))


async def _evolve(
    steps: _Steps,
    config: SynthConfig,
    domain: Domain,
    tasks: list[DomainTask],
    summary: ValidationSummary,
) -> list[DomainTask]:
    """Each task after up to ``evolve_rounds`` harder rewrites, each kept only when it passes
    the filters (the first rejected one ends the task's evolution)."""
    spec = domain.spec.to_json()

    async def harder(task: DomainTask) -> tuple[DomainTask, list[Rejection | None]]:
        verdicts: list[Rejection | None] = []
        for _ in range(config.evolve_rounds):
            try:
                record = await steps.run(
                    "evolve",
                    f"domain {domain.name}, task {task.id}",
                    lambda value, current=task: _check_evolved(value, domain, current),
                    domain=spec,
                    database=domain.database,
                    task=task.to_json(),
                    actions=len(task.gold_actions),
                )
            except _BudgetExhausted:
                break
            candidate = task_from_record(record, f"task {task.id}")
            verdicts.append(rejection(domain, candidate, config.max_actions))
            if verdicts[-1] is not None:
                break
            task = candidate
        return task, verdicts

    evolved = await _each([harder(task) for task in tasks])
    for _, verdicts in evolved:  # recorded in task order, whatever order the replies came in
        for verdict in verdicts:
            summary.seen += 1
            if verdict is None:
                summary.kept += 1
            else:
                summary.rejections.append(verdict)
    return [task for task, _ in evolved]


def _save(directory: Path, domain: Domain, tasks: list[DomainTask]) -> dict[str, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    domain.save(directory / "domain.json")
    write_domain_tasks(directory / "tasks.jsonl", tasks)
    return {
        "name": domain.name,
        "domain_file": str(directory / "domain.json"),
        "tasks_file": str(directory / "tasks.jsonl"),
        "tasks": len(tasks),
        "tools": len(domain.spec.tools),
        "records": sum(len(records) for records in domain.database.values()),
    }


async def _synthesize(config: SynthConfig, out: Path) -> dict[str, Any]:
    client = OpenAIClient(
        config.base_url,
        config.model,
        dialect=config.dialect,
        name="synth",
        api_key_env=config.api_key_env,
        timeout_s=config.timeout_s,
    )
    steps = _Steps(config, client, out / "cache")
    drafted, evolved = ValidationSummary(), ValidationSummary()
    written: list[dict[str, Any]] = []
    async with client:
        for index in range(config.num_domains):
            try:
                domain = await _design(steps, config, index, [d["name"] for d in written])
                purposes = await steps.run(
                    "purposes",
                    f"domain {domain.name}",
                    lambda value: _check_purposes(value, config.num_purposes),
                    domain=domain.spec.to_json(),
                    count=config.num_purposes,
                )
            except _BudgetExhausted:
                break
            tasks = await _draft_tasks(steps, config, domain, purposes, drafted)
            tasks = await _evolve(steps, config, domain, tasks, evolved)
            written.append(_save(out / domain.name, domain, tasks))
            if steps.stopped:
                break
    summary = {
        "out_dir": str(out),
        "stopped": steps.stopped,
        "domains": written,
        "tasks": drafted.to_json(),
        "evolved": evolved.to_json(),
        "llm": steps.usage.to_json(),
    }
    (out / "summary.json").write_text(json.dumps(summary, ensure_ascii=False, indent=1))
    return summary


def run(config: SynthConfig) -> dict[str, Any]:
    """Run the pipeline into ``config.out_dir`` (resuming from its cache); returns the summary,
    also written to ``summary.json``. :class:`SynthError` when a step never validates."""
    if not (config.base_url and config.model):
        raise ConfigError(
            "synth.base_url and synth.model must name an OpenAI-compatible endpoint and its model"
        )
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return run_sync(_synthesize(config, out))


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as the command prints it."""
    tasks, evolved, llm = summary["tasks"], summary["evolved"], summary["llm"]
    lines = [f"synth: {len(summary['domains'])} domain(s) -> {summary['out_dir']}"]
    lines += [
        f"  {d['name']}: {d['tools']} tools, {d['records']} records, {d['tasks']} tasks "
        f"-> {d['tasks_file']}"
        for d in summary["domains"]
    ]
    dropped = ", ".join(f"{name} {count}" for name, count in tasks["dropped"].items())
    lines.append(f"  tasks: {tasks['seen']} drafted, {tasks['kept']} kept; dropped: {dropped}")
    lines.append(
        f"  evolve: {evolved['seen']} harder rewrites, {evolved['kept']} kept (a "
        "dropped rewrite leaves its task as it was)"
    )
    lines.append(
        f"  LLM: {llm['calls']} requests (retries: {llm['retries']}), steps from the "
        f"cache: {llm['cached']}; {llm['input_tokens']} input + "
        f"{llm['output_tokens']} output tokens, ${llm['usd']:.4f}"
    )
    if summary["stopped"]:
        lines.append(
            f"  stopped early: {summary['stopped']}; run again with a larger budget "
            "to continue from the cache"
        )
    lines.append(f"  drops and reasons: {Path(summary['out_dir']) / 'summary.json'}")
    return lines
