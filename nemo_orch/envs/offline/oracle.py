"""The offline world's routes and its oracle: which route an episode took, the best route of
every task under its preference (expected values from the simulated experts' known accuracies
and prices), and how near a route taken comes to it (preference adherence).

A route is how an episode answered. On ToolOrchestra's interface (:mod:`.orchestra`): the
model aliases of its calls in order (``search-2>answer-4``). On the basic one:
``expert:<alias>`` (the first expert it asked), ``tools+expert:<alias>`` (basic tools before
it), ``tools`` (only basic tools). ``none`` without calls. Tasks are grouped by (family,
preference), the unit of the main job's route mix.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import Any

from nemo_orch.data.tasks import Task
from nemo_orch.envs.offline import orchestra
from nemo_orch.envs.offline.values import RouteValue, best
from nemo_orch.envs.offline.world import route_values
from nemo_orch.rollout.trajectory import Trajectory
from nemo_orch.tools.base import Usage
from nemo_orch.tools.interfaces import EXPERT_TOOL, ORCHESTRA_TOOLS, offers_orchestra
from nemo_orch.tools.registry import Toolbox
from nemo_orch.tools.simulated_expert import SimulatedExpert

NO_ROUTE = "none"


def route_of(trajectory: Trajectory) -> str:
    """The route an episode took (see the module docstring)."""
    calls = [
        call
        for turn in trajectory.turns
        for call in turn.calls
        if call.tool is not None and call.error is None
    ]
    if any(
        call.tool in (orchestra.REASON, orchestra.ANSWER)
        or call.tool == orchestra.SEARCH
        and "model" in call.arguments
        for call in calls
    ):
        return orchestra.route_name((call.tool, call.arguments) for call in calls)
    first_expert = next(
        (index for index, call in enumerate(calls) if call.tool == EXPERT_TOOL), None
    )
    if first_expert is not None:
        expert = f"expert:{calls[first_expert].arguments['model']}"
        return f"tools+{expert}" if first_expert else expert
    return "tools" if calls else NO_ROUTE


def group_key(task: Task) -> str:
    return f"{task.metadata['family']}/{task.metadata['preference_name']}"


def route_shares(tasks: list[Task], routes: list[str]) -> dict[str, dict[str, float]]:
    """The share of each route per (family, preference) group (``routes[i]``: the route of an
    episode of ``tasks[i]``)."""
    by_group: dict[str, list[str]] = defaultdict(list)
    for task, route in zip(tasks, routes):
        by_group[group_key(task)].append(route)
    return {
        group: {route: count / len(members) for route, count in sorted(Counter(members).items())}
        for group, members in sorted(by_group.items())
    }


def group_means(
    tasks: list[Task], columns: Mapping[str, list[float]]
) -> dict[str, dict[str, float]]:
    """Per (family, preference) group: its number of tasks and the mean of each column
    (``columns[name][i]``: the value of ``tasks[i]``)."""
    rows: dict[str, list[int]] = defaultdict(list)
    for index, task in enumerate(tasks):
        rows[group_key(task)].append(index)
    return {
        group: {
            "tasks": len(members),
            **{
                name: statistics.mean(values[i] for i in members)
                for name, values in columns.items()
            },
        }
        for group, members in sorted(rows.items())
    }


def knows_experts(toolbox: Toolbox) -> bool:
    """Whether the oracle knows the toolbox's experts: the simulated world's, behind
    ToolOrchestra's composites or as the basic interface's expert tool."""
    if offers_orchestra(toolbox.tools):
        return all(
            isinstance(getattr(toolbox.tools[name], "expert", None), SimulatedExpert)
            for name in ORCHESTRA_TOOLS
        )
    return isinstance(toolbox.tools.get(EXPERT_TOOL), SimulatedExpert)


class OracleTable:
    """The best route of every task under its preference, from the known simulated experts, on
    the toolbox's interface. A route's price counts the policy's own tokens too, so it depends
    on the policy's ``tokenizer`` and the orchestrator's prices (USD per input and output
    token)."""

    def __init__(
        self,
        toolbox: Toolbox,
        tokenizer: Any,
        usd_reference: float,
        orchestrator_usd_per_token: tuple[float, float],
    ) -> None:
        self.toolbox, self.tokenizer = toolbox, tokenizer
        self.usd_reference = usd_reference
        self.input_price, self.output_price = orchestrator_usd_per_token
        # ToolOrchestra's interface: its writers; the basic one: its expert and tool fees.
        self.writers = orchestra.Writers.of(toolbox) if offers_orchestra(toolbox.tools) else None
        if self.writers is None:
            self.expert = toolbox.tools[EXPERT_TOOL]
            self.tool_usd = {
                name: tool.spec.pricing.cost(Usage(), tool.spec.latency_hint_s)
                for name, tool in toolbox.tools.items()
                if name != EXPERT_TOOL
            }
        self._values: dict[str, list[RouteValue]] = {}  # by task id: every report asks again

    def values(self, task: Task) -> list[RouteValue]:
        if task.id not in self._values:
            self._values[task.id] = self._route_values(task)
        return self._values[task.id]

    def _route_values(self, task: Task) -> list[RouteValue]:
        messages = ([{"role": "system", "content": task.system}] if task.system else []) + [
            {"role": "user", "content": task.question}
        ]
        prompt = self.tokenizer.apply_chat_template(
            messages, tools=self.toolbox.schemas(), tokenize=False, add_generation_prompt=True
        )
        # Each turn reads the context (the prompt, plus a little per earlier turn) and writes
        # ~32 tokens.
        per_turn = (
            self.input_price * (len(self.tokenizer.encode(prompt)) + 48) + self.output_price * 32
        )
        if self.writers is not None:
            return orchestra.route_values(task, self.writers, per_turn, self.usd_reference)
        return route_values(task, self.expert, per_turn, self.usd_reference, self.tool_usd)

    def best(self, task: Task) -> RouteValue:
        return best(self.values(task))

    def value(self, task: Task, route: str) -> RouteValue | None:
        """The expectations of ``route`` on ``task``; None for a route the world does not
        price (``none``, or calls no route is made of)."""
        return next((value for value in self.values(task) if value.route == route), None)

    def adherence(self, task: Task, route: str) -> float:
        """The expected utility of ``route`` for the task's preference over the best route's,
        in [0, 1] (0 for a route that cannot answer, such as ``none``)."""
        best, value = self.best(task), self.value(task, route)
        taken = 0.0 if value is None else value.utility
        if best.utility <= 0:
            return float(route == best.route)
        return min(max(taken / best.utility, 0.0), 1.0)

    def preference_adherence(self, task: Task, trajectory: Trajectory) -> float:
        """:meth:`adherence` of the route an episode took."""
        return self.adherence(task, route_of(trajectory))

    def report(self, tasks: list[Task]) -> dict[str, Any]:
        """The oracle's own row: expected reward, accuracy and USD of the best routes (its
        ``expected_*`` figures are the same)."""
        best = [self.best(task) for task in tasks]
        utilities, accuracies = [v.utility for v in best], [v.accuracy for v in best]
        reward, accuracy = statistics.mean(utilities), statistics.mean(accuracies)
        return {
            "reward": reward,
            "accuracy": accuracy,
            "expected_reward": reward,
            "expected_accuracy": accuracy,
            "usd_per_task": statistics.mean(v.usd for v in best),
            "seconds_per_task": None,
            "pref_adherence": 1.0,
            "oracle_route_share": 1.0,
            "format_error_rate": 0.0,
            "tool_mix": route_shares(tasks, [v.route for v in best]),
            "groups": group_means(
                tasks,
                {
                    "reward": utilities,
                    "accuracy": accuracies,
                    "expected_reward": utilities,
                    "expected_accuracy": accuracies,
                },
            ),
        }


def oracle_route_share(table: OracleTable, tasks: list[Task], routes: list[str]) -> float:
    """The share of tasks answered by exactly the oracle's route."""
    return statistics.mean(
        float(route == table.best(task).route) for task, route in zip(tasks, routes)
    )
