"""GRPO through the training endpoint (``rollout.agent=external``, docs/agent_loops.md): the
offline world's episodes run by the ``openai``-SDK example loop for two steps (metrics written,
checkpoints saved), then the same run resumed for a third step with the OpenAI Agents SDK's
``Runner`` driving the episodes."""

from __future__ import annotations

from pathlib import Path

from support.cli_helpers import grpo_overrides, grpo_stage, read_metrics, run_cli

LOOPS = Path(__file__).resolve().parents[2] / "examples" / "agent_loops"


def test_grpo_trains_an_openai_sdk_loop_and_resumes_with_an_agents_sdk_loop(
    start_checkpoint, tmp_path
):
    def grpo(loop: str, steps: int) -> list[dict]:
        run_cli(
            "grpo",
            *grpo_overrides(
                start_checkpoint,
                tmp_path,
                "env=offline",
                "rollout.agent=external",
                f"rollout.external.harness={LOOPS / loop}:run_episode",
                f"grpo.max_steps={steps}",
                "grpo.save_interval=1",
            ),
        )
        return read_metrics(grpo_stage(tmp_path))

    first = grpo("openai_loop.py", 2)
    assert [m["step"] for m in first] == [1, 2]
    stage = grpo_stage(tmp_path)
    assert (stage / "checkpoints" / "step_2").is_dir()
    assert (stage / "agent_endpoint.json").is_file()
    resumed = grpo("openai_agents_loop.py", 3)
    assert [m["step"] for m in resumed] == [1, 2, 3]
    assert resumed[:2] == first  # steps 1-2 read back, not run again
    for step in resumed:
        # Every episode was run by the loop, none failed or was abandoned.
        assert step["turns"] >= 1 and step["masked/episodes"] == 0
