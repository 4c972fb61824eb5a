"""ToolScale domain tasks as an environment: each domain's tools act on the episode's own copy
of its database, and an episode is scored on the database it leaves and the facts it told.

Tasks come from a directory of domains (``<domain>/domain.json`` + ``tasks.jsonl``, as ``nemo-orch
synth`` writes them; ``env.path``, null: ``synth.out_dir``), one ``env.domain`` or all; or from
ToolScale's published parquet (``env.path=FILE.parquet``, or the folder of a split's shards),
whose rows run on the domains
installed with ``tools.domains`` (rows of other domains are counted in ``notes``, never
scored; a file left with no task is an error). Tasks that
fail the validation filters (their gold actions do not replay) are dropped and listed in
``notes["dropped"]``, never scored. ``env.limit`` keeps the first N valid tasks of each domain.
``train`` / ``validation`` split the tasks by a hash of their id; ``test`` is all of them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_orch.config import Config, ConfigError, EnvSourceConfig, resolve_conf_path
from nemo_orch.config.hub import is_data_file
from nemo_orch.data.domain import Domain
from nemo_orch.data.domain_tasks import DomainTask, read_domain_tasks, to_task_row
from nemo_orch.data.jsonl import DataError
from nemo_orch.data.tasks import Task
from nemo_orch.envs.common import OutcomeScoredEnvironment, declared_names, declared_tools, offering
from nemo_orch.envs.interfaces import GoldAction, GoldPlan, draw, final_message, split_pool
from nemo_orch.envs.toolscale.generator import MAX_ACTIONS
from nemo_orch.envs.toolscale.parquet import read_toolscale_parquet
from nemo_orch.envs.toolscale.validate import ValidationSummary, validated


@dataclass(frozen=True)
class LoadedDomain:
    """A domain's file, the domain, the rows of its valid tasks and the tasks dropped."""

    domain_file: Path
    domain: Domain
    rows: list[Task]
    validation: ValidationSummary


def load_rows(directory: str | Path, domain_name: str, limit: int | None = None) -> LoadedDomain:
    """The first ``limit`` tasks of ``<dir>/<domain>/`` that pass the validation filters (a
    task file from elsewhere may hold tasks whose gold actions fail: they are dropped and
    reported, never scored), as rows."""
    folder = Path(directory) / domain_name
    if not (folder / "domain.json").is_file():
        raise DataError(f"{folder}: no domain.json (write one with `nemo-orch synth`)")
    domain = Domain.load(folder / "domain.json")
    return _validated_rows(
        folder / "domain.json", domain, read_domain_tasks(folder / "tasks.jsonl"), limit
    )


def _validated_rows(
    domain_file: Path, domain: Domain, tasks: list[DomainTask], limit: int | None
) -> LoadedDomain:
    summary = ValidationSummary()
    kept = itertools.islice(validated(domain, tasks, MAX_ACTIONS, summary), limit)
    return LoadedDomain(domain_file, domain, [to_task_row(domain, task) for task in kept], summary)


def _published(path: Path) -> bool:
    """Whether ``path`` is ToolScale as published: its parquet file, or the folder of a split's
    shards (as a Hub id of a sharded dataset resolves), rather than a directory of domains."""
    if path.is_dir():
        return not any(path.glob("*/domain.json")) and any(
            is_data_file(file) for file in path.iterdir()
        )
    return path.suffix.lower() == ".parquet"


def load_parquet(
    path: Path, domain_files: list[str], only: str | None, limit: int | None
) -> tuple[list[LoadedDomain], dict[str, Any]]:
    """The rows of ToolScale's published parquet (:mod:`nemo_orch.envs.toolscale.parquet`) for
    the installed domains (``tools.domains``; ``only``: one of them), validated, and what the
    notes say of the file: rows by domain, and the domains not installed, never scored."""
    installed = {}
    for file in domain_files:
        domain = Domain.load(resolve_conf_path(file))
        if only is None or domain.name == only:
            installed[domain.name] = (resolve_conf_path(file), domain)
    read = read_toolscale_parquet(path, {name: domain for name, (_, domain) in installed.items()})
    loaded = [
        _validated_rows(file, domain, read.tasks[name], limit)
        for name, (file, domain) in installed.items()
    ]
    if not any(domain.rows for domain in loaded):
        raise ConfigError(
            f"env.path: {path} holds no valid task of an installed domain (rows by "
            f"domain: {read.counts}; installed with tools.domains: "
            f"{', '.join(installed) or 'none'})"
        )
    return loaded, {"rows_by_domain": read.counts, "domains_not_installed": read.skipped}


def toolscale_gold_plan(task: Task) -> GoldPlan:
    """A domain task row's gold actions and its facts."""
    gold = DomainTask.model_validate(task.metadata["domain_task"])
    return GoldPlan(
        [GoldAction("assistant", a.name, a.arguments) for a in gold.gold_actions],
        final_message(gold.facts),
    )


def domain_names(directory: Path, domain: str | None) -> list[str]:
    """``domain``, or every domain folder under ``directory``."""
    if domain is not None:
        return [domain]
    names = sorted(
        folder.name for folder in directory.glob("*/") if (folder / "domain.json").is_file()
    )
    if not names:
        raise ConfigError(f"{directory}: no domains (write them with `nemo-orch synth`)")
    return names


class ToolScaleEnvironment(OutcomeScoredEnvironment):
    has_gold_plan = True

    def __init__(self, config: Config, source: EnvSourceConfig, val_fraction: float) -> None:
        path = resolve_conf_path(source.path or config.synth.out_dir)
        parquet_notes: dict[str, Any] = {}
        if _published(path):
            loaded, parquet_notes = load_parquet(
                path, config.tools.domains, source.domain, source.limit
            )
        elif path.is_dir():
            loaded = [
                load_rows(path, name, source.limit) for name in domain_names(path, source.domain)
            ]
        else:
            raise ConfigError(
                f"env.path: {path} is neither a directory of domains (write one "
                "with `nemo-orch synth`) nor ToolScale's published .parquet "
                "(a file, or the folder of a split's shards)"
            )
        # The parquet's domains are tools.domains already; a directory's are added.
        own = [] if parquet_notes else [str(domain.domain_file) for domain in loaded]
        super().__init__(
            config, source, declared_tools(config, source, own_tools=True), domains=own
        )
        # A row offers its domain's tools; the declared ones (env.tools) join them.
        self.pool = offering(
            [row for domain in loaded for row in domain.rows], declared_names(self.tools_config)
        )
        self.notes.update(
            {
                "dropped": [
                    rejection
                    for domain in loaded
                    for rejection in domain.validation.to_json()["rejections"]
                ],
                "tasks_by_domain": {domain.domain.name: len(domain.rows) for domain in loaded},
                **parquet_notes,
            }
        )
        self.val_fraction = val_fraction

    def tasks(self, split: str, count: int | None, seed: int) -> list[Task]:
        return draw(split_pool(self.pool, split, self.val_fraction), count, seed)

    def gold_plan(self, task: Task) -> GoldPlan:
        return toolscale_gold_plan(task)
