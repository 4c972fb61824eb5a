"""tau2-bench (customer-service domains: retail, airline, telecom) as one of our environments.

A domain's tools become our :class:`~nemo_orch.tools.base.Tool` implementations, with tau2's own
OpenAI schemas, so the policy sees what tau2's agents see; each episode runs on its own fresh
tau2 ``Environment``, so observations are byte-identical to tau2's. Its tasks become our task
rows: the domain policy is the system prompt, and the user's scenario is either stated up front
(no one answers: not tau2-bench's protocol) or played by an LLM user
(:mod:`nemo_orch.envs.tau2.user`). Episodes are scored by tau2's own evaluator on the episode's
transcript carrying our executor's outputs, so a score here is a tau2 score.

User-side tools (telecom's phone) are a second toolset, run by the user (the LLM's calls, or a
gold replay's) on the same per-episode environment; the assistant never sees them.

Domains outside tau2 (directories in its layout) join its registry first
(:mod:`nemo_orch.envs.tau2.external`); from then on they are tau2 domains like any other.

tau2 is an optional extra (``pip install 'nemo-orch[tau2]'``), imported only when used.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pydantic

from nemo_orch.call_kinds import CallKind
from nemo_orch.data.domain_tasks import DomainTask
from nemo_orch.data.jsonl import DataError
from nemo_orch.data.records import read_records
from nemo_orch.data.tasks import Task
from nemo_orch.envs.clock import domain_clock
from nemo_orch.rollout.trajectory import Termination
from nemo_orch.tools.base import BaseTool, ToolContext, ToolResult, ToolSpec
from nemo_orch.tools.domain import EpisodeStates
from nemo_orch.tools.registry import Toolbox

logger = logging.getLogger(__name__)

BENCHMARK = "tau2"
ASSISTANT, USER = "assistant", "user"
INSTALL_HINT = "pip install 'nemo-orch[tau2]'"
# A retail environment holds ~13 MB of database; this bounds the episodes alive at once.
DEFAULT_MAX_EPISODES = 64
_ERROR_PREFIX = "Error: "  # how tau2 writes a failed call's output


class Tau2Error(DataError):
    """tau2 is missing, or a domain, split or task it does not have was asked for."""


@functools.cache
def _tau2() -> SimpleNamespace:
    """The tau2 modules this adapter uses, imported on first use."""
    # litellm (imported by tau2) otherwise fetches its model price map over the network.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        from loguru import logger as tau2_logger

        # tau2 logs its registry on import, and every tool response, at DEBUG level to stderr.
        tau2_logger.disable("tau2")
        from tau2.agent import llm_agent
        from tau2.data_model import message, simulation, tasks
        from tau2.environment import db, environment, toolkit
        from tau2.evaluator import evaluator
        from tau2.metrics import agent_metrics
        from tau2.orchestrator import orchestrator
        from tau2.registry import registry
        from tau2.user import base as user_base
        from tau2.user import user_simulator
        from tau2.utils import llm_utils
    except ImportError as error:
        raise Tau2Error(f"tau2-bench needs the tau2 extra ({INSTALL_HINT}): {error}") from None
    return SimpleNamespace(
        message=message,
        simulation=simulation,
        tasks=tasks,
        llm_agent=llm_agent,
        evaluator=evaluator,
        registry=registry,
        orchestrator=orchestrator,
        user_simulator=user_simulator,
        user_base=user_base,
        llm_utils=llm_utils,
        agent_metrics=agent_metrics,
        db=db,
        environment=environment,
        toolkit=toolkit,
    )


def domains() -> list[str]:
    """The tau2 domains that have both an environment and tasks."""
    registry = _tau2().registry
    return sorted(set(registry.get_domains()) & set(registry.get_task_sets()))


def _check_domain(domain: str) -> None:
    if domain not in domains():
        raise Tau2Error(f"unknown tau2 domain {domain!r}; domains: {', '.join(domains())}")


def splits(domain: str) -> list[str]:
    """The task splits of a domain (e.g. ``train``, ``test``, ``base``)."""
    _check_domain(domain)
    load_splits = _tau2().registry.get_task_splits_loader(domain)
    return [] if load_splits is None else sorted(load_splits())


def tau2_task_of(task: Task) -> Any:
    """The tau2 task a row was made from (kept whole in its metadata)."""
    if task.metadata.get("benchmark") != BENCHMARK:
        raise Tau2Error(f"task {task.id!r} is not a tau2 task")
    return _tau2().tasks.Task.model_validate(task.metadata["tau2_task"])


@dataclass
class Tau2Episode:
    """An episode's tau2 environment and its transcript, in order: every message between agent
    and user, and every message of calls, by its requestor, with the text written beside them.
    Every call of a domain tool reaches the environment, whatever its arguments (see
    :func:`_spec`); only a call that names no tool of the domain or is not JSON never does, and
    changes nothing. tau2's evaluator replays the transcript."""

    environment: Any
    turns: list[Turn] = field(default_factory=list)
    # The (requestor, turn) of the last message of calls, while its calls are still coming.
    _open: tuple[str, int] | None = None

    def say(self, role: str, text: str) -> None:
        """A message between agent and user."""
        self.turns.append(Turn(role, text=text))
        self._open = None

    def record_call(self, requestor: str, context: ToolContext, call: ExecutedCall) -> None:
        """A call that reached the environment: part of its requestor's message of that turn
        (``context.turn``), which carries the text written beside the calls."""
        if self._open == (requestor, context.turn):
            last = self.turns[-1]
            self.turns[-1] = Turn(requestor, last.text, (*last.calls, call))
        else:
            self.turns.append(Turn(requestor, context.message, (call,)))
            self._open = (requestor, context.turn)


def episode_environments(
    domain: str, max_episodes: int = DEFAULT_MAX_EPISODES
) -> EpisodeStates[Tau2Episode]:
    """One fresh tau2 environment per episode, in its task's initial state, made on the
    episode's first call and shared by its assistant and user tools."""
    _check_domain(domain)
    make_environment = _tau2().registry.get_env_constructor(domain)

    def make(context: ToolContext) -> Any:
        if context.task is None:
            raise Tau2Error("a tau2 tool needs the task in its call context")
        if context.task.metadata.get("domain") != domain:
            raise Tau2Error(f"task {context.task.id!r} is not a {domain} task")
        initial = tau2_task_of(context.task).initial_state
        environment = make_environment()
        if initial is not None:
            environment.set_state(
                initial.initialization_data,
                initial.initialization_actions,
                initial.message_history or [],
            )
        return Tau2Episode(environment)

    return EpisodeStates(make, max_episodes)


class Tau2Tool(BaseTool):
    """One tau2 tool, called as ``requestor`` (assistant or user) on the episode's environment.
    tau2's tools are in-memory and take milliseconds, so they run inline."""

    def __init__(
        self, spec: ToolSpec, requestor: str, environments: EpisodeStates[Tau2Episode]
    ) -> None:
        super().__init__(spec)
        self.requestor, self.environments = requestor, environments

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        try:
            # The clock every run of the task's tools sees (a new episode's environment runs
            # the task's initialization actions): the evaluator's replays see it too.
            with domain_clock():
                episode = self.environments.get(context)
        except Tau2Error as error:  # the task's environment cannot be built: not the call's
            return ToolResult(error=str(error), kind=CallKind.INFRA_ERROR)
        tool_call = _tau2().message.ToolCall(
            name=self.spec.name, arguments=arguments, requestor=self.requestor
        )
        with domain_clock():
            response = episode.environment.get_response(tool_call)
        # Our observation of an error is "Error: <error>": the same text as tau2's.
        result = (
            ToolResult(error=response.content.removeprefix(_ERROR_PREFIX))
            if response.error
            else ToolResult(output=response.content)
        )
        episode.record_call(
            self.requestor, context, ExecutedCall(self.spec.name, arguments, result)
        )
        return result


def _spec(tau2_tool: Any) -> ToolSpec:
    """A tau2 tool as the policy sees it. Its calls reach tau2's dispatch whatever their
    arguments, as in tau2's orchestrator: a call the schema rejects fails there with tau2's own
    error, is recorded and counts toward ``max_errors``, and its evaluator scores it."""
    function = tau2_tool.openai_schema["function"]
    return ToolSpec(
        name=function["name"],
        description=function["description"],
        parameters=function["parameters"],
        strict_arguments=False,
    )


def to_task(tau2_task: Any, domain: str, policy: str, tool_names: Sequence[str]) -> Task:
    """Our task row for a tau2 task; its metadata keeps the whole tau2 task for scoring."""
    record = tau2_task.model_dump(mode="json")
    return Task(
        id=f"{BENCHMARK}-{domain}-{tau2_task.id}",
        question=DomainTask.model_validate(record).scenario_text(),
        system=policy,
        tools=tuple(tool_names),
        metadata={"benchmark": BENCHMARK, "domain": domain, "tau2_task": record},
    )


@dataclass
class Tau2Domain:
    """A loaded domain: its policy, the tasks of a split, and both toolsets, whose tools share
    the per-episode ``environments``."""

    name: str
    split: str
    policy: str
    tasks: list[Task]
    assistant_tools: list[Tau2Tool]
    user_tools: list[Tau2Tool]
    environments: EpisodeStates[Tau2Episode]

    def assistant_toolbox(self) -> Toolbox:
        return Toolbox(self.assistant_tools)

    def user_toolbox(self) -> Toolbox:
        return Toolbox(self.user_tools)


def agent_system_prompt(policy: str) -> str:
    """The system prompt tau2's ``LLMAgent`` runs with: its agent instructions and the domain
    ``policy`` in its ``<instructions>`` / ``<policy>`` frame."""
    llm_agent = _tau2().llm_agent
    return llm_agent.SYSTEM_PROMPT.format(
        agent_instruction=llm_agent.AGENT_INSTRUCTION, domain_policy=policy
    )


def load_domain(
    domain: str,
    split: str,
    max_episodes: int = DEFAULT_MAX_EPISODES,
    tasks_path: str | Path | None = None,
    llm_agent_prompt: bool = False,
) -> Tau2Domain:
    """A tau2 domain as our environment, with the tasks of ``split`` (a domain without splits,
    such as ``mock``, has one set of tasks, which every split names), or with the domain's rows
    of the task file ``tasks_path`` instead (one set of tasks, which every split names; see
    :func:`read_task_file`). The tasks' system prompt is the domain policy, or with
    ``llm_agent_prompt`` (tau2-bench's protocol) tau2's agent prompt around it
    (:func:`agent_system_prompt`)."""
    available = splits(domain)
    if tasks_path is None and available and split not in available:
        raise Tau2Error(
            f"tau2 domain {domain!r} has no split {split!r}; splits: "
            f"{', '.join(available) or 'none'}"
        )
    registry = _tau2().registry
    environments = episode_environments(domain, max_episodes)
    template = registry.get_env_constructor(domain)()
    assistant_tools = [
        Tau2Tool(_spec(tool), ASSISTANT, environments) for tool in template.get_tools()
    ]
    user_tools = (
        []
        if template.user_tools is None
        else [Tau2Tool(_spec(tool), USER, environments) for tool in template.get_user_tools()]
    )
    policy, names = template.get_policy(), [tool.spec.name for tool in assistant_tools]
    if tasks_path is None:
        loaded = registry.get_tasks_loader(domain)(split if available else None)
    else:
        loaded = read_task_file(
            tasks_path,
            domain,
            {tool.spec.name: tool.spec.parameters for tool in [*assistant_tools, *user_tools]},
        )
    system = agent_system_prompt(policy) if llm_agent_prompt else policy
    tasks = [to_task(tau2_task, domain, system, names) for tau2_task in loaded]
    return Tau2Domain(domain, split, policy, tasks, assistant_tools, user_tools, environments)


@dataclass(frozen=True)
class ExecutedCall:
    """A tool call and what our executor returned for it."""

    name: str
    arguments: dict[str, Any]
    result: ToolResult


@dataclass(frozen=True)
class Turn:
    """One message of an episode: its sender (assistant or user), its text and its calls."""

    role: str
    text: str | None = None
    calls: tuple[ExecutedCall, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in (ASSISTANT, USER):
            raise ValueError(f"a turn's role is {ASSISTANT!r} or {USER!r}, not {self.role!r}")


def to_tau2_messages(tau2_task: Any, turns: Sequence[Turn]) -> list[Any]:
    """The tau2 trajectory of an episode: the task's message history, then every turn with its
    tool calls, each followed by our executor's output as the tool message."""
    message = _tau2().message
    initial = tau2_task.initial_state
    messages = list(initial.message_history or []) if initial is not None else []
    call_index = 0
    for turn in turns:
        tool_calls, tool_messages = [], []
        for call in turn.calls:
            call_id = f"call_{call_index}"
            call_index += 1
            tool_calls.append(
                message.ToolCall(
                    id=call_id, name=call.name, arguments=call.arguments, requestor=turn.role
                )
            )
            tool_messages.append(
                message.ToolMessage(
                    id=call_id,
                    role="tool",
                    content=call.result.observation,
                    requestor=turn.role,
                    error=call.result.error is not None,
                )
            )
        sender = message.AssistantMessage if turn.role == ASSISTANT else message.UserMessage
        messages.append(sender(role=turn.role, content=turn.text, tool_calls=tool_calls or None))
        messages.extend(tool_messages)
    return messages


@dataclass(frozen=True)
class Tau2Score:
    """tau2's verdict on an episode: the reward, its breakdown (the reward basis' components
    and every check) and, when the reward is not 1, why."""

    reward: float
    breakdown: dict[str, Any] = field(default_factory=dict)
    failures: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        # tau2 counts a task as solved at reward 1 (up to rounding).
        return math.isclose(self.reward, 1.0, abs_tol=1e-6)

    def to_json(self) -> dict[str, Any]:
        return {
            "reward": self.reward,
            "passed": self.passed,
            "breakdown": self.breakdown,
            "failures": list(self.failures),
        }


def _call_text(requestor: str, name: str, arguments: dict[str, Any]) -> str:
    listed = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
    return f"{requestor}.{name}({listed})"


def breakdown(info: Any) -> dict[str, Any]:
    """tau2's reward info as a report lists it: the reward basis, its components and every
    check (database, assertions, actions, communicated facts)."""
    return {
        "reward_basis": [basis.value for basis in info.reward_basis or []],
        "components": {
            basis.value: value for basis, value in (info.reward_breakdown or {}).items()
        },
        "db_match": None if info.db_check is None else info.db_check.db_match,
        "env_assertions": [
            {
                "assertion": _call_text(
                    check.env_assertion.env_type,
                    check.env_assertion.func_name,
                    check.env_assertion.arguments,
                ),
                "met": check.met,
            }
            for check in info.env_assertions or []
        ],
        "actions": [
            {
                "action": _call_text(
                    check.action.requestor, check.action.name, check.action.arguments
                ),
                "matched": check.action_match,
            }
            for check in info.action_checks or []
        ],
        "communicate": [
            {"info": check.info, "met": check.met} for check in info.communicate_checks or []
        ],
    }


def _failures(breakdown: dict[str, Any]) -> list[str]:
    """Why a reward is below 1: the failed checks of the components that count."""
    failed = {basis for basis, value in breakdown["components"].items() if value < 1.0}
    reasons = []
    if "DB" in failed:
        reasons.append("the database differs from the one the gold actions leave")
    if "ENV_ASSERTION" in failed:
        reasons += [
            f"assertion not met: {check['assertion']}"
            for check in breakdown["env_assertions"]
            if not check["met"]
        ]
    if "ACTION" in failed:
        reasons += [
            f"gold action not taken: {check['action']}"
            for check in breakdown["actions"]
            if not check["matched"]
        ]
    if "COMMUNICATE" in failed:
        reasons += [
            f"not told to the user: {check['info']!r}"
            for check in breakdown["communicate"]
            if not check["met"]
        ]
    return reasons


def recorded_turns(
    domain: Tau2Domain, task: Task, episode_id: str, seed: int, closing: str | None = None
) -> list[Turn]:
    """An episode the episode runner played (its calls went through the domain's toolboxes,
    its messages through the user) as tau2 turns: its transcript, then ``closing`` as the
    assistant's last message (the answer of an episode without a user)."""
    episode = domain.environments.get(
        ToolContext(task_id=task.id, episode_id=episode_id, seed=seed, task=task)
    )
    closed = [] if closing is None else [Turn(ASSISTANT, text=closing)]
    return [*episode.turns, *closed]


# How tau2 names the ends of our episodes; the evaluator scores only the agent's or the user's
# stop, everything else is 0 (ours without a tau2 name are the agent's failures).
_TERMINATIONS = {
    Termination.ANSWER: "AGENT_STOP",
    Termination.USER_STOP: "USER_STOP",
    Termination.MAX_STEPS: "MAX_STEPS",
    Termination.TOO_MANY_ERRORS: "TOO_MANY_ERRORS",
    Termination.USER_ERROR: "USER_ERROR",
}


def score_episode(
    task: Task, turns: Sequence[Turn], termination: Termination = Termination.ANSWER
) -> Tau2Score:
    """Score an episode that ended with our ``termination``, with tau2's evaluator (database,
    assertions, actions and communicated facts, as the task's reward basis says)."""
    tau2 = _tau2()
    tau2_task = tau2_task_of(task)
    reason = tau2.simulation.TerminationReason[_TERMINATIONS.get(termination, "AGENT_ERROR")]
    run = tau2.simulation.SimulationRun(
        id=f"{task.id}-episode",
        task_id=tau2_task.id,
        start_time="",
        end_time="",
        duration=0.0,
        termination_reason=reason,
        messages=to_tau2_messages(tau2_task, turns),
    )
    try:
        # tau2 replays the episode's calls and the gold actions on fresh environments: at the
        # instant the episode's tools ran, so a tool that stores the time writes the same.
        with domain_clock():
            info = tau2.evaluator.evaluate_simulation(
                run,
                tau2_task,
                tau2.evaluator.EvaluationType.ALL,
                solo_mode=False,
                domain=task.metadata["domain"],
            )
    except ValueError as error:
        # tau2 replays the trajectory and refuses one whose tool outputs it does not reproduce.
        return Tau2Score(0.0, failures=(f"tau2 could not replay the episode: {error}",))
    checks = breakdown(info)
    failures = _failures(checks)
    if info.reward < 1.0 and not failures:
        failures = [f"tau2: {info.info}"]
    return Tau2Score(info.reward, checks, tuple(failures))


def read_task_file(path: str | Path, domain: str, tools: dict[str, dict[str, Any]]) -> list[Any]:
    """The tau2 tasks of ``domain`` in a ToolScale file of the published layout (or a
    ``.json`` / ``.jsonl`` list of tau2 tasks): the rows whose
    ``user_scenario.instructions.domain`` is ``domain``, read as ToolScale's reader reads them
    (null keys dropped, action arguments fitted to the tools; ``tools``: each tool's JSON-schema
    ``parameters``). A row that is not a tau2 task is an error naming ``file[row N]``."""
    from nemo_orch.envs.toolscale.parquet import domain_of, published_record

    named: collections.Counter[str] = collections.Counter()
    rows = []
    for where, row in read_records(path):
        name = domain_of(row, where)
        named[name] += 1
        if name == domain:
            rows.append((where, published_record(row, tools)))
    if not rows:
        listed = ", ".join(f"{name} ({count})" for name, count in sorted(named.items()))
        raise Tau2Error(f"{path}: no task of tau2 domain {domain!r}; its rows name {listed}")
    return tau2_tasks(rows)


def tau2_tasks(rows: Iterable[tuple[str, dict[str, Any]]]) -> list[Any]:
    """tau2 ``Task`` objects from ``(where, record)`` rows; a row that is not one, or a repeated
    id, is a :class:`Tau2Error` naming ``where``."""
    model = _tau2().tasks.Task
    tasks, seen = [], set()
    for where, record in rows:
        try:
            task = model.model_validate(record)
        except pydantic.ValidationError as error:
            first = error.errors()[0]
            location = ".".join(map(str, first["loc"])) or "task"
            raise Tau2Error(
                f"{where}: not a tau2 task: {location}: {first['msg']} "
                f"({error.error_count()} problem(s))"
            ) from None
        if task.id in seen:
            raise Tau2Error(f"{where}: duplicate task id {task.id!r}")
        seen.add(task.id)
        tasks.append(task)
    return tasks
