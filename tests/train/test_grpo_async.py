"""Asynchronous GRPO (``grpo.async_grpo``): with a staleness of 0 it is synchronous GRPO; run
ahead, no group older than the limit is trained on; a killed run resumes from its checkpoint
with nothing in flight and no sample trained twice; settings it cannot run with are refused."""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter
from pathlib import Path

import pytest
from support.cli_helpers import (
    grpo_overrides,
    grpo_stage,
    read_metrics,
    run_cli,
    sum_task_overrides,
)

from nemo_orch import config as config_lib
from nemo_orch.config import ConfigError
from nemo_orch.data.tasks import Task
from nemo_orch.envs import build_mixture
from nemo_orch.faults import ENV as KILL_AT
from nemo_orch.reward.advantages import SamplingStats
from nemo_orch.reward.combine import RewardBreakdown
from nemo_orch.rollout.trajectory import Trajectory, TurnRecord
from nemo_orch.train.grpo_groups import Group, StepBatch
from nemo_orch.train.grpo_rollouts import Rollouts
from nemo_orch.train.metrics import TRAINED_FILE


def _tasks(tmp_path: Path) -> list[str]:
    return [*sum_task_overrides(tmp_path), "grpo.max_steps=3"]


def _trained(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / TRAINED_FILE).read_text().splitlines()]


def _learned(metrics: list[dict]) -> list[dict]:
    """What two runs of the same samples and weights agree on: all but wall-clock figures and
    the asynchronous run's own bookkeeping."""
    return [
        {
            k: v
            for k, v in m.items()
            if not k.startswith(("time/", "async/")) and "per_s" not in k and "seconds" not in k
        }
        for m in metrics
    ]


def test_async_grpo_with_staleness_0_is_sync_grpo(start_checkpoint, tmp_path):
    run_cli("grpo", *grpo_overrides(start_checkpoint, tmp_path / "sync", *_tasks(tmp_path)))
    run_cli(
        "grpo",
        *grpo_overrides(
            start_checkpoint,
            tmp_path / "async",
            *_tasks(tmp_path),
            "grpo.async_grpo.enabled=true",
            "grpo.async_grpo.max_trajectory_age_steps=0",
        ),
    )
    sync, ahead = grpo_stage(tmp_path / "sync"), grpo_stage(tmp_path / "async")
    assert _trained(ahead) == _trained(sync)
    sync_metrics, async_metrics = _learned(read_metrics(sync)), _learned(read_metrics(ahead))
    assert [m["step"] for m in async_metrics] == [1, 2, 3]
    # Tolerance: the same samples on the same weights; the engine's threads may round apart.
    for ours, theirs in zip(async_metrics, sync_metrics):
        assert ours.keys() == theirs.keys()
        assert ours == {k: pytest.approx(v, rel=1e-5, abs=1e-7) for k, v in theirs.items()}
    assert all(
        m["async/age_0"] >= 1 and m["async/dropped_groups"] == 0 for m in read_metrics(ahead)
    )


def test_async_grpo_runs_ahead_and_a_killed_run_trains_no_sample_twice(start_checkpoint, tmp_path):
    args = grpo_overrides(
        start_checkpoint,
        tmp_path,
        *_tasks(tmp_path),
        "grpo.max_steps=4",
        "grpo.save_interval=2",
        "grpo.async_grpo.enabled=true",
        "grpo.importance_sampling_cap=2.0",
    )
    assert (
        run_cli("grpo", *args, env={KILL_AT: "step:4"}, expect=None).returncode == -signal.SIGKILL
    )
    stage = grpo_stage(tmp_path)
    assert [record["step"] for record in _trained(stage)] == [1, 2, 3]
    run_cli("grpo", *args)  # resumes from step 2's checkpoint: steps 3 and 4 again
    trained = _trained(stage)
    assert [record["step"] for record in trained] == [1, 2, 3, 4]
    samples = [sample for record in trained for sample in record["samples"]]
    assert samples and len(samples) == len(set(samples))
    # Each step trains on its own tasks (named s<step>r<round>-<index>).
    assert all(
        sample.startswith(f"s{record['step']}r")
        for record in trained
        for sample in record["samples"]
    )
    metrics = read_metrics(stage)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    ages = Counter(
        {
            int(key.removeprefix("async/age_")): value
            for m in metrics
            for key, value in m.items()
            if key.startswith("async/age_")
        }
    )
    assert set(ages) <= {0, 1}
    # Step 2's rollouts began on the starting weights while step 1 trained.
    assert metrics[1]["async/age_1"] >= 1
    assert all(
        {"async/trainer_idle_s", "async/rollout_idle_s", "is_weight_mean"} <= m.keys()
        for m in metrics
    )


def test_async_grpo_runs_ahead_on_ray_workers(start_checkpoint, tmp_path):
    run_cli(
        "grpo",
        *grpo_overrides(
            start_checkpoint,
            tmp_path,
            *_tasks(tmp_path),
            "rollout.backend=ray",
            "rollout.ray.num_workers=1",
            "rollout.ray.num_cpus_per_worker=0.5",
            "rollout.ray.object_store_mb=128",
            "grpo.async_grpo.enabled=true",
            "grpo.importance_sampling_cap=2.0",
        ),
    )
    metrics = read_metrics(grpo_stage(tmp_path))
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert {key for m in metrics for key in m if key.startswith("async/age_")} <= {
        "async/age_0",
        "async/age_1",
    }
    # The workers' turns are versioned: step 2's began on the starting weights.
    assert metrics[1]["async/age_1"] >= 1


def _group(task_id: str, *versions: int | None) -> Group:
    """A group of one episode whose turns were written by weights of ``versions``."""
    turns = [
        TurnRecord(
            turn=index,
            input_tokens=2,
            output_tokens=2,
            generation_seconds=0.0,
            orchestrator_cost_usd=0.0,
            finish_reason="stop",
            policy_version=version,
        )
        for index, version in enumerate(versions)
    ]
    episode = Trajectory(
        task_id=task_id,
        sample=0,
        messages=[],
        tools=[],
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        decision_mask=[0, 1, 1],
        logprobs=[0.0] * 3,
        prompt_length=1,
        turns=turns,
        termination="answer",
        answer="1",
        wall_seconds=0.0,
    )
    return Group(
        Task(task_id, "q"),
        [episode],
        [RewardBreakdown(1.0, {"outcome": 1.0, "format_errors": 0.0, "answered": 1.0})],
    )


def test_groups_older_than_the_limit_are_never_trained_on(tiny_tokenizer, tmp_path):
    from support.fixture_tools import DelayedEcho, echo_spec

    from nemo_orch.tools.registry import Toolbox

    config = config_lib.load(
        [
            f"run.output_dir={tmp_path}",
            "grpo.async_grpo.enabled=true",
            "grpo.async_grpo.max_trajectory_age_steps=1",
            "grpo.importance_sampling_cap=2.0",
        ]
    )
    fresh, one_behind, stale, unversioned = (
        _group("fresh", 3, 3),
        _group("one", 2, 3),
        _group("stale", 1, 3),
        _group("plain", None),
    )
    groups = [fresh, one_behind, stale, unversioned]
    config.run.dir.mkdir(parents=True)  # where leaving writes the sources' notes
    with Rollouts(
        config,
        None,
        tiny_tokenizer,
        build_mixture(config),
        [Toolbox([DelayedEcho(echo_spec("echo"))])],
    ) as rollouts:

        async def rolled_out() -> StepBatch:
            return StepBatch(
                groups, groups, SamplingStats(), Counter(), 0, 0, rollout_idle_seconds=0.0
            )

        async def ahead() -> None:  # as run_ahead leaves step 4's rollout
            rollouts._ahead[4] = asyncio.create_task(rolled_out())

        rollouts._call(ahead())
        batch = rollouts.take(4)  # trained by the weights of step 3
    assert batch.kept == [fresh, one_behind, unversioned] and batch.dropped_stale == [stale]
    assert batch.ages == Counter({0: 2, 1: 1})
    metrics = batch.metrics()
    assert (metrics["async/dropped_groups"], metrics["async/age_0"], metrics["async/age_1"]) == (
        1,
        2,
        1,
    )
    assert "async/age_2" not in metrics and metrics["async/trainer_idle_s"] >= 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["grpo.async_grpo.enabled=true"], "grpo.old_logprobs=engine or grpo.importance_sampling"),
        (
            ["grpo.async_grpo.enabled=true", "grpo.old_logprobs=engine", "rollout=vllm"],
            "rollout engine needs GPUs of its own (rollout.colocate=false",
        ),
        (
            ["grpo.old_logprobs=engine", "grpo.importance_sampling_cap=2"],
            "with grpo.old_logprobs=engine the ratio is already to the engine",
        ),
        (["grpo.old_logprobs=behaviour"], "grpo.old_logprobs must be trainer|engine"),
    ],
)
def test_settings_async_grpo_cannot_run_with_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        config_lib.load(overrides)
    # Synchronous, or with nothing stale to correct, the same settings load.
    if overrides == ["grpo.async_grpo.enabled=true"]:
        config_lib.load([*overrides, "grpo.async_grpo.max_trajectory_age_steps=0"])
