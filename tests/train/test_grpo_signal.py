"""Where a GRPO step's learning signal is: flat groups, one-route groups, and each preference's
share of the advantage mass (``signal_metrics``), on hand-built groups of the offline world."""

import pytest

from nemo_orch import config as config_lib
from nemo_orch.data.tasks import Task
from nemo_orch.reward.combine import RewardBreakdown
from nemo_orch.rollout.episode import CallRecord, Trajectory, TurnRecord
from nemo_orch.train.grpo_rollouts import Group, signal_metrics


def _episode(*aliases: str) -> Trajectory:
    calls = [CallRecord("search" if alias.startswith("search") else "answer", {"model": alias})
             for alias in aliases]
    turns = [TurnRecord(index, 1, 1, 0.0, 0.0, "stop", [call]) for index, call in
             enumerate(calls)]
    return Trajectory.without_tokens("t", 0, 0, [], [], turns, "answer", "1", 0.0)


def _group(family: str, preference: str, episodes: list[tuple[tuple[str, ...], float]]) -> Group:
    task = Task(f"{family}-{preference}", "q",
                metadata={"family": family, "preference_name": preference})
    return Group(task, [_episode(*route) for route, _ in episodes],
                 [RewardBreakdown(reward, {}) for _, reward in episodes])


@pytest.fixture(scope="module")
def reward():
    return config_lib.load([]).reward


def test_flat_and_one_route_groups_are_told_apart_per_group_and_over_all(reward):
    # lookup/accuracy: one route, rewards differ (the answerer's luck): signal, none on the route
    same_route = _group("lookup", "accuracy", [(("search-1", "answer-1"), 1.0),
                                                (("search-1", "answer-1"), 0.0)])
    # lookup/cost: two routes, equal rewards: no signal at all
    flat = _group("lookup", "cost", [(("search-3", "answer-4"), 0.5),
                                      (("search-1", "answer-1"), 0.5)])
    # lookup/cost again: two routes, two rewards
    both = _group("lookup", "cost", [(("search-3", "answer-4"), 0.9),
                                      (("search-1", "answer-1"), 0.2)])
    metrics = signal_metrics([same_route, flat, both], [same_route, both], reward)
    assert metrics["group/lookup/accuracy/flat"] == 0.0
    assert metrics["group/lookup/accuracy/one_route"] == 1.0
    assert metrics["group/lookup/cost/flat"] == 0.5
    assert metrics["group/lookup/cost/one_route"] == 0.0
    assert metrics["signal/flat"] == pytest.approx(1 / 3)
    assert metrics["signal/one_route"] == pytest.approx(1 / 3)


def test_each_preference_gets_its_share_of_the_trained_advantage_mass(reward):
    # Two episodes with different rewards: advantages +-1 (advantage_eps aside) whatever the
    # rewards' scale, so each trained group carries the same mass.
    accuracy = _group("math", "accuracy", [(("answer-1",), 1.0), (("answer-2",), 0.9)])
    cost = [_group("math", "cost", [(("answer-4",), 0.8), (("answer-1",), 0.1)])
            for _ in range(3)]
    metrics = signal_metrics([accuracy, *cost], [accuracy, *cost], reward)
    assert metrics["signal/advantage_share/accuracy"] == pytest.approx(0.25, rel=1e-4)
    assert metrics["signal/advantage_share/cost"] == pytest.approx(0.75, rel=1e-4)
    # Groups outside the offline world (no family) are not counted.
    plain = Group(Task("x", "q"), [_episode("answer-1")], [RewardBreakdown(1.0, {})])
    assert signal_metrics([plain], [plain], reward) == {}
