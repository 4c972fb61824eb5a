"""A tau2 task's gold replay as the turns tau2's evaluator scores (the tau2 tests' reference
episode)."""

from __future__ import annotations

from typing import Any

from nemo_orch.envs.tau2 import adapter, tau2_gold_plan
from nemo_orch.eval.agents import GoldReplayAgent
from nemo_orch.rollout.opening import episode_id


async def gold_replay_turns(domain: Any, task: Any) -> list[adapter.Turn]:
    """The gold replay agent's episode as tau2 turns: the calls that reached the environment,
    then the closing message."""
    agent = GoldReplayAgent(tau2_gold_plan, domain.assistant_toolbox(), domain.user_toolbox())
    trajectory = await agent.episode(task, 0, seed=0)
    try:
        return adapter.recorded_turns(
            domain, task, episode_id(task.id), trajectory.seed, trajectory.answer
        )
    finally:
        domain.environments.release(episode_id(task.id), trajectory.seed)
