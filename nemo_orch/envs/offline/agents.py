"""The offline world's own baseline: its naive routers (``--agent naive-routers``), whose
correct episodes are the main job's SFT demonstrations."""

from __future__ import annotations

from collections.abc import Mapping

from transformers import PreTrainedTokenizerBase

from nemo_orch.config import RolloutConfig
from nemo_orch.data.tasks import Task
from nemo_orch.envs.offline import orchestra
from nemo_orch.envs.offline.world import naive_routes
from nemo_orch.rollout.engines.scripted import RouterReplies, ScriptedEngine, scripted_settings
from nemo_orch.rollout.episode import Episode
from nemo_orch.rollout.runner import DirectPolicy
from nemo_orch.rollout.trajectory import Trajectory
from nemo_orch.tools.interfaces import EXPERT_TOOL, offers_orchestra
from nemo_orch.tools.registry import Toolbox


class NaiveRouterAgent:
    """The naive routers (``router_shares``), each task's route drawn in task order with
    ``seed`` (:func:`~nemo_orch.envs.offline.orchestra.naive_routes` on ToolOrchestra's
    interface, :func:`~nemo_orch.envs.offline.world.naive_routes` on the basic one) and played by
    a scripted engine, which answers from the last observation."""

    def __init__(
        self,
        tasks: list[Task],
        router_shares: Mapping[str, float],
        seed: int,
        toolbox: Toolbox,
        tokenizer: PreTrainedTokenizerBase,
        settings: RolloutConfig,
    ) -> None:
        if offers_orchestra(toolbox.tools):
            self.routes = orchestra.naive_routes(
                tasks, orchestra.Writers.of(toolbox), router_shares, seed
            )
        else:
            expert = toolbox.tools[EXPERT_TOOL]
            self.routes = naive_routes(tasks, expert.models, expert.pricing, router_shares, seed)
        self.toolbox, self.tokenizer = toolbox, tokenizer
        self.settings = scripted_settings(settings)

    async def episode(self, task: Task, sample: int, seed: int) -> Trajectory:
        replies = RouterReplies(self.routes[task.id], task.answer or "")
        policy = DirectPolicy(ScriptedEngine(self.tokenizer, replies))
        return await Episode(
            task, sample, policy, self.toolbox, self.tokenizer, self.settings, seed=seed
        ).run()
