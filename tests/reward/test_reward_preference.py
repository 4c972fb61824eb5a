"""Trajectory features, budgets, preference adherence and preference instructions."""

import random

import pytest
from reward_fixtures import trajectory

from nemo_orch.data.tasks import Task
from nemo_orch.reward.components import (
    PREFERENCE_PHRASES,
    Features,
    check_preference,
    extract_features,
    preference_instruction,
    preference_match,
    task_preference,
)
from nemo_orch.reward.outcome import OutcomeResult

RIGHT = OutcomeResult(True, "exact")
TASK = Task(id="t", question="?", answer="42")
CALLS = (
    ("web_search", {"query": "x"}),
    ("call_expert", {"model": "math-large", "question": "?"}),
    ("call_expert", {"model": "math-small", "question": "?"}),
    ("call_expert", {"model": "math-large", "question": "?"}),
    (None, None),
)


def test_features():
    features = extract_features(
        TASK,
        trajectory(usd=0.25, seconds=1.5, calls=CALLS, format_errors=("malformed_json",) * 2),
        RIGHT,
    )
    assert (features.outcome, features.usd, features.seconds) == (1.0, 0.25, 1.5)
    assert features.calls == {
        "tool:web_search": 1,
        "tool:call_expert": 3,
        "model:math-large": 2,
        "model:math-small": 1,
    }
    assert (features.format_errors, features.answered, features.method) == (2, True, "exact")
    assert not extract_features(TASK, trajectory(None), RIGHT).answered


def test_budget_makes_a_right_answer_fail():
    task = Task(id="t", question="?", answer="42", metadata={"budget_usd": 0.1})
    within = extract_features(task, trajectory(usd=0.1), RIGHT)
    over = extract_features(task, trajectory(usd=0.2), RIGHT)
    ended = extract_features(TASK, trajectory(termination="budget"), RIGHT)
    assert (within.outcome, within.over_budget) == (1.0, False)
    assert (over.outcome, over.over_budget) == (0.0, True)
    assert (ended.outcome, ended.over_budget) == (0.0, True)


def features(**calls):
    return Features(
        outcome=1.0,
        usd=0.0,
        seconds=0.0,
        format_errors=0,
        answered=True,
        over_budget=False,
        method="exact",
        calls=calls,
    )


def test_preference_match():
    preference = {
        "accuracy": 1.0,
        "cost": 0.5,
        "tool:web_search": -1.0,
        "model:math-large": 1.0,
        "tool:python": 0.0,
    }
    assert preference_match(features(**{"model:math-large": 1}), preference) == 1.0
    assert (
        preference_match(features(**{"tool:web_search": 2, "model:math-large": 1}), preference)
        == 0.5
    )
    assert preference_match(features(**{"tool:web_search": 1}), preference) == 0.0
    assert preference_match(features(**{"tool:web_search": 3}), {"accuracy": 1.0}) == 1.0


def test_preference_instruction():
    assert preference_instruction({"accuracy": 1.0, "cost": 1.0}) == "Keep the cost low."
    assert preference_instruction({"accuracy": 1.0, "cost": 0.2}) == "Answer concisely."
    assert preference_instruction({"accuracy": 1.0}) == "Accuracy matters most."
    assert preference_instruction(
        {
            "accuracy": 1.0,
            "latency": 0.5,
            "tool:web_search": -1.0,
            "model:math-large": 0.5,
            "tool:retriever": -1.0,
        }
    ) == (
        "Answer quickly. Use the math-large model. Do not use the retriever tool. "
        "Do not use web search."
    )
    assert preference_instruction({}) == ""
    drawn = {
        preference_instruction({"accuracy": 1.0, "cost": 1.0}, random.Random(seed))
        for seed in range(20)
    }
    assert drawn == set(PREFERENCE_PHRASES["cost"])  # rng draws among the phrasings


def test_preference_vectors_are_checked():
    assert task_preference(TASK) == {"accuracy": 1.0}
    assert task_preference(Task(id="t", question="?", metadata={"preference": {"cost": 1}})) == {
        "cost": 1.0
    }
    for bad in ({"speed": 1.0}, {"tool:": 1.0}, {"cost": "high"}, {"cost": True}, ["cost"]):
        with pytest.raises(ValueError):
            check_preference(bad)
