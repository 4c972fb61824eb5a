"""`nemo-orch launch --executor slurm` against a real slurmctld (the one-node cluster of
``scripts/slurm_local.sh``): NeMo-Run's SlurmExecutor submits through its LocalTunnel, the job
runs GRPO under torchrun with 2 gloo ranks, stops before its time limit and is requeued, and a
cancelled job resumes when launched again. SLURM's own commands (scontrol, scancel) check it."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from support.cli_helpers import ENDED, job_state, run_cli, wait_for

from nemo_orch import cli
from nemo_orch.distributed import free_port

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def recipe_overrides(start: Path, tmp_path: Path, *extra: str) -> list[str]:
    """The micro-cpu-slurm recipe from ``start``, its jobs and runs in ``tmp_path``."""
    return [
        "recipe=micro-cpu-slurm",
        f"launcher.slurm.job_dir={tmp_path / 'jobs'}",
        f"trainer.init_from={start}",
        f"run.output_dir={tmp_path / 'runs'}",
        "model.vocab_size=1024",
        "tokenizer.vocab_size=1000",
        f"launcher.rdzv_port={free_port()}",
        *extra,
    ]


def launch(overrides: list[str]) -> None:
    submitted = run_cli("launch", *overrides)  # a process of its own, as users run it
    assert "launch: submitted SLURM job " in submitted.stdout


def job_of(tmp_path: Path) -> tuple[str, Path]:
    """The id and experiment directory of the last job launched into ``tmp_path``."""
    (record,) = sorted(
        (tmp_path / "jobs").glob("experiments/*/*/nemo_orch_job.json"),
        key=lambda path: path.stat().st_mtime,
    )[-1:]
    return json.loads(record.read_text())["job_id"], record.parent


def steps(stage: Path) -> list[int]:
    metrics = stage / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def attempt_logs(experiment: Path, job_id: str) -> list[str]:
    """The training's log of each attempt of a job, in order."""
    paths = sorted(
        (experiment / "train").glob(f"log-*_{job_id}_*.out"),
        key=lambda path: int(path.stem.rsplit("_", 1)[1]),
    )
    return [path.read_text() for path in paths]


def test_a_job_stops_for_its_time_limit_is_requeued_cancelled_and_resumed(
    slurm_cluster, start_checkpoint, tmp_path, capsys
):
    """One run through everything, to start as few jobs as possible (each attempt takes ~20 s
    to its first step): GRPO for 3 steps under a 1-minute limit; after step 1 the job gets what
    slurmctld sends 30 s before the limit and is requeued; the requeued attempt resumes and is
    cancelled; the same launch again resumes and completes."""
    overrides = recipe_overrides(
        start_checkpoint,
        tmp_path,
        "launcher.slurm.time=00:01:00",
        "launcher.slurm.stop_before_limit_s=30",
        "grpo.max_steps=3",
        "grpo.save_interval=1",
    )
    launch(overrides)
    job_id, experiment = job_of(tmp_path)
    batch = (experiment / "train_sbatch.sh").read_text()
    assert "#SBATCH --signal=USR1@30" in batch and "--container-image" not in batch
    stage = tmp_path / "runs" / "micro-cpu-slurm" / "grpo-offline"
    checkpoints = stage / "checkpoints"

    # Stopped for the time limit after step 1 (the signal sent now: a requeue is certain).
    wait_for(lambda: steps(stage), "the first GRPO step")
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    wait_for(
        lambda: any("resumed GRPO from" in text for text in attempt_logs(experiment, job_id)[1:]),
        "the requeued attempt to resume",
    )
    state = job_state(job_id)
    assert state["TimeLimit"] == "00:01:00" and int(state["Restarts"]) >= 1
    logs = attempt_logs(experiment, job_id)
    (stopped,) = re.findall(r"stopped on request \(SIGUSR1\) after step (\d+)", logs[0])
    assert f"resumed GRPO from {checkpoints}/step_{stopped}" in logs[1]

    # Cancelled: the last checkpoint is intact, and the same launch resumes from it.
    subprocess.run(["scancel", job_id], check=True)
    wait_for(lambda: job_state(job_id)["JobState"] in ENDED, "the cancelled job to end")
    assert job_state(job_id)["JobState"] == "CANCELLED"
    last = max(int(path.name.split("_")[1]) for path in checkpoints.glob("step_*"))
    assert last < 3
    launch(overrides)  # the same command again
    again, experiment = job_of(tmp_path)
    wait_for(lambda: job_state(again)["JobState"] in ENDED, "the second job to end")
    assert job_state(again)["JobState"] == "COMPLETED"
    assert f"resumed GRPO from {checkpoints}/step_{last}" in attempt_logs(experiment, again)[0]
    assert steps(stage) == [1, 2, 3]  # none lost, none repeated
    assert (checkpoints / "step_3").is_dir()

    assert cli.main(["launch", "--status", *overrides]) == 0
    status = capsys.readouterr().out
    assert re.search(rf"JobId\s+{again}\n", status) and re.search(r"JobState\s+COMPLETED", status)
    assert str(experiment / "train" / f"log-micro-cpu-slurm-train_{again}_0.out") in status
    assert cli.main(["launch", "--logs", "--lines", "200", *overrides]) == 0
    assert "grpo: env=offline, steps" in capsys.readouterr().out


def test_grpo_rolls_out_on_a_ray_cluster_started_inside_the_job(
    slurm_cluster, start_checkpoint, tmp_path
):
    """``rollout.backend=ray`` with ``launcher.ray``: the job's script starts the Ray head on
    its node, the first rank waits for it, and GRPO's rollout workers run on it (1 step); the
    head ends with the job."""
    port = free_port()
    overrides = recipe_overrides(
        start_checkpoint,
        tmp_path,
        "grpo.max_steps=1",
        "rollout.backend=ray",
        "rollout.ray.address=auto",
        "rollout.ray.num_workers=1",
        f"launcher.ray={{port: {port}}}",
    )
    launch(overrides)
    job_id, experiment = job_of(tmp_path)
    wait_for(lambda: job_state(job_id)["JobState"] in ENDED, "the job to end")
    (log,) = attempt_logs(experiment, job_id)
    assert job_state(job_id)["JobState"] == "COMPLETED", log[-3000:]
    assert re.search(rf"rollout workers: 1 on the Ray cluster at \S+:{port} ", log)
    assert steps(tmp_path / "runs" / "micro-cpu-slurm" / "grpo-offline") == [1]
    token = experiment.with_name(f"{experiment.name}.ray_auth_token")  # the job's processes'
    # only can use the cluster
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    ray_head = subprocess.run(["pgrep", "-f", "--", f"port={port}"], capture_output=True)
    assert ray_head.returncode == 1, ray_head.stdout  # no process of the head is left
