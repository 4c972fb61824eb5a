"""SFT end to end through the command line: learning, outputs, exact resume after a kill."""

import signal

import pytest
from support.cli_helpers import read_metrics, run_cli, small_sft_overrides

from nemo_orch.faults import ENV as KILL_AT


@pytest.fixture(scope="module")
def straight_run(tiny_tokenizer_dir, tmp_path_factory):
    """Six steps without interruption, checkpoints every three."""
    out = tmp_path_factory.mktemp("runs")
    run_cli(
        "sft",
        *small_sft_overrides(tiny_tokenizer_dir, out, "straight"),
        "trainer.max_steps=6",
        "trainer.save_interval=3",
    )
    return out / "straight"


def test_sft_learns_and_writes_its_outputs(straight_run):
    metrics = read_metrics(straight_run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.5
    assert all(m["loss_tokens"] > 0 and m["tokens_per_s"] > 0 for m in metrics)
    assert list((straight_run / "tensorboard").glob("events.out.tfevents.*"))
    for step in (3, 6):
        checkpoint = straight_run / "checkpoints" / f"step_{step}"
        assert (checkpoint / "nemo_orch.json").exists() and (checkpoint / "config.yaml").exists()
        assert (checkpoint / "tokenizer" / "tokenizer.json").exists()
    assert not list((straight_run / "checkpoints").glob(".*partial"))


def test_sft_says_what_it_did(tiny_tokenizer_dir, tmp_path):
    result = run_cli(
        "sft", *small_sft_overrides(tiny_tokenizer_dir, tmp_path, "said"), "trainer.max_steps=2"
    )
    assert "steps 1-2" in result.stdout and "checkpoint" in result.stdout
    again = run_cli(
        "sft",
        *small_sft_overrides(tiny_tokenizer_dir, tmp_path, "said"),
        "trainer.max_steps=2",
        "trainer.resume=true",
    )
    assert "already complete at step 2" in again.stdout


@pytest.mark.parametrize(
    "kill_at", ["step:5", "save:6"], ids=["killed-mid-training", "killed-mid-save"]
)
def test_resume_after_kill_reproduces_the_straight_run(
    straight_run, tiny_tokenizer_dir, tmp_path, kill_at
):
    args = [
        "sft",
        *small_sft_overrides(tiny_tokenizer_dir, tmp_path, "killed"),
        "trainer.max_steps=6",
        "trainer.save_interval=3",
    ]
    killed = run_cli(*args, env={KILL_AT: kill_at}, expect=None)
    assert killed.returncode == -signal.SIGKILL
    checkpoints = tmp_path / "killed" / "checkpoints"
    assert (checkpoints / "step_3" / "nemo_orch.json").exists()
    assert not (checkpoints / "step_6").exists()  # a save cut short is never complete
    run_cli(*args, "trainer.resume=true")
    assert _training_record(tmp_path / "killed") == _training_record(straight_run)


def _training_record(run_dir):
    """Per-step values that must be identical (everything but wall-clock speed)."""
    return [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in read_metrics(run_dir)]


def test_existing_run_is_not_overwritten_without_resume(straight_run, tiny_tokenizer_dir):
    result = run_cli(
        "sft",
        *small_sft_overrides(tiny_tokenizer_dir, straight_run.parent, "straight"),
        "trainer.max_steps=6",
        expect=2,
    )
    assert "trainer.resume=true" in result.stderr and "Traceback" not in result.stderr
