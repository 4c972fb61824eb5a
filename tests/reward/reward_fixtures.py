"""Hand-made trajectories for the reward tests: only the ledger fields rewards read are real."""

from __future__ import annotations

from typing import Any

from nemo_orch.rollout.trajectory import CallRecord, Trajectory, TurnRecord


def trajectory(
    answer: str | None = "42",
    *,
    usd: float = 0.0,
    seconds: float = 0.0,
    calls: tuple[tuple[str | None, dict[str, Any]], ...] = (),
    format_errors: tuple[str, ...] = (),
    termination: str = "answer",
) -> Trajectory:
    """One turn costing ``usd`` and taking ``seconds`` of generation, with ``calls``
    (tool, arguments) that cost and take nothing."""
    turn = TurnRecord(
        turn=0,
        input_tokens=10,
        output_tokens=5,
        generation_seconds=seconds,
        orchestrator_cost_usd=usd,
        finish_reason="stop",
        calls=[CallRecord(tool=tool, arguments=arguments) for tool, arguments in calls],
        format_errors=list(format_errors),
    )
    return Trajectory(
        task_id="t",
        sample=0,
        messages=[],
        tools=[],
        token_ids=[1, 2],
        loss_mask=[0, 1],
        decision_mask=[0, 1],
        logprobs=[0.0, 0.0],
        prompt_length=1,
        turns=[turn],
        termination=termination,
        answer=answer,
        wall_seconds=seconds,
    )
