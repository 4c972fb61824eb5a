"""What a GRPO step rolled out, as values, and what it reports: each task's :class:`Group` of
scored episodes, the step's :class:`StepBatch` of them (kept, generated, dropped as too old) and
the step's rollout metrics (:func:`rollout_metrics`, :func:`environment_metrics`).
:class:`~nemo_orch.train.grpo_rollouts.Rollouts` makes them; the trainer turns the kept groups
into training samples (:mod:`nemo_orch.train.grpo_samples`)."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from nemo_orch.call_kinds import KINDS, InfraFailure, InfrastructureError
from nemo_orch.config import RewardConfig
from nemo_orch.data.tasks import Task
from nemo_orch.envs import Environment
from nemo_orch.envs.interfaces import EpisodeGroup
from nemo_orch.reward.advantages import SamplingStats, group_advantages
from nemo_orch.reward.combine import RewardBreakdown
from nemo_orch.reward.scoring import ScoredGroup
from nemo_orch.rollout.trajectory import Trajectory


@dataclass
class Group:
    """One task's group: the episodes it trains on and their rewards, and those masked out of
    it (each with the failure outside the policy that decided it: see
    :class:`~nemo_orch.reward.scoring.ScoredGroup`)."""

    task: Task
    trajectories: list[Trajectory]
    breakdowns: list[RewardBreakdown]
    source: str = ""  # the environment it came from (env.*)
    masked: list[tuple[Trajectory, InfraFailure]] = field(default_factory=list)

    @classmethod
    def of(cls, task: Task, scored: ScoredGroup, source: str) -> Group:
        return cls(task, scored.trajectories, scored.breakdowns, source, scored.masked)

    def age(self, version: int) -> int:
        """How many updates the oldest weights that wrote a turn of it are behind ``version``
        (0 where the engine's weights are not versioned)."""
        versions = [v for t in self.trajectories if (v := t.oldest_policy_version) is not None]
        return version - min(versions) if versions else 0


@dataclass
class StepBatch:
    """What rank 0's rollouts made of one step: the groups kept for training, every group
    generated (what the step's metrics describe; each with its episodes masked out as decided
    by infrastructure), the sampling stats, the routing choices the policy made itself, the
    episodes whose first choice was forced, the tasks left out because their prompt does not
    fit the context, and the validation metrics (empty between ``grpo.val_interval`` steps).
    Rolled out ahead (asynchronous GRPO): the groups dropped as too old for the trainer, the
    trained groups' ages, how long no step was rolling out since the last batch was taken,
    and how long the trainer waited for this one. ``environments``: the metrics each
    environment reports of its own groups (:meth:`~nemo_orch.envs.Environment.rollout_metrics`)."""

    kept: list[Group]
    generated: list[Group]
    stats: SamplingStats
    choices: Counter
    forced_episodes: int
    skipped_context: int
    environments: dict[str, float] = field(default_factory=dict)
    validation: dict[str, float] = field(default_factory=dict)
    dropped_stale: list[Group] = field(default_factory=list)
    ages: Counter = field(default_factory=Counter)
    rollout_idle_seconds: float | None = None
    trainer_idle_seconds: float | None = None

    def metrics(self) -> dict[str, float]:
        ahead = (
            {}
            if self.trainer_idle_seconds is None
            else {
                "async/dropped_groups": len(self.dropped_stale),
                "async/rollout_idle_s": self.rollout_idle_seconds,
                "async/trainer_idle_s": self.trainer_idle_seconds,
                **{f"async/age_{age}": count for age, count in sorted(self.ages.items())},
            }
        )
        return {
            **rollout_metrics(self.generated, self.stats),
            **self.environments,
            "explore/forced_episodes": self.forced_episodes,
            "sampling/skipped_context": self.skipped_context,
            **self.validation,
            **ahead,
            **{f"choices/{key}": count for key, count in self.choices.items()},
        }

    @property
    def masked(self) -> list[InfraFailure]:
        """The failures of every episode masked out of the step's groups."""
        return [failure for group in self.generated for _, failure in group.masked]

    def check_infrastructure(self, step: int, max_rate: float) -> None:
        """Raise :class:`~nemo_orch.call_kinds.InfrastructureError`, naming the failing
        endpoints, when more than ``max_rate`` of the step's episodes were masked."""
        masked = self.masked
        episodes = len(masked) + sum(len(group.trajectories) for group in self.generated)
        if not masked or len(masked) <= max_rate * episodes:
            return
        by_endpoint: dict[tuple[str, str], list[InfraFailure]] = defaultdict(list)
        for failure in masked:
            by_endpoint[failure.endpoint, failure.reason].append(failure)
        named = "; ".join(
            f"{endpoint}: {len(failures)} x {reason} ({failures[0].detail[:160]})"
            for (endpoint, reason), failures in sorted(
                by_endpoint.items(), key=lambda item: -len(item[1])
            )
        )
        raise InfrastructureError(
            f"{len(masked)} of the {episodes} episodes of step {step} were decided by "
            f"infrastructure failures ({len(masked) / episodes:.0%} > "
            f"rollout.max_infra_error_rate={max_rate:g}), rather than trained on: {named}"
        )


# ----------------------------------------------------------------------------- metrics


def episode_stats(trajectories: list[Trajectory]) -> dict[str, float]:
    """USD and seconds per task, format errors per turn."""
    turns = sum(len(t.turns) for t in trajectories)
    return {
        "usd_per_task": statistics.mean(t.cost_usd for t in trajectories),
        "seconds_per_task": statistics.mean(
            t.tool_seconds + t.generation_seconds for t in trajectories
        ),
        "format_error_rate": sum(sum(t.format_errors.values()) for t in trajectories)
        / max(turns, 1),
    }


def environment_metrics(
    environments: list[Environment], generated: list[Group], kept: list[Group], reward: RewardConfig
) -> dict[str, float]:
    """What each environment reports of the step's groups of its tasks (every group generated;
    the kept ones with the group advantages they train with)."""
    trained = {id(group) for group in kept}
    by_source: dict[str, list[EpisodeGroup]] = defaultdict(list)
    for group in generated:
        rewards = [b.reward for b in group.breakdowns]
        advantages = group_advantages(rewards, reward) if id(group) in trained else None
        by_source[group.source].append(
            EpisodeGroup(group.task, group.trajectories, rewards, advantages)
        )
    metrics: dict[str, float] = {}
    for environment in environments:
        if by_source[environment.name]:
            metrics.update(environment.rollout_metrics(by_source[environment.name]))
    return metrics


def rollout_metrics(groups: list[Group], stats: Any) -> dict[str, float]:
    """Per-step means over every episode generated (kept for training or not). Every call, of
    the masked episodes too, is counted by kind (``calls/<kind>``,
    ``call_rate/<kind>``) and the failed ones by tool (``call_errors``); the masked episodes by
    the failure that decided them (``masked/<reason>``) and their share (``masked/rate``); new
    branches of external agent loops' episodes (``rollout/branches``), where there are any."""
    metrics: dict[str, float] = {"sampling/rounds": stats.rounds, **_call_metrics(groups)}
    episodes = [(g.task, t, b) for g in groups for t, b in zip(g.trajectories, g.breakdowns)]
    if not episodes:
        return {**metrics, "sampling/kept": 0}
    metrics.update(
        {
            "reward": statistics.mean(b.reward for _, _, b in episodes),
            "accuracy": statistics.mean(b.components["outcome"] for _, _, b in episodes),
            **episode_stats([t for _, t, _ in episodes]),
            "answered": statistics.mean(float(t.answer is not None) for _, t, _ in episodes),
            "turns": statistics.mean(len(t.turns) for _, t, _ in episodes),
            "sampling/generated": stats.generated,
            "sampling/kept": stats.kept,
            **{f"sampling/dropped_{reason}": count for reason, count in stats.dropped.items()},
        }
    )
    metrics.update(_source_metrics(groups))
    return metrics


def _call_metrics(groups: list[Group]) -> dict[str, float]:
    """The step's calls by kind and its failed calls by tool, over every episode generated
    (masked or not), and its masked episodes by reason."""
    everything = [t for g in groups for t in [*g.trajectories, *(t for t, _ in g.masked)]]
    calls = [call for t in everything for turn in t.turns for call in turn.calls]
    kinds = Counter(call.kind for call in calls)
    # Calls that did not end ok: refused arguments, a tool that raised or timed out, an endpoint
    # that failed; each became an observation of its kind, not a crash.
    failed = Counter(
        call.tool for call in calls if call.tool is not None and call.error is not None
    )
    masked = Counter(failure.reason for g in groups for _, failure in g.masked)
    # Conversations an external agent loop sent back edited (nemo_orch.rollout.external).
    branches = sum(t.branches for t in everything)
    return {
        **({"rollout/branches": branches} if branches else {}),
        **{f"calls/{kind}": kinds[kind] for kind in KINDS},
        **{f"call_rate/{kind}": kinds[kind] / max(len(calls), 1) for kind in KINDS},
        "call_errors": sum(failed.values()),
        **{f"call_errors/{name}": count for name, count in failed.items()},
        "masked/episodes": sum(masked.values()),
        "masked/rate": sum(masked.values()) / max(len(everything), 1),
        **{f"masked/{reason}": count for reason, count in masked.items()},
    }


def _source_metrics(groups: list[Group]) -> dict[str, float]:
    """Per source of the mixture: its share of the episodes, reward, accuracy, USD per task
    and tool calls per episode (``source/<name>/...``)."""
    by_source: dict[str, list[tuple[Trajectory, RewardBreakdown]]] = defaultdict(list)
    for group in groups:
        by_source[group.source].extend(zip(group.trajectories, group.breakdowns))
    total = sum(len(episodes) for episodes in by_source.values())
    metrics: dict[str, float] = {}
    for source, episodes in sorted(by_source.items()):
        prefix = f"source/{source}"
        metrics[f"{prefix}/share"] = len(episodes) / total
        metrics[f"{prefix}/reward"] = statistics.mean(b.reward for _, b in episodes)
        metrics[f"{prefix}/accuracy"] = statistics.mean(
            b.components["outcome"] for _, b in episodes
        )
        metrics[f"{prefix}/usd_per_task"] = statistics.mean(t.cost_usd for t, _ in episodes)
        calls: Counter = Counter()
        for trajectory, _ in episodes:
            calls.update(trajectory.tool_counts())
        metrics.update(
            {f"{prefix}/tool/{name}": count / len(episodes) for name, count in calls.items()}
        )
    return metrics
