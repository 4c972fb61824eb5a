"""Group advantages, filters and dynamic sampling."""

import asyncio
import math

import pytest

from nemo_orch.config import RewardConfig
from nemo_orch.reward import (
    RewardBreakdown,
    fill_batch,
    group_advantages,
    group_drop_reason,
    step_advantages,
    trajectory_drop_reason,
)

EXACT = RewardConfig(advantage_eps=1e-12)
STD = math.sqrt(0.1875)  # population std of [1, 0, 0, 0]


def test_group_advantages_hand_computed():
    assert group_advantages([1, 0, 0, 0], EXACT) == pytest.approx(
        [0.75 / STD, -0.25 / STD, -0.25 / STD, -0.25 / STD]
    )


def test_leave_one_out_hand_computed():
    config = RewardConfig(leave_one_out=True, advantage_eps=1e-12)
    # baseline of the first: mean(0, 0, 0) = 0; of the others: mean(1, 0, 0) = 1/3
    assert group_advantages([1, 0, 0, 0], config) == pytest.approx(
        [1 / STD, -1 / 3 / STD, -1 / 3 / STD, -1 / 3 / STD]
    )


def test_advantages_are_clipped_and_degenerate_groups_are_zero():
    clipped = group_advantages([1] + [0] * 9, RewardConfig(advantage_clip=2.0))
    assert clipped[0] == 2.0 and clipped[1] == pytest.approx(-1 / 3, rel=1e-4)
    assert group_advantages([0.5, 0.5, 0.5], EXACT) == [0.0, 0.0, 0.0]
    assert group_advantages([0.7], EXACT) == [0.0]
    assert group_advantages([], EXACT) == []


def breakdown(reward, format_errors=0, answered=True):
    return RewardBreakdown(
        reward, {"format_errors": float(format_errors), "answered": float(answered)}
    )


def test_trajectory_filters():
    malformed, silent = breakdown(0.0, format_errors=2), breakdown(0.0, answered=False)
    assert trajectory_drop_reason(malformed, RewardConfig()) is None
    assert trajectory_drop_reason(silent, RewardConfig()) is None
    strict = RewardConfig(drop_format_errors=True, drop_unanswered=True)
    assert trajectory_drop_reason(malformed, strict) == "format_errors"
    assert trajectory_drop_reason(silent, strict) == "unanswered"
    assert trajectory_drop_reason(breakdown(1.0), strict) is None


def test_group_filters():
    config = RewardConfig(min_group_std=0.1, drop_unanswered=True)
    assert group_drop_reason([breakdown(1.0), breakdown(0.0)], config) is None
    assert group_drop_reason([breakdown(1.0), breakdown(1.0)], config) == "low_std"
    assert (
        group_drop_reason([breakdown(1.0, answered=False), breakdown(0.0, answered=False)], config)
        == "empty"
    )
    assert group_drop_reason([breakdown(1.0)] * 2, RewardConfig(min_group_std=0.0)) is None
    assert group_drop_reason([breakdown(1.0)] * 2, RewardConfig()) == "low_std"  # the default


def run_fill(script, needed, max_rounds):
    """fill_batch over groups served from ``script`` (one list of groups per round); records
    how many groups each round asked for."""
    config = RewardConfig(min_group_std=0.1)
    asked = []

    async def make_groups(count, round_index):
        asked.append((count, round_index))
        await asyncio.sleep(0)
        return script[round_index]

    kept, stats = asyncio.run(
        fill_batch(make_groups, needed, max_rounds, lambda group: group_drop_reason(group, config))
    )
    return kept, stats, asked


GOOD = [breakdown(1.0), breakdown(0.0)]
FLAT = [breakdown(1.0), breakdown(1.0)]


def test_fill_batch_tops_up_the_missing_groups():
    kept, stats, asked = run_fill([[GOOD, FLAT, GOOD], [GOOD]], needed=3, max_rounds=3)
    assert kept == [GOOD, GOOD, GOOD]
    assert asked == [(3, 0), (1, 1)]
    assert (stats.rounds, stats.generated, stats.kept, stats.dropped) == (2, 4, 3, {"low_std": 1})


def test_fill_batch_stops_at_the_round_limit():
    kept, stats, asked = run_fill([[FLAT, GOOD], [FLAT], [GOOD]], needed=2, max_rounds=2)
    assert kept == [GOOD]
    assert asked == [(2, 0), (1, 1)]
    assert (stats.rounds, stats.generated, stats.kept, stats.dropped) == (2, 3, 1, {"low_std": 2})


def test_fill_batch_drops_surplus_and_checks_arguments():
    kept, stats, _ = run_fill([[GOOD, GOOD, GOOD]], needed=2, max_rounds=1)
    assert len(kept) == 2 and stats.dropped == {"surplus": 1}
    assert run_fill([], needed=0, max_rounds=1)[1].rounds == 0
    with pytest.raises(ValueError):
        run_fill([], needed=1, max_rounds=0)


def test_step_advantages_compare_the_choices_made_at_one_state():
    config = EXACT
    # Five episodes of one task: two first calls (a, b); after a, the same observation "x"
    # for three, then two answerers (c, d); one episode saw another observation ("y").
    states = [
        [("p",), ("p", "a", "x")],
        [("p",), ("p", "a", "x")],
        [("p",), ("p", "a", "y")],
        [("p",), ("p", "a", "x")],
        [("p",)],
    ]
    rewards = [1.0, 0.0, 0.5, 1.0, 0.2]
    steps = step_advantages(states, rewards, config)
    # The first turns share the prompt: their step group is the episode group.
    assert [turns[0] for turns in steps] == pytest.approx(group_advantages(rewards, config))
    # After (a, x): episodes 0, 1 and 3 compared among themselves.
    assert [steps[0][1], steps[1][1], steps[3][1]] == pytest.approx(
        group_advantages([1.0, 0.0, 1.0], config)
    )
    assert steps[2][1] == 0.0  # no other episode reached (a, y)
    assert [len(turns) for turns in steps] == [2, 2, 2, 2, 1]
