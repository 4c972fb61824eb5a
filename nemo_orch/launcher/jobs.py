"""A submitted SLURM training job, seen from the login node: ``nemo-orch launch --status`` and
``--logs``.

``nemo-orch launch --executor slurm`` records the job beside NeMo-Run's files
(:data:`RECORD`, in the experiment's directory). The state comes from ``scontrol show job``,
which knows pending and running jobs and, for ``MinJobAge`` after they end, finished ones;
past that, from ``sacct`` where the cluster keeps accounting. The logs are the training
component's: one file per attempt (``log-<job name>_<job id>_<restart count>.out``; a job
requeued before its time limit has several), and the batch script's own
(``sbatch_<job name>_<job id>.out``).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from nemo_orch.config import Config, ConfigError

RECORD = "nemo_orch_job.json"
# What ``--status`` shows of ``scontrol show job``, in this order.
_FIELDS = (
    "JobId",
    "JobName",
    "JobState",
    "Reason",
    "ExitCode",
    "Restarts",
    "RunTime",
    "TimeLimit",
    "SubmitTime",
    "StartTime",
    "EndTime",
    "NodeList",
)


@dataclass(frozen=True)
class SubmittedJob:
    """A training job as ``launch`` recorded it: its SLURM id and experiment directory."""

    job_id: str
    experiment_dir: Path

    def save(self) -> None:
        (self.experiment_dir / RECORD).write_text(json.dumps({"job_id": self.job_id}) + "\n")

    def state(self) -> dict[str, str]:
        """``scontrol show job``'s fields (``sacct``'s where it no longer knows the job)."""
        shown = subprocess.run(
            ["scontrol", "show", "job", "-o", self.job_id], capture_output=True, text=True
        )
        if shown.returncode == 0 and shown.stdout.strip():
            # A heterogeneous job has a line per component: the training is the first.
            return _key_values(shown.stdout.splitlines()[0])
        accounted = subprocess.run(
            [
                "sacct",
                "-n",
                "-P",
                "-X",
                "-j",
                self.job_id,
                "--format=JobID,JobName,State,ExitCode,Elapsed,Timelimit,Submit,Start,End,NodeList",
            ],
            capture_output=True,
            text=True,
        )
        rows = [line.split("|") for line in accounted.stdout.splitlines() if line.strip()]
        if accounted.returncode != 0 or not rows:
            raise ConfigError(
                f"SLURM knows no job {self.job_id} any more (scontrol: "
                f"{shown.stderr.strip() or 'no record'}; sacct: "
                f"{accounted.stderr.strip() or 'no record'})"
            )
        names = (
            "JobId",
            "JobName",
            "JobState",
            "ExitCode",
            "RunTime",
            "TimeLimit",
            "SubmitTime",
            "StartTime",
            "EndTime",
            "NodeList",
        )
        return dict(zip(names, rows[-1]))

    def logs(self) -> list[Path]:
        """The batch script's log, then the training's, one per attempt in order."""
        train = self.experiment_dir / "train"
        attempts = sorted(
            train.glob(f"log-*_{self.job_id}_*.out"),
            key=lambda path: int(path.stem.rsplit("_", 1)[1]),
        )
        return [*sorted(train.glob(f"sbatch_*_{self.job_id}.out")), *attempts]


def _key_values(text: str) -> dict[str, str]:
    fields = {}
    for item in text.split():
        key, separator, value = item.partition("=")
        if separator:
            fields[key] = value
    return fields


def latest(config: Config) -> SubmittedJob:
    """The last job launched for ``run.name`` under ``launcher.slurm.job_dir``."""
    if config.launcher.slurm.job_dir is None:
        raise ConfigError("launcher.slurm.job_dir is not set: where the jobs were launched")
    runs = Path(config.launcher.slurm.job_dir) / "experiments" / config.run.name
    records = sorted(runs.glob(f"*/{RECORD}"), key=lambda path: path.stat().st_mtime)
    if not records:
        raise ConfigError(f"no job launched for run.name={config.run.name} under {runs}")
    record = records[-1]
    return SubmittedJob(json.loads(record.read_text())["job_id"], record.parent)


def status_lines(job: SubmittedJob) -> list[str]:
    state = job.state()
    lines = [f"{field:<11} {state[field]}" for field in _FIELDS if field in state]
    lines.append(f"{'Experiment':<11} {job.experiment_dir}")
    lines += [f"{'Log':<11} {path}" for path in job.logs()]
    return lines


def log_text(job: SubmittedJob, lines: int) -> str:
    """The last ``lines`` lines of each of the job's logs, each under its name."""
    parts = []
    for path in job.logs():
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append("\n".join([f"==> {path} <==", *tail]))
    if not parts:
        return f"no log yet in {job.experiment_dir / 'train'} (the job may still be pending)"
    return "\n\n".join(parts)
