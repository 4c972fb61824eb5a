"""The offline environment of the main job: tasks where the right tool matters, each with a
preference vector the policy reads as an instruction, naive routers for demonstrations, and the
oracle that knows the simulated experts.

* Families (see :mod:`nemo_orch.envs.offline.task_families`): arithmetic (the sandbox is exact and
  nearly free), lookups in the made-up world (only the retriever's bundled corpus holds the
  facts), lookup then compute, number theory (experts only; easy or hard) and word puzzles (the
  generalist's domain).
* Experts are handed the task and the episode's observations, and their answer ends the episode
  (ToolOrchestra's ``answer`` tool): a lookup is answered by the policy reading the passage
  itself (``tools``), or by retrieving it and handing it to an expert (``tools+expert:<alias>``),
  not by an expert alone, who does not know the made-up world.
* Preferences: a vector over ``accuracy``, ``cost`` and tool call counts (``tool:<name>``,
  negative weight: avoid), stated after the question in the user's message (a phrasing of
  :func:`~nemo_orch.reward.components.preference_instruction`, as the served orchestrator
  states it).
* Utility (for evaluation and the oracle, on an absolute scale): :func:`~.values.utility`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from typing import Any

from nemo_orch.config import DEMO_ROUTERS
from nemo_orch.data.tasks import Task
from nemo_orch.envs.offline import orchestra
from nemo_orch.envs.offline.task_families import draw_task
from nemo_orch.envs.offline.values import RouteValue, utility
from nemo_orch.reward.components import PREFERENCE_PHRASES, preference_instruction
from nemo_orch.tools.interfaces import EXPERT_TOOL, offers_orchestra
from nemo_orch.tools.simulated_expert import SimulatedExpert

PREFERENCE_VECTORS: dict[str, dict[str, float]] = {
    "accuracy": {"accuracy": 1.0},
    "cost": {"accuracy": 1.0, "cost": 1.0},
    "neutral": {"accuracy": 1.0, "cost": 0.3},
    "no_code": {"accuracy": 1.0, "tool:python_sandbox": -1.0},
}
# The preferences a family's tasks get: each changes what the best route is for some of them.
FAMILY_PREFERENCES: dict[str, tuple[str, ...]] = {
    "arithmetic": ("accuracy", "cost", "no_code"),
    "lookup": ("accuracy", "cost", "neutral"),
    "lookup_compute": ("accuracy", "cost", "neutral"),
    "math": ("accuracy", "cost", "neutral"),
    "word": ("accuracy", "cost"),
}
SYSTEM_PROMPT = (
    "You are an orchestrator that answers questions by calling tools. "
    "Finish with the final answer inside <answer></answer> tags."
)
# The two tool interfaces of the world: ToolOrchestra's (orchestra.py: the policy chooses tools
# and models, experts write) and the basic one (call_expert, python_sandbox, search(query?):
# the policy writes code and reads passages itself).
ORCHESTRA, BASIC = "orchestra", "basic"
# A route is the tool calls that answer a task: the family's exact tools, or one expert.
Route = tuple[tuple[str, dict[str, Any]], ...]


def interface_of(tool_names: Iterable[str]) -> str:
    return ORCHESTRA if offers_orchestra(tool_names) else BASIC


# Held-out tasks are drawn with this seed whatever the run's: the main job's evaluation and
# `nemo-orch eval --benchmark offline` see the same tasks for every training seed, and training
# never does.
HELD_OUT_SEED = 9153


def held_out_tasks(n: int, interface: str) -> list[Task]:
    """The first ``n`` held-out evaluation tasks of the ``interface``'s world."""
    return make_tasks(n, seed=HELD_OUT_SEED, prefix="eval", interface=interface)


def _preferences(
    interface: str,
) -> tuple[Mapping[str, tuple[str, ...]], Mapping[str, dict[str, float]]]:
    """The ``interface``'s preferences per family and their vectors."""
    return (
        (orchestra.FAMILY_PREFERENCES, orchestra.PREFERENCE_VECTORS)
        if interface == ORCHESTRA
        else (FAMILY_PREFERENCES, PREFERENCE_VECTORS)
    )


def _stated(preference: str, interface: str, rng: random.Random) -> dict[str, Any]:
    """What a task's metadata holds of its ``preference``, its instruction drawn with ``rng``."""
    vectors = _preferences(interface)[1]
    instruction = orchestra.instruction(preference, rng) or preference_instruction(
        vectors[preference], rng
    )
    return {
        "preference_name": preference,
        "instruction": instruction,
        "preference": vectors[preference],
    }


def _budget(preference: str, interface: str) -> dict[str, float]:
    """The USD budget a task of ``preference`` states (none but a budget's)."""
    return (
        {"budget_usd": orchestra.BUDGET_USD}
        if interface == ORCHESTRA and preference == "budget"
        else {}
    )


def make_tasks(n: int, seed: int, prefix: str = "task", interface: str = BASIC) -> list[Task]:
    """``n`` tasks with a preference each, for the ``interface``'s tools (same ``seed``, same
    tasks)."""
    rng = random.Random(seed)
    preferences = _preferences(interface)[0]
    tasks = []
    for index in range(n):
        drawn = draw_task(rng)
        stated = _stated(rng.choice(preferences[drawn.family]), interface, rng)
        metadata = {
            "family": drawn.family,
            "difficulty": drawn.difficulty,
            **stated,
            "route": [list(step) for step in drawn.route],
            "evidence": drawn.evidence,
            "evidence_difficulty": drawn.evidence_difficulty,
            "evidence_route": [list(step) for step in drawn.evidence_route],
        }
        if interface == ORCHESTRA:
            metadata.update(orchestra.task_metadata(drawn))
        metadata.update(_budget(stated["preference_name"], interface))
        # The user states the preference after the question, as ToolOrchestra's users do: next
        # to where the policy decides, not ahead of the tool list in the system prompt.
        tasks.append(
            Task(
                id=f"{prefix}-{index:05d}",
                question=f"{drawn.question}\n{stated['instruction']}",
                system=SYSTEM_PROMPT,
                answer=drawn.answer,
                metadata=metadata,
            )
        )
    return tasks


def restated(task: Task, interface: str, seed: int = 0) -> list[Task]:
    """``task`` under each preference its family has (ids ``<id>@<preference>``): the same
    question with that preference's instruction, to see whether a policy's route follows the
    preference for one task."""
    question = task.question.removesuffix("\n" + task.metadata["instruction"])
    metadata = {key: value for key, value in task.metadata.items() if key != "budget_usd"}
    tasks = []
    for preference in _preferences(interface)[0][task.metadata["family"]]:
        stated = _stated(preference, interface, random.Random(f"{seed}|{task.id}|{preference}"))
        tasks.append(
            Task(
                id=f"{task.id}@{preference}",
                question=f"{question}\n{stated['instruction']}",
                system=task.system,
                answer=task.answer,
                metadata={**metadata, **stated, **_budget(preference, interface)},
            )
        )
    return tasks


def _route(steps: list[list[Any]]) -> Route:
    return tuple((name, dict(arguments)) for name, arguments in steps)


def routes(task: Task, experts: Mapping[str, Any]) -> dict[str, Route]:
    """Every sensible way to answer ``task``: ``tools`` (when the family has an exact route),
    ``expert:<alias>`` for each expert and, for lookups, ``tools+expert:<alias>`` (retrieve the
    evidence, then hand the task to the expert)."""
    found: dict[str, Route] = {}
    if task.metadata["route"]:
        found["tools"] = _route(task.metadata["route"])
    for alias in experts:
        found[f"expert:{alias}"] = ((EXPERT_TOOL, {"model": alias}),)
    if task.metadata["evidence_route"]:
        for alias in experts:
            found[f"tools+expert:{alias}"] = _route(task.metadata["evidence_route"]) + (
                (EXPERT_TOOL, {"model": alias}),
            )
    return found


def route_values(
    task: Task,
    expert: SimulatedExpert,
    orchestrator_usd_per_turn: float,
    usd_reference: float,
    tool_usd: Mapping[str, float],
) -> list[RouteValue]:
    """Expected accuracy, USD and utility of each route, from the simulated experts' known
    accuracies, usage distributions and prices (tools: assumed exact, at ``tool_usd`` per
    call; an expert after the evidence's retrieval: at the task's evidence difficulty); the
    orchestrator pays one turn per call plus the answer turn, unless the expert's answer ends
    the episode."""
    values = []
    for name, route in routes(task, expert.models).items():
        ends = expert.ends_episode and route[-1][0] == EXPERT_TOOL
        usd = orchestrator_usd_per_turn * (len(route) + (0 if ends else 1))
        counts: dict[str, int] = {}
        accuracy = 1.0
        for tool, arguments in route:
            counts[tool] = counts.get(tool, 0) + 1
            if tool == EXPERT_TOOL:
                model = expert.models[arguments["model"]]
                difficulty = task.metadata[
                    ("evidence_difficulty" if name.startswith("tools+") else "difficulty")
                ]
                accuracy = model.accuracy_on(difficulty)
                pricing = expert.pricing[arguments["model"]]
                mean_output = model.mean_output_tokens * math.exp(model.output_tokens_sigma**2 / 2)
                usd += (
                    pricing.per_input_token
                    * (expert.prompt_overhead_tokens + len(task.question) // 4)
                    + pricing.per_output_token * mean_output
                )
            else:
                usd += tool_usd.get(tool, 0.0)
        preference = task.metadata["preference"]
        values.append(
            RouteValue(
                name,
                frozenset(counts),
                accuracy,
                usd,
                accuracy * utility(preference, True, usd, counts, usd_reference),
            )
        )
    return values


def strongest_expert(
    task: Task, experts: Mapping[str, Any], expert_pricing: Mapping[str, Any]
) -> str:
    """The most accurate expert for the task's difficulty; the most expensive among equals."""
    difficulty = task.metadata["difficulty"]
    return max(
        experts,
        key=lambda alias: (
            experts[alias].accuracy_on(difficulty),
            expert_pricing[alias].per_output_token,
        ),
    )


def cheapest_expert(experts: Mapping[str, Any], expert_pricing: Mapping[str, Any]) -> str:
    return min(experts, key=lambda alias: expert_pricing[alias].per_output_token)


def naive_routes(
    tasks: list[Task],
    experts: Mapping[str, Any],
    pricing: Mapping[str, Any],
    router_shares: Mapping[str, float],
    seed: int,
) -> dict[str, Route]:
    """The route each task's naive router takes, the router drawn with ``router_shares`` (over
    :data:`~nemo_orch.config.DEMO_ROUTERS`): the strongest (most expensive) expert for the
    task's difficulty; ``instructed``, a keyword rule that takes the cheapest expert when the
    instruction asks to keep the cost low and the strongest otherwise; ``tiered``, an expert
    drawn at random (this world's experts are one line of tiers); the family's exact tools
    (where it has them, else a random route); or a uniformly random route. Only the instructed
    rule reads the preference, and it knows neither the experts' accuracies nor the other
    preferences: what is best is left to RL. One generator seeded with ``seed`` draws for the
    tasks in order. By task id."""
    rng = random.Random(seed)
    chosen = {}
    for task in tasks:
        options = routes(task, experts)
        router = rng.choices(DEMO_ROUTERS, [router_shares[name] for name in DEMO_ROUTERS])[0]
        if router == "instructed" and task.metadata["instruction"] in PREFERENCE_PHRASES["cost"]:
            chosen[task.id] = options[f"expert:{cheapest_expert(experts, pricing)}"]
        elif router in ("strongest", "instructed"):
            chosen[task.id] = options[f"expert:{strongest_expert(task, experts, pricing)}"]
        elif router == "tiered":  # this world's experts are one line: a tier is an expert
            chosen[task.id] = options[f"expert:{rng.choice(sorted(experts))}"]
        elif router == "family" and "tools" in options:
            chosen[task.id] = options["tools"]
        else:
            chosen[task.id] = options[rng.choice(sorted(options))]
    return chosen
