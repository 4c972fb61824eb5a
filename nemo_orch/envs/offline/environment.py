"""The main job's world as an environment: tasks generated from a seed, each with a preference
vector; the configured tools (the sandbox, the bundled corpus, the SIMULATED experts); scored
by the reward protocol, with the route the episode took and its preference utility in the
details (:mod:`.oracle`), and an oracle that knows every task's best route. ``test`` is the
main job's held-out tasks (``eval.tasks`` of them, the same ones ``make train`` evaluates on),
``validation`` another held-out draw, ``train`` fresh tasks for any seed (the world is
unbounded: a count is required)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nemo_orch.config import NAIVE_ROUTERS, Config, EnvSourceConfig, RolloutConfig
from nemo_orch.data.tasks import Task
from nemo_orch.envs.common import OutcomeScoredEnvironment, declared_names, declared_tools
from nemo_orch.envs.interfaces import SPLITS, Agent, EpisodeGroup, Scored, draw
from nemo_orch.envs.offline import metrics
from nemo_orch.envs.offline.agents import NaiveRouterAgent
from nemo_orch.envs.offline.generator import copy_conversations, generate_conversations
from nemo_orch.envs.offline.oracle import OracleTable, knows_experts, route_of
from nemo_orch.envs.offline.orchestra import FAMILY_SHAPES
from nemo_orch.envs.offline.values import utility
from nemo_orch.envs.offline.world import held_out_tasks, interface_of, make_tasks, restated
from nemo_orch.rollout.trajectory import Trajectory
from nemo_orch.tools.registry import Toolbox

# The report's note on preference adherence where no oracle judges it.
NO_ORACLE = "preference adherence"
# Validation tasks are drawn with the run's seed plus this (the held-out test tasks with
# world.HELD_OUT_SEED): neither is ever a training task.
VALIDATION_SEED_OFFSET = 104729


class OfflineEnvironment(OutcomeScoredEnvironment):
    preferences = True
    baselines = (NAIVE_ROUTERS,)
    simulated_monolith = True

    def __init__(self, config: Config, source: EnvSourceConfig) -> None:
        super().__init__(config, source, declared_tools(config, source, own_tools=False))
        self.run_seed, self.held_out = config.run.seed, config.eval.tasks
        # The tasks' preferences name the tools of the interface they are offered.
        self.interface = interface_of(declared_names(self.tools_config))
        self.usd_reference = config.reward.usd_reference
        self.demo_routers = config.data.demo_routers
        self.orchestrator_usd_per_token = (
            config.rollout.input_usd_per_million / 1e6,
            config.rollout.output_usd_per_million / 1e6,
        )

    def tasks(self, split: str, count: int | None, seed: int) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
        if split == "test":
            return draw(held_out_tasks(self.held_out, self.interface)[: self.limit], count, seed)
        if count is None:
            raise ValueError(f"the offline world's {split} split is unbounded: ask for a count")
        count = min(count, self.limit or count)
        if split == "validation":
            return make_tasks(
                count,
                seed=self.run_seed + VALIDATION_SEED_OFFSET,
                prefix="val",
                interface=self.interface,
            )
        # Named as the main job's demonstration tasks always were: the simulated experts draw
        # by episode id, so the demonstrations (and SFT) stay as they were. GRPO renames its
        # tasks per step.
        return make_tasks(count, seed, prefix="demo", interface=self.interface)

    def under_each_preference(self, task: Task) -> list[Task]:
        return restated(task, self.interface, self.run_seed)

    async def score(self, task: Task, trajectory: Trajectory) -> Scored:
        scored = await super().score(task, trajectory)
        return Scored(
            scored.outcome,
            {
                "route": route_of(trajectory),
                "utility": utility(
                    task.metadata["preference"],
                    scored.outcome.correct,
                    trajectory.cost_usd,
                    trajectory.tool_counts(),
                    self.usd_reference,
                ),
            },
        )

    def baseline(
        self,
        kind: str,
        tasks: Sequence[Task],
        toolbox: Toolbox,
        tokenizer: Any,
        settings: RolloutConfig,
        seed: int,
    ) -> Agent:
        if kind != NAIVE_ROUTERS:
            return super().baseline(kind, tasks, toolbox, tokenizer, settings, seed)
        return NaiveRouterAgent(list(tasks), self.demo_routers, seed, toolbox, tokenizer, settings)

    def routed_tools(self, task: Task) -> tuple[str, ...]:
        """The tools the task's family is naturally solved with."""
        return FAMILY_SHAPES.get(task.metadata.get("family"), super().routed_tools(task))

    def rollout_metrics(self, groups: Sequence[EpisodeGroup]) -> dict[str, float]:
        return metrics.rollout_metrics(groups)

    def tokenizer_conversations(self, count: int, seed: int) -> list[dict[str, Any]]:
        # Whole demonstration conversations: the tokenizer learns the tool markup, numbers and
        # made-up names of the routes, not only the questions.
        return generate_conversations(count, seed)

    def copy_conversations(self, count: int, seed: int) -> list[dict[str, Any]]:
        return copy_conversations(count, seed)

    def oracle(self, toolbox: Toolbox, tokenizer: Any) -> OracleTable | None:
        """The best routes, from the simulated experts' known accuracies and prices; None with
        experts it does not know (served ones: ``tools=experts``, ``tools=reference``), whose
        episodes are then not judged for preference adherence (the report's notes say so)."""
        if not knows_experts(toolbox):
            self.notes[NO_ORACLE] = (
                "not judged: the oracle knows only the simulated "
                "experts' routes, and these tools call others"
            )
            return None
        return OracleTable(toolbox, tokenizer, self.usd_reference, self.orchestrator_usd_per_token)
