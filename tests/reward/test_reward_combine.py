"""Group rewards under each combination, and batch scoring."""

import asyncio

import pytest
from reward_fixtures import trajectory

from nemo_orch.config import RewardConfig
from nemo_orch.data.tasks import Task
from nemo_orch.reward import OutcomeScorer, by_answer, score_group, score_groups
from nemo_orch.reward.outcome import OUTCOME_METHODS, OutcomeResult

RIGHT, WRONG = OutcomeResult(True, "exact"), OutcomeResult(False, "no_match")
TOOLORCHESTRA = RewardConfig(combination="toolorchestra")
SEARCH = (("web_search", {"query": "x"}),)


def task(preference=None):
    return Task(
        id="t",
        question="?",
        answer="42",
        metadata={} if preference is None else {"preference": preference},
    )


def rewards(preference, trajectories, outcomes, config=TOOLORCHESTRA):
    return [b.reward for b in score_group(task(preference), trajectories, outcomes, config)]


def test_sign_cheaper_scores_higher_only_when_cost_is_preferred():
    cheap, dear = trajectory(usd=0.01, seconds=1.0), trajectory(usd=0.02, seconds=1.0)
    cheap_reward, dear_reward = rewards({"accuracy": 1, "cost": 1}, [cheap, dear], [RIGHT, RIGHT])
    assert cheap_reward > dear_reward
    assert (cheap_reward, dear_reward) == (2.0, 1.0)
    assert rewards({"accuracy": 1}, [cheap, dear], [RIGHT, RIGHT]) == [1.0, 1.0]
    assert rewards(None, [cheap, dear], [RIGHT, RIGHT]) == [1.0, 1.0]  # default: accuracy only


def test_avoided_tool_is_penalised():
    searched, plain = trajectory(calls=SEARCH), trajectory()
    searched_reward, plain_reward = rewards(
        {"accuracy": 1, "tool:web_search": -1}, [searched, plain], [RIGHT, RIGHT]
    )
    assert plain_reward > searched_reward > 0  # still better than any wrong answer


def test_wanted_tool_is_rewarded():
    searched, plain = trajectory(calls=SEARCH), trajectory()
    searched_reward, plain_reward = rewards(
        {"accuracy": 1, "tool:web_search": 1}, [searched, plain], [RIGHT, RIGHT]
    )
    assert searched_reward > plain_reward


def test_latency_preference_prefers_the_faster():
    fast, slow = trajectory(seconds=1.0), trajectory(seconds=3.0)
    fast_reward, slow_reward = rewards(
        {"accuracy": 1, "latency": 0.5}, [fast, slow], [RIGHT, RIGHT]
    )
    assert (fast_reward, slow_reward) == (1.5, 1.0)


def test_wrong_is_zero_and_the_group_is_normalized_together():
    group = [trajectory(usd=0.0), trajectory(usd=0.1), trajectory(usd=0.2)]
    # The wrong one is the cheapest: cost is normalized over the whole group, wrong included.
    assert rewards({"accuracy": 1, "cost": 1}, group, [WRONG, RIGHT, RIGHT]) == [0.0, 1.5, 1.0]


def test_equal_right_answers_get_equal_rewards():
    group = [trajectory(usd=0.1, seconds=2.0, calls=SEARCH) for _ in range(3)]
    preference = {"accuracy": 1, "cost": 0.5, "latency": 0.25, "tool:web_search": -1}
    assert rewards(preference, group, [RIGHT] * 3) == [2.75] * 3


def test_over_budget_scores_zero():
    over = Task(id="t", question="?", answer="42", metadata={"budget_usd": 0.05})
    breakdowns = score_group(
        over, [trajectory(usd=0.01), trajectory(usd=0.1)], [RIGHT, RIGHT], TOOLORCHESTRA
    )
    assert [b.reward for b in breakdowns] == [1.0, 0.0]
    assert [b.components["over_budget"] for b in breakdowns] == [0.0, 1.0]


def test_weighted_baselines_each_component():
    config = RewardConfig(
        combination="weighted", weights={"outcome": 1.0, "cost": 0.5}, advantage_eps=1e-9
    )
    right, wrong = score_group(
        task(), [trajectory(usd=0.0), trajectory(usd=0.2)], [RIGHT, WRONG], config
    )
    assert right.reward == pytest.approx(1.5) and wrong.reward == pytest.approx(-1.5)
    assert right.components["term:cost"] == pytest.approx(0.5)
    same = score_group(task(), [trajectory(usd=0.1)] * 2, [RIGHT, RIGHT], config)
    assert [b.reward for b in same] == [0.0, 0.0]
    with pytest.raises(ValueError, match="unknown components"):
        score_group(
            task(),
            [trajectory()],
            [RIGHT],
            RewardConfig(combination="weighted", weights={"speed": 1.0}),
        )


def test_weighted_preference_component():
    config = RewardConfig(combination="weighted", weights={"preference": 1.0})
    searched, plain = score_group(
        task({"accuracy": 1, "tool:web_search": -1}),
        [trajectory(calls=SEARCH), trajectory()],
        [RIGHT, RIGHT],
        config,
    )
    assert searched.reward < 0 < plain.reward


def test_linear():
    config = RewardConfig(
        combination="linear",
        linear_alpha=0.6,
        linear_beta=0.25,
        linear_gamma=0.1,
        linear_delta=0.05,
        usd_reference=0.01,
        seconds_reference=10.0,
    )
    [breakdown] = score_group(
        task({"accuracy": 1, "tool:web_search": -1}),
        [trajectory(usd=0.01, seconds=5.0)],
        [RIGHT],
        config,
    )
    assert breakdown.reward == pytest.approx(0.6 - 0.25 - 0.05 + 0.05)


def test_preference_scores_on_a_fixed_scale_as_the_offline_utility():
    """Routes of equal cost keep equal rewards (no min-max stretch of their noise), and the
    reward is the offline world's utility of the episode."""
    from nemo_orch.envs.offline.values import utility

    config = RewardConfig(combination="preference", usd_reference=0.01)
    preference = {"accuracy": 1.0, "cost": 1.0, "tool:web_search": -1.0}
    dear, dearer = trajectory(usd=0.0150, calls=SEARCH), trajectory(usd=0.0151, calls=SEARCH)
    cheap = trajectory(usd=0.0002)
    scored = rewards(preference, [dear, dearer, cheap, dear], [RIGHT, RIGHT, RIGHT, WRONG], config)
    # Right but dearer than it is worth: 0, never below a wrong answer.
    assert scored[0] == scored[1] == scored[3] == 0.0
    assert scored[2] == pytest.approx(1 - 0.02)
    assert scored[2] == pytest.approx(utility(preference, True, 0.0002, {}, 0.01))
    assert scored[0] == pytest.approx(utility(preference, True, 0.015, {"web_search": 1}, 0.01))
    # The min-max combination stretches the 0.0001 USD between two equally dear routes to the
    # whole cost range: one outscores the other by a full cost weight; the fixed scale does not.
    cost = {"accuracy": 1.0, "cost": 0.1}
    stretched = rewards(cost, [dear, dearer], [RIGHT, RIGHT])
    assert stretched[0] - stretched[1] == pytest.approx(0.1)
    fixed = rewards(cost, [dear, dearer], [RIGHT, RIGHT], config)
    assert fixed[0] - fixed[1] == pytest.approx(0.1 * 0.0001 / 0.01)


def test_components_are_all_logged():
    group = [
        trajectory(calls=SEARCH, format_errors=("malformed_json",)),
        trajectory(None, calls=(("call_expert", {"model": "math-large"}),)),
    ]
    breakdowns = score_group(
        task({"accuracy": 1, "tool:python": -1}), group, [RIGHT, WRONG], TOOLORCHESTRA
    )
    keys = {
        "reward",
        "outcome",
        "usd",
        "seconds",
        "preference_match",
        "format_errors",
        "answered",
        "over_budget",
        "tool:web_search",
        "tool:call_expert",
        "tool:python",
        "model:math-large",
        "term:accuracy",
        "term:tool:python",
        *(f"outcome_method:{m}" for m in OUTCOME_METHODS),
    }
    assert all(b.components.keys() == keys for b in breakdowns)
    first, second = (b.components for b in breakdowns)
    assert (first["format_errors"], first["answered"], first["tool:call_expert"]) == (1, 1, 0)
    assert (second["answered"], second["model:math-large"]) == (0, 1)
    assert (first["outcome_method:exact"], second["outcome_method:no_match"]) == (1, 1)
    assert (
        first["reward"]
        == breakdowns[0].reward
        == sum(v for k, v in first.items() if k.startswith("term:"))
    )


def test_score_groups_scores_every_answer():
    tasks = [task({"accuracy": 1, "cost": 1}), Task(id="u", question="2+2?", answer="4")]
    groups = [
        [trajectory("42", usd=0.01), trajectory("41", usd=0.0), trajectory("42", usd=0.02)],
        [trajectory("4.0"), trajectory(None)],
    ]
    outcome = by_answer(OutcomeScorer(TOOLORCHESTRA))
    scored = asyncio.run(score_groups(tasks, groups, TOOLORCHESTRA, outcome))
    assert [[b.reward for b in group.breakdowns] for group in scored] == [
        [1.5, 0.0, 1.0],
        [1.0, 0.0],
    ]
    assert [group.trajectories for group in scored] == groups  # none masked
    assert scored[1].breakdowns[0].components["outcome_method:numeric"] == 1.0
    assert scored[1].breakdowns[1].components["outcome_method:empty"] == 1.0
    with pytest.raises(ValueError):
        asyncio.run(score_groups(tasks, groups[:1], TOOLORCHESTRA, outcome))
