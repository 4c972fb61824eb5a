"""What the environments without a scorer of their own share: tools from declarations (and
domains), and the reward's outcome scorer (exact, numeric, judge, database)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from nemo_orch.config import Config, EnvSourceConfig, ToolsConfig
from nemo_orch.data.tasks import Task
from nemo_orch.envs.interfaces import Environment, Scored
from nemo_orch.rollout.trajectory import Trajectory
from nemo_orch.tools.registry import Toolbox


class OutcomeScoredEnvironment(Environment):
    """An environment whose tools are declarations (``declarations``) and domain files
    (``domains``), scored by the reward's outcome scorer (:func:`build_scorer`), so a judge or a
    reward endpoint configured under ``reward.*`` applies; ``notes["judge"]`` names it in every
    report."""

    def __init__(
        self,
        config: Config,
        source: EnvSourceConfig,
        declarations: Sequence[str],
        domains: Sequence[str] = (),
    ) -> None:
        from nemo_orch.reward.builders import build_scorer
        from nemo_orch.reward.judge import judge_description

        self.name, self.limit = source.label, source.limit
        self.notes = {"judge": judge_description(config.reward)}
        self.retrieval = source.retrieval
        self.tools_config = dataclasses.replace(
            config.tools, declarations=list(declarations), domains=[*config.tools.domains, *domains]
        )
        self.scorer = build_scorer(
            dataclasses.replace(config, tools=self.tools_config),
            judge_in_flight=config.eval.max_requests_per_endpoint,
        )

    def toolbox(self) -> Toolbox:
        from nemo_orch.rollout.builders import build_toolbox

        return build_toolbox(self.tools_config, self.retrieval)

    async def score(self, task: Task, trajectory: Trajectory) -> Scored:
        return Scored(await self.scorer.score(task, trajectory.answer, trajectory.calls()))


def declared_tools(config: Config, source: EnvSourceConfig, own_tools: bool) -> list[str]:
    """The declarations a source's tasks get beside its own tools: ``env.tools``, or when null
    the configured ``tools=`` set for an environment with no tools of its own (offline, qa,
    tasks) and none for one with its protocol's tools (toolscale, tau2)."""
    if source.tools is not None:
        return list(source.tools)
    return [] if own_tools else list(config.tools.declarations)


def declared_names(tools: ToolsConfig) -> tuple[str, ...]:
    """The names of the tools ``tools.declarations`` declares (read, not built)."""
    from nemo_orch.rollout.builders import declared_specs

    return tuple(spec.name for spec in declared_specs(tools))


def offering(tasks: list[Task], names: tuple[str, ...]) -> list[Task]:
    """Tasks that name their tools (a domain's, tau2's) offering the tools ``names`` too."""
    if not names:
        return tasks
    return [dataclasses.replace(task, tools=(*(task.tools or ()), *names)) for task in tasks]
