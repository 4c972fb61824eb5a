"""Scoring whole batches of groups: what GRPO's rollouts call."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from nemo_orch.config import RewardConfig
from nemo_orch.data.tasks import Task
from nemo_orch.reward.combine import RewardBreakdown, score_group
from nemo_orch.reward.outcome import AnswerScorer, OutcomeResult
from nemo_orch.rollout.episode import Trajectory

# An episode's outcome: an environment's ``score`` (its outcome), or an answer scorer's.
OutcomeFn = Callable[[Task, Trajectory], Awaitable[OutcomeResult]]


def by_answer(scorer: AnswerScorer) -> OutcomeFn:
    """Episodes scored by their answer and calls, as an :class:`AnswerScorer` reads them."""
    async def outcome(task: Task, trajectory: Trajectory) -> OutcomeResult:
        return await scorer.score(task, trajectory.answer, trajectory.calls())

    return outcome


async def score_groups(tasks: Sequence[Task], groups: Sequence[Sequence[Trajectory]],
                       config: RewardConfig, outcome: OutcomeFn) -> list[list[RewardBreakdown]]:
    """The breakdowns of every group (``groups[i]`` are ``tasks[i]``'s trajectories). All
    episodes are scored concurrently (judge calls overlap), then each group is combined on its
    own."""
    if len(tasks) != len(groups):
        raise ValueError(f"{len(tasks)} tasks but {len(groups)} groups")
    outcomes = await asyncio.gather(*(asyncio.gather(*(outcome(task, t) for t in group))
                                      for task, group in zip(tasks, groups)))
    return [score_group(task, group, group_outcomes, config)
            for task, group, group_outcomes in zip(tasks, groups, outcomes)]
