"""A weighted mixture of environments: how a GRPO step draws its prompts from several sources.

Each of a step's ``count`` prompts picks its source by weight, with the step's seed; each
source then draws its share of distinct tasks with a seed derived from the step's and its
name. A mixture of one source draws with the step's seed itself, so a single environment gives
the same tasks as it would alone.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from nemo_orch.data.tasks import Task
from nemo_orch.envs.interfaces import Environment
from nemo_orch.seeding import derive_seed


@dataclass(frozen=True)
class Draw:
    """One source's share of a step: its environment and the tasks it drew."""

    environment: Environment
    tasks: list[Task]


class Mixture:
    def __init__(self, environments: Sequence[Environment], weights: Sequence[float]) -> None:
        if len(environments) != len(weights) or not environments:
            raise ValueError("a mixture needs one weight per environment, and one at least")
        self.environments, self.weights = list(environments), list(weights)

    def draw(self, split: str, count: int, seed: int) -> list[Draw]:
        """``count`` tasks of ``split``, by source (sources that drew none are left out)."""
        if len(self.environments) == 1:
            return [Draw(self.environments[0], self.environments[0].tasks(split, count, seed))]
        picks = Counter(
            random.Random(seed).choices(
                range(len(self.environments)), weights=self.weights, k=count
            )
        )
        return [
            Draw(env, env.tasks(split, picks[index], derive_seed(seed, env.name)))
            for index, env in enumerate(self.environments)
            if picks[index]
        ]
