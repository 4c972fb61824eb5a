"""Scoring whole batches of groups: what GRPO's rollouts call."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from nemo_orch.call_kinds import InfraFailure
from nemo_orch.config import RewardConfig
from nemo_orch.data.tasks import Task
from nemo_orch.reward.combine import RewardBreakdown, score_group
from nemo_orch.reward.outcome import AnswerScorer, OutcomeResult
from nemo_orch.rollout.trajectory import Trajectory

# An episode's outcome: an environment's ``score`` (its outcome), or an answer scorer's.
OutcomeFn = Callable[[Task, Trajectory], Awaitable[OutcomeResult]]


def infra_failure(trajectory: Trajectory, outcome: OutcomeResult) -> InfraFailure | None:
    """The failure outside the policy that decided a scored episode: the episode's own
    (:meth:`Trajectory.infra_failure`), else a judge that could not score its answer."""
    failure = trajectory.infra_failure()
    if failure is None and outcome.method == "judge_error":
        failure = InfraFailure("judge_error", "the judge", outcome.detail)
    return failure


def by_answer(scorer: AnswerScorer) -> OutcomeFn:
    """Episodes scored by their answer and calls, as an :class:`AnswerScorer` reads them."""

    async def outcome(task: Task, trajectory: Trajectory) -> OutcomeResult:
        return await scorer.score(task, trajectory.answer, trajectory.calls())

    return outcome


@dataclass(frozen=True)
class ScoredGroup:
    """One task's group, scored: the episodes kept and their breakdowns (combined among
    themselves), and the episodes masked out, each with the failure outside the policy that
    decided it (:func:`infra_failure`). A masked episode is in neither the group's statistics
    nor the loss: its reward would be the infrastructure's, not the policy's."""

    trajectories: list[Trajectory]
    breakdowns: list[RewardBreakdown]
    masked: list[tuple[Trajectory, InfraFailure]] = field(default_factory=list)


async def score_groups(
    tasks: Sequence[Task],
    groups: Sequence[Sequence[Trajectory]],
    config: RewardConfig,
    outcome: OutcomeFn,
) -> list[ScoredGroup]:
    """Every group scored (``groups[i]`` are ``tasks[i]``'s trajectories), each episode by
    ``outcome`` or, where an external agent loop scored it itself, by its verdict. All episodes are
    scored concurrently (judge calls overlap); then the episodes a failure outside the policy
    decided are masked, and each group's others are combined on their own, as if the masked
    ones never ran."""
    if len(tasks) != len(groups):
        raise ValueError(f"{len(tasks)} tasks but {len(groups)} groups")

    async def judged(
        task: Task, trajectory: Trajectory
    ) -> tuple[OutcomeResult | None, InfraFailure | None]:
        failure = trajectory.infra_failure()
        if failure is not None:  # decided already: its answer is worth no judge's call
            return None, failure
        result = (
            await outcome(task, trajectory)
            if trajectory.agent_correct is None
            else OutcomeResult(trajectory.agent_correct, "agent", "the agent loop's own verdict")
        )
        return result, infra_failure(trajectory, result)

    judgements = await asyncio.gather(
        *(asyncio.gather(*(judged(task, t) for t in group)) for task, group in zip(tasks, groups))
    )
    scored = []
    for task, group, judged_group in zip(tasks, groups, judgements):
        kept = [(t, result) for t, (result, failure) in zip(group, judged_group) if failure is None]
        scored.append(
            ScoredGroup(
                [t for t, _ in kept],
                score_group(task, [t for t, _ in kept], [result for _, result in kept], config),
                [
                    (t, failure)
                    for t, (_, failure) in zip(group, judged_group)
                    if failure is not None
                ],
            )
        )
    return scored
