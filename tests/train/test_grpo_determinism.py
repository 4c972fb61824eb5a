"""A seed gives the same GRPO run: the offline world bills time from its models, episodes sample
with their own seeds, so two runs from one checkpoint log the same metrics and save the same
weights. (Not the same checkpoint bytes: the distributed optimizer's buffers leave their alignment
padding uninitialized.)"""

from __future__ import annotations

import torch
from support.cli_helpers import grpo_overrides, grpo_stage, read_metrics, run_cli

from nemo_orch.models.checkpoint import ModelTensors, open_checkpoint


def _run(start, out):
    run_cli("grpo", *grpo_overrides(start, out, "rollout.group_size=4"))
    stage = grpo_stage(out)
    # What is about time is measured (wall-clock) and differs run to run, and so does the
    # engine's logprob gap in its last bits: the engine batches the turns that are waiting, and
    # which are depends on when episodes come back (padding rounds the logits in their last bits).
    # Nothing else may differ.
    metrics = [
        {
            key: value
            for key, value in step.items()
            if not key.startswith("time/")
            and key not in ("tokens_per_s", "engine_logprob_abs_diff")
        }
        for step in read_metrics(stage)
    ]
    weights = ModelTensors(open_checkpoint(stage / "checkpoints" / "step_2"))
    return metrics, weights.tensors(weights.names)


def test_a_seed_gives_the_same_metrics_and_weights(start_checkpoint, tmp_path):
    first_metrics, first_weights = _run(start_checkpoint, tmp_path / "first")
    second_metrics, second_weights = _run(start_checkpoint, tmp_path / "second")
    assert [m["step"] for m in first_metrics] == [1, 2]
    assert first_metrics == second_metrics
    assert first_weights.keys() == second_weights.keys()
    assert all(torch.equal(first_weights[name], second_weights[name]) for name in first_weights)
