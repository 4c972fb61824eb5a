"""The offline world's own metrics of a training step (``OfflineEnvironment.rollout_metrics``:
routes, flat and one-route groups, each preference's share of the advantage mass), on
hand-built groups, and how GRPO's rollouts hand every environment the groups of its tasks."""

import pytest

from nemo_orch import config as config_lib
from nemo_orch.data.tasks import Task
from nemo_orch.envs import build_environment
from nemo_orch.envs.interfaces import Environment, EpisodeGroup
from nemo_orch.envs.offline.metrics import rollout_metrics
from nemo_orch.reward.combine import RewardBreakdown
from nemo_orch.rollout.trajectory import CallRecord, Trajectory, TurnRecord
from nemo_orch.train.grpo_groups import Group, environment_metrics


def _episode(*aliases: str) -> Trajectory:
    calls = [
        CallRecord(
            tool="search" if alias.startswith("search") else "answer", arguments={"model": alias}
        )
        for alias in aliases
    ]
    turns = [
        TurnRecord(
            turn=index,
            input_tokens=1,
            output_tokens=1,
            generation_seconds=0.0,
            orchestrator_cost_usd=0.0,
            finish_reason="stop",
            calls=[call],
        )
        for index, call in enumerate(calls)
    ]
    return Trajectory.without_tokens(
        task_id="t",
        sample=0,
        seed=0,
        messages=[],
        tools=[],
        turns=turns,
        termination="answer",
        answer="1",
        wall_seconds=0.0,
    )


def _task(family: str, preference: str) -> Task:
    return Task(
        f"{family}-{preference}", "q", metadata={"family": family, "preference_name": preference}
    )


def _group(
    family: str,
    preference: str,
    episodes: list[tuple[tuple[str, ...], float]],
    advantages: list[float] | None = None,
) -> EpisodeGroup:
    return EpisodeGroup(
        _task(family, preference),
        [_episode(*route) for route, _ in episodes],
        [reward for _, reward in episodes],
        advantages,
    )


def test_flat_and_one_route_groups_are_told_apart_per_group_and_over_all():
    # lookup/accuracy: one route, rewards differ (the answerer's luck): signal, none on the route
    same_route = _group(
        "lookup", "accuracy", [(("search-1", "answer-1"), 1.0), (("search-1", "answer-1"), 0.0)]
    )
    # lookup/cost: two routes, equal rewards: no signal at all
    flat = _group(
        "lookup", "cost", [(("search-3", "answer-4"), 0.5), (("search-1", "answer-1"), 0.5)]
    )
    # lookup/cost again: two routes, two rewards
    both = _group(
        "lookup", "cost", [(("search-3", "answer-4"), 0.9), (("search-1", "answer-1"), 0.2)]
    )
    metrics = rollout_metrics([same_route, flat, both])
    assert metrics["group/lookup/accuracy/flat"] == 0.0
    assert metrics["group/lookup/accuracy/one_route"] == 1.0
    assert metrics["group/lookup/cost/flat"] == 0.5
    assert metrics["group/lookup/cost/one_route"] == 0.0
    assert metrics["signal/flat"] == pytest.approx(1 / 3)
    assert metrics["signal/one_route"] == pytest.approx(1 / 3)
    # the routes, over all and per group, and each group's mean reward
    assert metrics["route/search-1>answer-1"] == pytest.approx(4 / 6)
    assert metrics["group/lookup/cost/route/search-3>answer-4"] == 0.5
    assert metrics["group/lookup/cost/reward"] == pytest.approx(2.1 / 4)


def test_each_preference_gets_its_share_of_the_trained_advantage_mass():
    accuracy = _group("math", "accuracy", [(("answer-1",), 1.0), (("answer-2",), 0.9)], [1.0, -1.0])
    cost = [
        _group("math", "cost", [(("answer-4",), 0.8), (("answer-1",), 0.1)], [1.0, -1.0])
        for _ in range(3)
    ]
    untrained = _group("math", "no_code", [(("answer-1",), 0.4), (("answer-2",), 0.3)])
    metrics = rollout_metrics([accuracy, *cost, untrained])
    assert metrics["signal/advantage_share/accuracy"] == pytest.approx(0.25)
    assert metrics["signal/advantage_share/cost"] == pytest.approx(0.75)
    assert "signal/advantage_share/no_code" not in metrics


class _Counting(Environment):
    """An environment that reports how many groups, and trained ones, it was handed."""

    def __init__(self, name: str) -> None:
        self.name, self.notes = name, {}

    def tasks(self, split, count, seed):
        return []

    def toolbox(self):
        raise NotImplementedError

    async def score(self, task, trajectory):
        raise NotImplementedError

    def rollout_metrics(self, groups):
        return {
            f"{self.name}/groups": len(groups),
            f"{self.name}/trained": sum(g.advantages is not None for g in groups),
            f"{self.name}/advantages": sum(abs(a) for g in groups for a in g.advantages or []),
        }


def test_each_environment_gets_the_groups_of_its_tasks_with_the_trained_ones_advantages():
    def group(source: str, rewards: list[float]) -> Group:
        return Group(
            Task("t", "q"),
            [_episode("answer-1") for _ in rewards],
            [RewardBreakdown(reward, {}) for reward in rewards],
            source,
        )

    kept = [group("a", [1.0, 0.0]), group("b", [0.5, 0.0])]
    generated = [*kept, group("a", [1.0, 1.0])]
    reward = config_lib.load([]).reward
    metrics = environment_metrics(
        [_Counting("a"), _Counting("b"), _Counting("c")], generated, kept, reward
    )
    assert metrics["a/groups"] == 2 and metrics["a/trained"] == 1 and metrics["b/groups"] == 1
    assert metrics["a/advantages"] == pytest.approx(2.0, rel=1e-3)  # +-1 for two rewards
    assert "c/groups" not in metrics  # no groups of its own: not asked


def test_the_offline_environment_reports_through_the_hook():
    environment = build_environment(config_lib.load([]))
    group = _group("word", "cost", [(("answer-4",), 0.7)])
    assert environment.rollout_metrics([group])["group/word/cost/route/answer-4"] == 1.0
