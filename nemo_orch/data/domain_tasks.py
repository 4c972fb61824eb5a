"""Domain tasks in the public ToolScale / tau2-bench ``Task`` schema, and their scoring.

A task is a user scenario (instructions, reason for the call, known and unknown information),
an optional initial state (an update merged into the domain's database) and evaluation criteria
(gold actions ``[{name, arguments}]``, facts the agent must communicate, optional natural-language
assertions). Files are JSON arrays (tau2's ``tasks.json``) or JSONL (one task per line); fields
are read as they are published, including JSON-encoded strings, and unknown fields are kept so
a round trip loses nothing. Problems name the file and line.

Scoring follows tau2: the episode's tool calls and the gold actions are each replayed on a fresh
copy of the database, and the task is solved when the two states hash equal, every required fact
was communicated and, when ``ACTION`` is in the reward basis, every gold action was called.
A task whose gold actions change nothing is flagged (``writes`` false): the database check then
passes for an agent that does nothing, and only the communicated facts can tell.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import pydantic

from nemo_orch.data.domain import ActionError, Domain, state_hash
from nemo_orch.data.jsonl import DataError, read_jsonl
from nemo_orch.data.tasks import Task


class _Schema(pydantic.BaseModel):
    # Unknown fields are kept (a round trip loses nothing); published files sometimes hold
    # nested objects as JSON strings, which are decoded.
    model_config = pydantic.ConfigDict(extra="allow")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _decode_strings(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {key: _decoded(item) for key, item in value.items()}
        return _decoded(value)


def _decoded(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in "{[" and value[-1:] in "}]":
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


class StructuredUserInstructions(_Schema):
    domain: str
    reason_for_call: str
    known_info: Optional[str] = None
    unknown_info: Optional[str] = None
    task_instructions: str


class UserScenario(_Schema):
    persona: Optional[str] = None
    instructions: StructuredUserInstructions | str


class Description(_Schema):
    purpose: Optional[str] = None
    relevant_policies: Optional[str] = None
    notes: Optional[str] = None


class Action(_Schema):
    action_id: str
    requestor: Literal["assistant", "user"] = "assistant"
    name: str
    arguments: dict[str, Any]
    info: Optional[str] = None
    compare_args: Optional[list[str]] = None


class EnvAssertion(_Schema):
    env_type: Literal["assistant", "user"]
    func_name: str
    arguments: dict[str, Any]
    assert_value: bool = True
    message: Optional[str] = None


class EvaluationCriteria(_Schema):
    actions: Optional[list[Action]] = None
    env_assertions: Optional[list[EnvAssertion]] = None
    communicate_info: Optional[list[str]] = None
    nl_assertions: Optional[list[str]] = None
    reward_basis: list[Literal["DB", "ENV_ASSERTION", "NL_ASSERTION", "ACTION", "COMMUNICATE"]] = [
        "DB",
        "COMMUNICATE",
    ]


class InitializationData(_Schema):
    agent_data: Optional[dict[str, Any]] = None
    user_data: Optional[dict[str, Any]] = None


class InitialState(_Schema):
    initialization_data: Optional[InitializationData] = None
    initialization_actions: Optional[list[dict[str, Any]]] = None
    message_history: Optional[list[dict[str, Any]]] = None


class DomainTask(_Schema):
    """One task of the ToolScale / tau2 ``Task`` schema."""

    id: str
    description: Optional[Description] = None
    user_scenario: UserScenario
    ticket: Optional[str] = None
    initial_state: Optional[InitialState] = None
    evaluation_criteria: Optional[EvaluationCriteria] = None

    @property
    def gold_actions(self) -> list[Action]:
        criteria = self.evaluation_criteria
        return list(criteria.actions or []) if criteria is not None else []

    @property
    def facts(self) -> list[str]:
        criteria = self.evaluation_criteria
        return list(criteria.communicate_info or []) if criteria is not None else []

    @property
    def domain_name(self) -> str | None:
        instructions = self.user_scenario.instructions
        return instructions.domain if isinstance(instructions, StructuredUserInstructions) else None

    def database_update(self) -> dict[str, Any] | None:
        state = self.initial_state
        if state is None or state.initialization_data is None:
            return None
        return state.initialization_data.agent_data

    def scenario_text(self) -> str:
        """The user's side, stated up front in the first message (a scripted user: there is
        no one to ask for more)."""
        scenario = self.user_scenario
        instructions = scenario.instructions
        lines = [
            'The customer\'s scenario, stated up front ("you" is the customer; there is '
            "no one to ask for more):"
        ]
        if scenario.persona:
            lines.append(f"Persona: {scenario.persona}")
        if isinstance(instructions, str):
            return "\n".join([*lines, instructions])
        lines.append(f"Reason for call: {instructions.reason_for_call}")
        if instructions.known_info:
            lines.append(f"Known info: {instructions.known_info}")
        if instructions.unknown_info:
            lines.append(f"Unknown info: {instructions.unknown_info}")
        lines.append(f"Task instructions: {instructions.task_instructions}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The fields as read or set (defaults are not written: a round trip is exact)."""
        return self.model_dump(mode="json", exclude_unset=True)


def task_from_record(record: Any, where: str) -> DomainTask:
    try:
        return DomainTask.model_validate(record)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        location = ".".join(map(str, first["loc"])) or "task"
        raise DataError(
            f"{where}: {location}: {first['msg']} ({error.error_count()} problem(s))"
        ) from None


def _array_records(path: Path, text: str) -> Iterable[tuple[str, Any]]:
    """``(file:line, element)`` for each element of a JSON array, its line where it starts."""
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        where = f"{path}:{text.count(chr(10), 0, position) + 1}"
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{error.lineno}: not valid JSON ({error.msg})") from None
        yield where, record


def read_domain_tasks(path: str | Path) -> list[DomainTask]:
    """The tasks of a JSON-array or JSONL file; a malformed task is a :class:`DataError` naming
    the file and the line where it starts."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: cannot read the task file: {error}") from None
    records = (
        _array_records(path, text) if text.lstrip().startswith("[") else read_jsonl(path, "task")
    )
    tasks, seen = [], set()
    for where, record in records:
        task = task_from_record(record, where)
        if task.id in seen:
            raise DataError(f"{where}: duplicate task id {task.id!r}")
        seen.add(task.id)
        tasks.append(task)
    if not tasks:
        raise DataError(f"{path}: no tasks")
    return tasks


def write_domain_tasks(path: str | Path, tasks: Iterable[DomainTask]) -> int:
    """Write JSONL (streamed); returns how many tasks were written."""
    count = 0
    with Path(path).open("w", encoding="utf-8") as out:
        for task in tasks:
            out.write(json.dumps(task.to_json(), ensure_ascii=False) + "\n")
            count += 1
    return count


# ---------------------------------------------------------------------- scoring
@dataclass(frozen=True)
class DomainScore:
    """How an episode did on a domain task; ``reward`` is 1.0 only when every check passed."""

    reward: float
    db_match: bool
    writes: bool
    missing_facts: list[str] = field(default_factory=list)
    missing_actions: list[str] = field(default_factory=list)
    gold_errors: list[str] = field(default_factory=list)
    unchecked_nl_assertions: int = 0


@dataclass(frozen=True)
class Replay:
    """The state a sequence of calls leaves, and the calls the database refused."""

    state_hash: str
    errors: list[str]


def replay(domain: Domain, task: DomainTask, calls: Iterable[tuple[str, dict[str, Any]]]) -> Replay:
    """Run ``calls`` in order on a fresh database set up for ``task``."""
    database = domain.fresh_database(task.database_update())
    errors = []
    for name, arguments in calls:
        try:
            domain.spec.execute(database, name, arguments)
        except ActionError as error:
            errors.append(str(error))
    return Replay(state_hash(database), errors)


def gold_calls(task: DomainTask) -> list[tuple[str, dict[str, Any]]]:
    return [(action.name, action.arguments) for action in task.gold_actions]


def communicated(fact: str, text: str) -> bool:
    """tau2's check: the fact, lowercased, inside the text lowercased without commas."""
    return fact.lower() in text.lower().replace(",", "")


def _called(action: Action, calls: Sequence[tuple[str, dict[str, Any]]]) -> bool:
    keys = action.compare_args
    return any(
        name == action.name
        and all(
            arguments.get(key) == action.arguments.get(key)
            for key in (keys if keys is not None else action.arguments)
        )
        for name, arguments in calls
    )


def unscorable(task: DomainTask) -> str | None:
    """Why :func:`score_episode` cannot score ``task``, or None: environment assertions belong
    to tau2's own domains (see ``envs.tau2.adapter``), and natural-language assertions in the
    reward basis need an LLM judge."""
    criteria = task.evaluation_criteria or EvaluationCriteria()
    if criteria.env_assertions or "ENV_ASSERTION" in criteria.reward_basis:
        return "env_assertions need the tau2 adapter (nemo_orch.envs.tau2.adapter)"
    if "NL_ASSERTION" in criteria.reward_basis:
        return "NL_ASSERTION in the reward basis needs an LLM judge"
    return None


def score_episode(
    domain: Domain, task: DomainTask, calls: Sequence[tuple[str, dict[str, Any]]], told: str
) -> DomainScore:
    """Score an episode's tool ``calls`` and what it ``told`` the user (see the module
    docstring); :class:`DataError` for a task it cannot score (:func:`unscorable`).
    Natural-language assertions outside the reward basis are counted, not checked."""
    criteria = task.evaluation_criteria or EvaluationCriteria()
    problem = unscorable(task)
    if problem is not None:
        raise DataError(f"task {task.id}: {problem}")
    initial = replay(domain, task, []).state_hash
    gold = replay(domain, task, gold_calls(task))
    episode = replay(domain, task, calls)
    basis = set(criteria.reward_basis)
    db_match = episode.state_hash == gold.state_hash
    missing_facts = [fact for fact in task.facts if not communicated(fact, told)]
    missing_actions = [
        action.name
        for action in task.gold_actions
        if action.requestor == "assistant" and not _called(action, calls)
    ]
    passed = (
        (db_match or "DB" not in basis)
        and (not missing_facts or "COMMUNICATE" not in basis)
        and (not missing_actions or "ACTION" not in basis)
    )
    return DomainScore(
        float(passed),
        db_match,
        gold.state_hash != initial,
        missing_facts,
        missing_actions if "ACTION" in basis else [],
        gold.errors,
        len(criteria.nl_assertions or []),
    )


# ---------------------------------------------------------------------- training rows
def to_task_row(
    domain: Domain,
    task: DomainTask,
    preference: dict[str, float] | None = None,
    instruction: str | None = None,
    extra_tools: Sequence[str] = (),
) -> Task:
    """The orchestrator row of a domain task: the domain policy as the system prompt, the user
    scenario (and the preference instruction, when given) as the question, the domain's tools
    plus ``extra_tools`` (e.g. experts), and what the rewards need in ``metadata``: the scorer
    (``database``), the domain, the task itself, its preference vector and difficulty."""
    question = (
        task.scenario_text() if instruction is None else (f"{task.scenario_text()}\n{instruction}")
    )
    metadata: dict[str, Any] = {
        "benchmark": "toolscale",
        "scorer": "database",
        "domain": domain.name,
        "difficulty": len(task.gold_actions),
        "domain_task": task.to_json(),
    }
    if preference is not None:
        metadata["preference"] = preference
    if instruction is not None:
        metadata["instruction"] = instruction
    return Task(
        id=f"{domain.name}/{task.id}",
        question=question,
        system=domain.spec.policy,
        tools=(*domain.spec.tools, *extra_tools),
        metadata=metadata,
    )
