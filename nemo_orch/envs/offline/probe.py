"""Does a policy's route follow the preference, for one and the same task?

Each task is restated under every preference its family has (the same question, another
instruction: :func:`~nemo_orch.envs.offline.world.restated`) and rolled out ``samples`` times;
for every pair of preferences of a task, the total-variation distance between the two route
distributions says how much the preference moved the policy (0: not at all, 1: disjoint
routes). The oracle's distance for the same pair (1 where the two preferences' best routes
differ, else 0) says how much it should have. Greedy decoding (``samples=1``, temperature 0)
gives the routes the evaluation scores; sampling at temperature 1, the ones GRPO explores.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_orch.config import RolloutConfig
from nemo_orch.data.tasks import Task
from nemo_orch.envs.offline.environment import OfflineEnvironment
from nemo_orch.envs.offline.oracle import route_of
from nemo_orch.envs.offline.world import restated
from nemo_orch.rollout.engines.base import Engine
from nemo_orch.rollout.runner import run_rollouts


def total_variation(first: Counter, second: Counter) -> float:
    """Half the L1 distance between two empirical distributions (counts of outcomes)."""
    total_first, total_second = sum(first.values()), sum(second.values())
    return 0.5 * sum(
        abs(first[key] / total_first - second[key] / total_second)
        for key in set(first) | set(second)
    )


@dataclass(frozen=True)
class Separation:
    """Per family: the mean total-variation distance between two preferences' route
    distributions for one task (``policy``), the same for the first call alone
    (``first_call``), the oracle's (``oracle``), and the pairs they are means over."""

    policy: float
    first_call: float
    oracle: float
    pairs: int


def separation(
    tasks: Sequence[Task], routes: Mapping[str, Sequence[str]], best: Mapping[str, str]
) -> dict[str, Separation]:
    """:class:`Separation` per family, and over all (``all``), of restated ``tasks`` (grouped
    by the id before ``@``) from each one's ``routes`` and ``best`` (oracle) route, by id."""
    by_task: dict[str, list[Task]] = defaultdict(list)
    for task in tasks:
        by_task[task.id.split("@")[0]].append(task)
    rows: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for versions in by_task.values():
        for first, second in itertools.combinations(versions, 2):
            distance = total_variation(Counter(routes[first.id]), Counter(routes[second.id]))
            first_calls = [
                Counter(route.split(">")[0] for route in routes[task.id])
                for task in (first, second)
            ]
            row = (
                distance,
                total_variation(*first_calls),
                float(best[first.id] != best[second.id]),
            )
            rows[first.metadata["family"]].append(row)
            rows["all"].append(row)
    return {
        family: Separation(*(statistics.mean(column) for column in zip(*values)), pairs=len(values))
        for family, values in sorted(rows.items())
    }


async def probe(
    environment: OfflineEnvironment,
    tasks: Sequence[Task],
    engine: Engine,
    tokenizer: Any,
    settings: RolloutConfig,
    samples: int,
    seed: int = 0,
) -> dict[str, Separation]:
    """Roll each of ``tasks`` out under each preference of its family ``samples`` times (at
    ``settings.temperature``) with the environment's tools, and measure the
    :func:`separation` of the routes from the oracle's."""
    restated_tasks = [
        task for original in tasks for task in restated(original, environment.interface)
    ]
    async with environment.toolbox() as toolbox:
        table = environment.oracle(toolbox, tokenizer)
        trajectories = await run_rollouts(
            restated_tasks, samples, engine, toolbox, tokenizer, settings, seed=seed
        )
    routes = {
        task.id: [route_of(t) for t in trajectories[i * samples : (i + 1) * samples]]
        for i, task in enumerate(restated_tasks)
    }
    return separation(
        restated_tasks, routes, {task.id: table.best(task).route for task in restated_tasks}
    )
