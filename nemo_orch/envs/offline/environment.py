"""The main job's world as an environment: tasks generated from a seed, each with a preference
vector; the configured tools (the sandbox, the bundled corpus, the SIMULATED experts); scored
by the reward protocol. ``test`` is the main job's held-out tasks (``eval.tasks`` of them, the
same ones ``make train`` evaluates on), ``validation`` another held-out draw, ``train`` fresh
tasks for any seed (the world is unbounded: a count is required)."""

from __future__ import annotations

from nemo_orch.config import Config, EnvSourceConfig
from nemo_orch.envs.offline.world import held_out_tasks, make_tasks
from nemo_orch.data.tasks import Task
from nemo_orch.envs.common import OutcomeScoredEnvironment, declared_tools
from nemo_orch.envs.interfaces import SPLITS, draw

# Validation tasks are drawn with the run's seed plus this (the held-out test tasks use
# world.HELD_OUT_SEED_OFFSET): neither is ever a training task.
VALIDATION_SEED_OFFSET = 104729


class OfflineEnvironment(OutcomeScoredEnvironment):
    preferences = True

    def __init__(self, config: Config, source: EnvSourceConfig) -> None:
        super().__init__(config, source, declared_tools(config, source, own_tools=False))
        self.run_seed, self.held_out = config.run.seed, config.eval.tasks

    def tasks(self, split: str, count: int | None, seed: int) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
        if split == "test":
            return draw(held_out_tasks(self.held_out, self.run_seed)[:self.limit], count, seed)
        if count is None:
            raise ValueError(f"the offline world's {split} split is unbounded: ask for a count")
        count = min(count, self.limit or count)
        if split == "validation":
            return make_tasks(count, seed=self.run_seed + VALIDATION_SEED_OFFSET, prefix="val")
        return make_tasks(count, seed, prefix="train")
