"""The episode records: keyword-only, with a typed termination that a saved trajectory keeps as
its plain name."""

from __future__ import annotations

import json

import pytest

from nemo_orch.rollout.trajectory import CallRecord, Termination, Trajectory, TurnRecord


def _turn() -> TurnRecord:
    return TurnRecord(
        turn=0,
        input_tokens=3,
        output_tokens=2,
        generation_seconds=0.5,
        orchestrator_cost_usd=0.001,
        finish_reason="stop",
        calls=[CallRecord(tool="search", arguments={"query": "q"}, cost_usd=0.01)],
    )


def _episode(termination: str) -> Trajectory:
    return Trajectory.without_tokens(
        task_id="t",
        sample=1,
        seed=7,
        messages=[],
        tools=[],
        turns=[_turn()],
        termination=termination,
        answer="42",
        wall_seconds=1.0,
    )


def test_records_take_keywords_only():
    with pytest.raises(TypeError):
        TurnRecord(0, 3, 2, 0.5, 0.001, "stop")  # type: ignore[misc]
    with pytest.raises(TypeError):
        CallRecord("search", {"query": "q"})  # type: ignore[misc]
    with pytest.raises(TypeError):
        Trajectory.without_tokens("t", 0, 0, [], [], [], "answer", "1", 0.0)  # type: ignore[misc]


def test_a_termination_is_one_of_the_named_ends():
    episode = _episode("budget")
    assert episode.termination is Termination.BUDGET
    with pytest.raises(ValueError, match="not a valid Termination"):
        _episode("gave_up")


def test_a_saved_trajectory_names_its_termination_plainly():
    saved = json.loads(json.dumps(_episode(Termination.USER_STOP).to_json()))
    assert saved["termination"] == "user_stop"
    assert saved["ledger"][0]["calls"][0]["tool"] == "search"
    assert saved["cost_usd"] == pytest.approx(0.011)
