"""tau2-bench evaluation: run an agent on every task of a (domain, split), score each episode with
tau2's own evaluator, and write ``report.json`` and ``report.md``.

Agents (:data:`AGENTS`):

* ``gold-replay`` sends every gold action of the task (the assistant's and the scripted user's)
  through our executor, then tells the user every fact the task requires. It checks the adapter,
  not a model: our tools, trajectories and scoring must reproduce tau2 exactly, so every task
  must pass.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_orch.data.tasks import Task
from nemo_orch.data.tau2_bench import (ASSISTANT, BENCHMARK, ExecutedCall, Tau2Domain,
                                       Tau2Error, Tau2Score, Turn, load_domain, score_episode,
                                       tau2_task_of)
from nemo_orch.tools.base import ToolContext
from nemo_orch.tools.registry import Toolbox

# An agent plays one episode: the task, the assistant's and the user's toolboxes, and the
# context every call of the episode carries.
Agent = Callable[[Task, Toolbox, Toolbox, ToolContext], Awaitable[list[Turn]]]


def final_message(facts: list[str]) -> str:
    """The assistant's closing message, stating every fact the user must be told."""
    if not facts:
        return "Your request has been handled."
    return "Your request has been handled. For your records: " + "; ".join(facts) + "."


async def gold_replay(task: Task, assistant: Toolbox, user: Toolbox,
                      context: ToolContext) -> list[Turn]:
    """The task's gold actions, in order, each by its requestor, then the closing message."""
    criteria = tau2_task_of(task).evaluation_criteria
    actions, facts = ([], []) if criteria is None else (criteria.actions or [],
                                                         criteria.communicate_info or [])
    turns = []
    for action in actions:
        toolbox = assistant if action.requestor == ASSISTANT else user
        result = await toolbox.call(action.name, action.arguments, context)
        turns.append(Turn(action.requestor,
                          calls=(ExecutedCall(action.name, action.arguments, result),)))
    turns.append(Turn(ASSISTANT, text=final_message(facts)))
    return turns


AGENTS: dict[str, Agent] = {"gold-replay": gold_replay}


@dataclass(frozen=True)
class TaskResult:
    """One task's score, the tool calls that failed on the way, and the seconds it took
    (agent and scoring)."""

    task_id: str
    score: Tau2Score
    tool_errors: tuple[str, ...]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"task_id": self.task_id, **self.score.to_json(),
                "tool_errors": list(self.tool_errors), "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class Tau2Report:
    """An agent's results on the tasks of a domain's split, and the seconds they took."""

    domain: str
    split: str
    agent: str
    results: list[TaskResult]
    seconds: float

    @property
    def passed(self) -> int:
        return sum(result.score.passed for result in self.results)

    @property
    def pass_rate(self) -> float:
        return self.passed / len(self.results) if self.results else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"benchmark": BENCHMARK, "domain": self.domain, "split": self.split,
                "agent": self.agent, "tasks": len(self.results), "passed": self.passed,
                "pass_rate": self.pass_rate, "seconds": round(self.seconds, 3),
                "results": [result.to_json() for result in self.results]}


def _tool_errors(turns: list[Turn]) -> tuple[str, ...]:
    return tuple(f"{turn.role}.{call.name}: {call.result.observation}"
                 for turn in turns for call in turn.calls if call.result.error is not None)


async def _run_task(domain: Tau2Domain, task: Task, agent_name: str) -> TaskResult:
    started = time.perf_counter()
    context = ToolContext(task_id=task.id, episode_id=f"{task.id}/{agent_name}", task=task)
    try:
        turns = await AGENTS[agent_name](task, domain.assistant_toolbox(),
                                         domain.user_toolbox(), context)
    finally:
        domain.environments.release(context.episode_id)
    score = score_episode(task, turns)
    return TaskResult(task.id, score, _tool_errors(turns), time.perf_counter() - started)


def run(domain_name: str, split: str, agent_name: str, limit: int | None = None) -> Tau2Report:
    """Run ``agent_name`` on the first ``limit`` tasks (None: all) of a tau2 domain's split."""
    if agent_name not in AGENTS:
        raise Tau2Error(f"unknown tau2 agent {agent_name!r}; agents: {', '.join(AGENTS)}")
    if limit is not None and limit < 1:
        raise Tau2Error(f"limit must be >= 1, got {limit}")
    started = time.perf_counter()
    domain = load_domain(domain_name, split)

    async def run_all() -> list[TaskResult]:
        # One task at a time: tau2 runs in memory and its evaluator is pure Python.
        return [await _run_task(domain, task, agent_name) for task in domain.tasks[:limit]]

    results = asyncio.run(run_all())
    return Tau2Report(domain_name, split, agent_name, results, time.perf_counter() - started)


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def report_markdown(report: Tau2Report) -> str:
    lines = [f"# tau2-bench {report.domain} / {report.split}, agent {report.agent}", "",
             f"Pass rate **{report.pass_rate:.3f}** ({report.passed}/{len(report.results)} "
             f"tasks) in {report.seconds:.1f} s.", "",
             "| task | reward | seconds | failures |", "|---|---|---|---|"]
    for result in report.results:
        failures = "; ".join(result.score.failures) or "-"
        lines.append(f"| {_markdown_cell(result.task_id)} | {result.score.reward:g} | "
                     f"{result.seconds:.2f} | {_markdown_cell(failures)} |")
    return "\n".join(lines) + "\n"


def write_report(report: Tau2Report, out_dir: str | Path) -> Path:
    """Write ``report.json`` and ``report.md`` into ``out_dir``; returns the JSON's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.md").write_text(report_markdown(report))
    path = out_dir / "report.json"
    path.write_text(json.dumps(report.to_json(), indent=2, ensure_ascii=False) + "\n")
    return path
