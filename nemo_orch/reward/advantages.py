"""From group rewards to GRPO advantages; which groups and trajectories train; dynamic sampling.

A group whose rewards barely differ (spread below ``reward.min_group_std``) carries no signal and
is dropped; :func:`fill_batch` then rolls out more groups (DAPO's dynamic sampling) so a step still
trains on a full batch when it can. A dropped trajectory (``drop_format_errors``,
``drop_unanswered``) gets no loss, but its reward still counts in its group's baseline: it is a
real sample of what the policy does.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from nemo_orch.config import RewardConfig
from nemo_orch.reward.combine import RewardBreakdown

Group = TypeVar("Group")


def group_advantages(rewards: Sequence[float], config: RewardConfig) -> list[float]:
    """``(r_i - b_i) / (std + eps)``, clipped to ``+-advantage_clip``; ``b_i`` is the group mean,
    or with ``leave_one_out`` the mean of the other rewards; ``std`` is the population standard
    deviation of the whole group. A group of one has no baseline: advantage 0."""
    count = len(rewards)
    if count < 2:
        return [0.0] * count
    total, std = sum(rewards), statistics.pstdev(rewards)
    advantages = []
    for reward in rewards:
        baseline = (total - reward) / (count - 1) if config.leave_one_out else total / count
        advantage = (reward - baseline) / (std + config.advantage_eps)
        advantages.append(max(-config.advantage_clip, min(config.advantage_clip, advantage)))
    return advantages


def step_advantages(
    states: Sequence[Sequence[Hashable]], rewards: Sequence[float], config: RewardConfig
) -> list[list[float]]:
    """Credit per call (GiGPO's step-level advantage, Feng et al. 2025): the turns of one
    group's episodes that start from the same state (``states[i][t]``: episode ``i``'s state
    before its turn ``t``, e.g. its tokens so far) form a step group, and each turn's advantage
    is its episode's reward normalized within that step group (:func:`group_advantages`): the
    choice made at a state is compared with the other choices made at that very state. A turn
    no other episode reached from its state gets 0. The first turns share the prompt, so their
    step group is the episode group."""
    members: dict[Hashable, list[tuple[int, int]]] = defaultdict(list)
    for episode, keys in enumerate(states):
        for turn, key in enumerate(keys):
            members[key].append((episode, turn))
    advantages = [[0.0] * len(keys) for keys in states]
    for steps in members.values():
        credit = group_advantages([rewards[episode] for episode, _ in steps], config)
        for (episode, turn), advantage in zip(steps, credit):
            advantages[episode][turn] = advantage
    return advantages


def trajectory_drop_reason(breakdown: RewardBreakdown, config: RewardConfig) -> str | None:
    """Why this trajectory gets no loss (``format_errors``, ``unanswered``), or None."""
    if config.drop_format_errors and breakdown.components["format_errors"] > 0:
        return "format_errors"
    if config.drop_unanswered and not breakdown.components["answered"]:
        return "unanswered"
    return None


def group_drop_reason(
    breakdowns: Sequence[RewardBreakdown], config: RewardConfig, group_baseline: bool = True
) -> str | None:
    """Why this group does not train: ``empty`` (no trajectory left after the per-trajectory
    filters) or, where the group is the baseline (GRPO; not PPO, whose critic learns from any
    reward), ``low_std`` (reward spread below ``min_group_std``: no signal); None keeps it."""
    if all(trajectory_drop_reason(b, config) for b in breakdowns):
        return "empty"
    if group_baseline and statistics.pstdev([b.reward for b in breakdowns]) < (
        config.min_group_std
    ):
        return "low_std"
    return None


@dataclass
class SamplingStats:
    """What :func:`fill_batch` did: rounds run, groups generated and kept, drops by reason."""

    rounds: int = 0
    generated: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)


async def fill_batch(
    make_groups: Callable[[int, int], Awaitable[list[Group]]],
    needed_groups: int,
    max_rounds: int,
    drop_reason: Callable[[Group], str | None],
) -> tuple[list[Group], SamplingStats]:
    """Keep the groups ``drop_reason`` accepts (returns None for) until ``needed_groups`` are
    kept or ``max_rounds`` rounds have run; then return what there is (maybe a smaller batch).

    Round ``r`` calls ``make_groups(missing, r)`` once for all missing groups, so they roll out
    concurrently. Groups beyond ``needed_groups`` are dropped as ``surplus``.
    """
    if needed_groups < 0 or max_rounds < 1:
        raise ValueError("need needed_groups >= 0 and max_rounds >= 1")
    kept: list[Group] = []
    stats = SamplingStats()
    dropped: Counter[str] = Counter()
    while len(kept) < needed_groups and stats.rounds < max_rounds:
        groups = await make_groups(needed_groups - len(kept), stats.rounds)
        stats.rounds += 1
        stats.generated += len(groups)
        for group in groups:
            reason = drop_reason(group)
            if reason is None and len(kept) == needed_groups:
                reason = "surplus"
            if reason is None:
                kept.append(group)
            else:
                dropped[reason] += 1
    stats.kept, stats.dropped = len(kept), dict(dropped)
    return kept, stats
