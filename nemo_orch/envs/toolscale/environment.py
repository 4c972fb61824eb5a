"""ToolScale domain tasks as an environment: each domain's tools act on the episode's own copy
of its database, and an episode is scored on the database it leaves and the facts it told.

Tasks come from a directory of domains (``<domain>/domain.json`` + ``tasks.jsonl``, as ``nemo-orch
synth`` writes them; ``env.path``, null: ``synth.out_dir``), one ``env.domain`` or all. Tasks that
fail the validation filters (their gold actions do not replay) are dropped and listed in
``notes["dropped"]``, never scored. ``env.limit`` keeps the first N valid tasks of each domain.
``train`` / ``validation`` split the tasks by a hash of their id; ``test`` is all of them.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path

from nemo_orch.config import Config, ConfigError, EnvSourceConfig, resolve_conf_path
from nemo_orch.data.domain import Domain
from nemo_orch.data.domain_tasks import DomainTask, read_domain_tasks, to_task_row
from nemo_orch.data.jsonl import DataError
from nemo_orch.data.tasks import Task
from nemo_orch.data.toolscale.generator import MAX_ACTIONS
from nemo_orch.data.toolscale.validate import ValidationSummary, validated
from nemo_orch.envs.common import OutcomeScoredEnvironment, declared_names, declared_tools
from nemo_orch.envs.interfaces import GoldAction, GoldPlan, draw, final_message, split_pool


@dataclass(frozen=True)
class LoadedDomain:
    """A domain's file, the domain, the rows of its valid tasks and the tasks dropped."""

    domain_file: Path
    domain: Domain
    rows: list[Task]
    validation: ValidationSummary


def load_rows(directory: str | Path, domain_name: str, limit: int | None = None
              ) -> LoadedDomain:
    """The first ``limit`` tasks of ``<dir>/<domain>/`` that pass the validation filters (a
    task file from elsewhere may hold tasks whose gold actions fail: they are dropped and
    reported, never scored), as rows."""
    folder = Path(directory) / domain_name
    if not (folder / "domain.json").is_file():
        raise DataError(f"{folder}: no domain.json (write one with `nemo-orch synth`)")
    domain = Domain.load(folder / "domain.json")
    summary = ValidationSummary()
    tasks = itertools.islice(validated(domain, read_domain_tasks(folder / "tasks.jsonl"),
                                       MAX_ACTIONS, summary), limit)
    rows = [to_task_row(domain, task) for task in tasks]
    return LoadedDomain(folder / "domain.json", domain, rows, summary)


def toolscale_gold_plan(task: Task) -> GoldPlan:
    """A domain task row's gold actions and its facts."""
    gold = DomainTask.model_validate(task.metadata["domain_task"])
    return GoldPlan([GoldAction("assistant", a.name, a.arguments) for a in gold.gold_actions],
                    final_message(gold.facts))


def domain_names(directory: Path, domain: str | None) -> list[str]:
    """``domain``, or every domain folder under ``directory``."""
    if domain is not None:
        return [domain]
    names = sorted(folder.name for folder in directory.glob("*/")
                   if (folder / "domain.json").is_file())
    if not names:
        raise ConfigError(f"{directory}: no domains (write them with `nemo-orch synth`)")
    return names


class ToolScaleEnvironment(OutcomeScoredEnvironment):
    has_gold_plan = True

    def __init__(self, config: Config, source: EnvSourceConfig, val_fraction: float) -> None:
        directory = resolve_conf_path(source.path or config.synth.out_dir)
        if not directory.is_dir():
            raise ConfigError(f"env.path: {directory} is not a directory of domains (write "
                              "one with `nemo-orch synth`)")
        loaded = [load_rows(directory, name, source.limit)
                  for name in domain_names(directory, source.domain)]
        super().__init__(config, source, declared_tools(config, source, own_tools=True),
                         domains=[str(domain.domain_file) for domain in loaded])
        # A row offers its domain's tools; the declared ones (env.tools) join them.
        extra = declared_names(self.tools_config)
        self.pool = [dataclasses.replace(row, tools=(*row.tools, *extra))
                     for domain in loaded for row in domain.rows]
        self.notes = {"dropped": [rejection for domain in loaded
                                  for rejection in domain.validation.to_json()["rejections"]],
                      "tasks_by_domain": {domain.domain.name: len(domain.rows)
                                          for domain in loaded}}
        self.val_fraction = val_fraction

    def tasks(self, split: str, count: int | None, seed: int) -> list[Task]:
        return draw(split_pool(self.pool, split, self.val_fraction), count, seed)

    def gold_plan(self, task: Task) -> GoldPlan:
        return toolscale_gold_plan(task)
