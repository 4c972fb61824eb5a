"""tau2-bench as an environment (extra ``tau2``; :mod:`nemo_orch.envs.tau2.adapter` adapts its
domains): the domain policy and assistant tools, the user-side tools (telecom's user acts on
their phone), and tau2's own evaluator on the calls that reached its environment. ``test`` is
the split ``env.split`` names; ``train`` / ``validation`` split tau2's ``train`` split (a
domain without splits, such as ``mock``: its one task set) by a hash of the task id.

``env.tau2_domains`` registers directories in tau2's layout as domains
(:mod:`nemo_orch.envs.tau2.external`), here, in every process that builds the environment, so
tau2 runs and scores them as its own. ``env.path`` replaces the domain's tasks by its rows of a
task file (a ToolScale parquet file): one task set, which every split names.

Who answers the agent is ``env.user``: an LLM playing tau2's user simulator (tau2-bench's
protocol), or no one, the scenario stated up front in the question (every report says that
this is not comparable with tau2-bench)."""

from __future__ import annotations

from nemo_orch.config import Config, ConfigError, EnvSourceConfig, resolve_conf_path
from nemo_orch.data.tasks import Task
from nemo_orch.envs.common import declared_names, declared_tools, offering
from nemo_orch.envs.interfaces import (
    Environment,
    GoldAction,
    GoldPlan,
    Scored,
    draw,
    final_message,
    split_pool,
)
from nemo_orch.reward.outcome import OutcomeResult
from nemo_orch.rollout.conversation import UserFactory
from nemo_orch.rollout.opening import episode_id
from nemo_orch.rollout.trajectory import Trajectory
from nemo_orch.tools.registry import Toolbox

TRAIN_SPLIT = "train"
SCENARIO_PROTOCOL = (
    "scenario stated up front, no user answers (env.user.base_url unset): not "
    "comparable with tau2-bench"
)


def tau2_gold_plan(task: Task) -> GoldPlan:
    """A tau2 task's gold actions, each by its requestor, and the facts to communicate."""
    from nemo_orch.envs.tau2 import adapter

    criteria = adapter.tau2_task_of(task).evaluation_criteria
    actions, facts = (
        ([], []) if criteria is None else (criteria.actions or [], criteria.communicate_info or [])
    )
    return GoldPlan(
        [GoldAction(a.requestor, a.name, a.arguments) for a in actions], final_message(facts)
    )


class Tau2Environment(Environment):
    has_gold_plan = True

    def __init__(self, config: Config, source: EnvSourceConfig, val_fraction: float) -> None:
        import dataclasses

        from nemo_orch.envs.tau2 import adapter, external

        assert source.domain is not None  # checked when the config was loaded
        self.name = source.label
        for directory in source.tau2_domains:
            external.register_domain_directory(resolve_conf_path(directory))
        self.tasks_path = None if source.path is None else resolve_conf_path(source.path)
        # Under tau2-bench's protocol the agent runs with tau2's LLMAgent system prompt.
        self.llm_agent_prompt = source.user.simulated
        self.domain = adapter.load_domain(
            source.domain,
            source.split,
            tasks_path=self.tasks_path,
            llm_agent_prompt=self.llm_agent_prompt,
        )
        self._users = None
        if source.user.simulated:
            from nemo_orch.envs.tau2.user import Tau2Users

            self._users = Tau2Users(source.user, self.domain)
        self.limit, self.val_fraction = source.limit, val_fraction
        self._train: list[Task] | None = None
        self.tools_config = dataclasses.replace(
            config.tools, declarations=declared_tools(config, source, own_tools=True), domains=[]
        )
        self.declared = declared_names(self.tools_config)
        split = f"{source.domain} {source.split}" + (
            " (train + test, as the leaderboard; GRPO trains on its train part)"
            if source.split == "base"
            else ""
        )
        self.notes = {
            "protocol": SCENARIO_PROTOCOL if self._users is None else self._users.describe(),
            "split": split
            if source.path is None
            else f"{source.domain}: the tasks of {source.path} (one task set, no splits)",
            # The leaderboard calls a run with tools beyond the domain's a custom submission.
            "submission": "standard (the domain's tools only)"
            if not self.declared
            else f"custom: extra tools offered ({', '.join(sorted(self.declared))})",
        }

    def _train_pool(self) -> list[Task]:
        from nemo_orch.envs.tau2 import adapter

        if self._train is None:
            available = adapter.splits(self.domain.name)
            if self.tasks_path is not None or self.domain.split == TRAIN_SPLIT or not available:
                # a task file, or a domain without splits: one task set
                self._train = self.domain.tasks
            elif TRAIN_SPLIT not in available:
                raise ConfigError(
                    f"tau2 domain {self.domain.name!r} has no train split to train on"
                )
            else:  # only its tasks: the tools and episodes are the loaded domain's
                self._train = adapter.load_domain(
                    self.domain.name, TRAIN_SPLIT, llm_agent_prompt=self.llm_agent_prompt
                ).tasks
        return self._train

    def tasks(self, split: str, count: int | None, seed: int) -> list[Task]:
        pool = self.domain.tasks if split == "test" else self._train_pool()
        tasks = split_pool(pool, split, self.val_fraction)[: self.limit]
        return draw(offering(tasks, self.declared), count, seed)

    def toolbox(self) -> Toolbox:
        if not self.declared:
            return self.domain.assistant_toolbox()
        from nemo_orch.rollout.builders import build_toolbox

        declared = build_toolbox(self.tools_config)
        return Toolbox([*self.domain.assistant_tools, *declared.fixed], sources=declared.sources)

    def user_toolbox(self) -> Toolbox:
        return self.domain.user_toolbox()

    def users(self) -> UserFactory | None:
        return self._users

    async def score(self, task: Task, trajectory: Trajectory) -> Scored:
        from nemo_orch.envs.tau2 import adapter

        key = episode_id(task.id, trajectory.sample)
        # Without a user, the answer is the agent's closing message; with one, the transcript
        # already holds every message.
        closing = None if trajectory.user is not None else trajectory.answer or ""
        try:
            turns = adapter.recorded_turns(self.domain, task, key, trajectory.seed, closing)
        finally:
            self.domain.environments.release(key, trajectory.seed)
        result = adapter.score_episode(task, turns, trajectory.termination)
        return Scored(
            OutcomeResult(result.passed, "tau2", "; ".join(result.failures)),
            {"tau2": result.to_json()},
        )

    def gold_plan(self, task: Task) -> GoldPlan:
        return tau2_gold_plan(task)
