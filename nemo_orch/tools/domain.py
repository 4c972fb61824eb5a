"""A domain's tools as toolbox tools: each call runs on the calling episode's own database.

:class:`EpisodeStates` is the per-episode store, shared with the tau2-bench adapter's
environments.

Every episode (``context.episode_id`` and ``context.seed``) gets a private copy of the domain's database, set up for
its task (the task row's ``metadata["domain_task"]``) on its first call, so the episodes of a GRPO
group never see each other's writes. Copies are kept for the ``max_episodes`` most recent
episodes; scoring does not need them (it replays the episode's calls, see
:func:`nemo_orch.data.domain_tasks.score_episode`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from nemo_orch.config import ToolsConfig, resolve_conf_path
from nemo_orch.data.domain import ActionError, Database, Domain, result_text
from nemo_orch.data.domain_tasks import DomainTask
from nemo_orch.tools.base import BaseTool, Pricing, ToolContext, ToolError, ToolResult, ToolSpec

logger = logging.getLogger(__name__)
State = TypeVar("State")


class EpisodeStates(Generic[State]):
    """Per-episode state (a database, an environment) made by ``make`` on the episode's first
    call and kept for the ``max_episodes`` most recently used episodes; :meth:`release` drops
    an episode that has ended. An episode is its id and its seed: the same task and sample can
    be in flight twice at once (overlapping steps of asynchronous GRPO), never with one seed."""

    def __init__(self, make: Callable[[ToolContext], State], max_episodes: int) -> None:
        if max_episodes < 1:
            raise ToolError("max_episodes must be >= 1")
        self.make, self.max_episodes = make, max_episodes
        self._states: OrderedDict[tuple[str, int], State] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def get(self, context: ToolContext) -> State:
        key = (context.episode_id, context.seed)
        state = self._states.get(key)
        if state is not None:
            self._states.move_to_end(key)
            return state
        state = self.make(context)
        self._states[key] = state
        if len(self._states) > self.max_episodes:
            evicted, _ = self._states.popitem(last=False)
            logger.warning(
                "dropped the state of episode %r (more than %d episodes alive)",
                evicted,
                self.max_episodes,
            )
        return state

    def release(self, episode_id: str, seed: int) -> None:
        self._states.pop((episode_id, seed), None)


def _database_maker(domain: Domain) -> Callable[[ToolContext], Database]:
    def make(context: ToolContext) -> Database:
        if context.task is None or "domain_task" not in context.task.metadata:
            raise ActionError(
                f"{domain.name} tools need a domain task (a row made by "
                "nemo_orch.data.domain_tasks.to_task_row)"
            )
        task = DomainTask.model_validate(context.task.metadata["domain_task"])
        return domain.fresh_database(task.database_update())

    return make


class DomainTool(BaseTool):
    """One declared domain tool; never raises from :meth:`call`."""

    def __init__(self, spec: ToolSpec, domain: Domain, databases: EpisodeStates[Database]) -> None:
        super().__init__(spec)
        self.domain, self.databases = domain, databases

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        try:
            database = self.databases.get(context)
            return ToolResult(
                output=result_text(self.domain.spec.execute(database, self.spec.name, arguments))
            )
        except ActionError as error:
            return ToolResult(error=str(error))


def domain_tools(
    domain: Domain, pricing: Pricing = Pricing(), max_episodes: int = 4096
) -> list[DomainTool]:
    """Every tool of ``domain``, sharing one store of episode databases. Domain tools act on
    state, so their results are never cached (``deterministic`` false)."""
    databases = EpisodeStates(_database_maker(domain), max_episodes)
    return [
        DomainTool(
            ToolSpec(
                name,
                tool.description,
                domain.spec.parameters(name),
                pricing=pricing,
                deterministic=False,
            ),
            domain,
            databases,
        )
        for name, tool in domain.spec.tools.items()
    ]


def build_domains(tools: ToolsConfig) -> dict[str, Domain]:
    """The configured domains (``tools.domains``), by name."""
    return load_domains([resolve_conf_path(path) for path in tools.domains])


def load_domains(paths: list[str] | list[Path]) -> dict[str, Domain]:
    """The domains saved at ``paths`` (``Domain.save`` files), by name."""
    domains: dict[str, Domain] = {}
    for path in paths:
        domain = Domain.load(path)
        if domain.name in domains:
            raise ToolError(f"{path}: domain {domain.name!r} is loaded twice")
        domains[domain.name] = domain
    return domains
