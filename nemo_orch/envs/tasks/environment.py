"""A user's own tasks: a JSONL task file (:mod:`nemo_orch.data.tasks`, the format of
``nemo-orch rollout --tasks``) with the configured tools, scored by the reward's outcome
scorer. ``train`` / ``validation`` split the file by a hash of the task id
(``env.val_fraction``); ``test`` is the whole file."""

from __future__ import annotations

from nemo_orch.config import Config, EnvSourceConfig, resolve_conf_path
from nemo_orch.data.tasks import Task, read_tasks
from nemo_orch.envs.common import OutcomeScoredEnvironment, declared_tools
from nemo_orch.envs.interfaces import draw, split_pool


class TaskFileEnvironment(OutcomeScoredEnvironment):
    def __init__(self, config: Config, source: EnvSourceConfig, val_fraction: float) -> None:
        super().__init__(config, source, declared_tools(config, source, own_tools=False))
        self.pool = self.read(config, source)[: source.limit]
        self.val_fraction = val_fraction

    def read(self, config: Config, source: EnvSourceConfig) -> list[Task]:
        assert source.path is not None  # checked when the config was loaded
        return read_tasks(resolve_conf_path(source.path))

    def tasks(self, split: str, count: int | None, seed: int) -> list[Task]:
        return draw(split_pool(self.pool, split, self.val_fraction), count, seed)
