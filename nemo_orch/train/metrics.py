"""Training metrics: ``metrics.jsonl`` (one record per step), TensorBoard, a progress bar, and
optionally Weights & Biases."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"
TRAINED_FILE = "trained.jsonl"


def truncate_after(path: Path, step: int) -> None:
    """Drop the records past ``step`` of a per-step JSONL file (what a resumed run redoes)."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= step
    ]
    path.write_text("".join(line + "\n" for line in kept))


class TrainedLog:
    """``trained.jsonl``: per RL step, the ids of the samples trained on and of the groups
    dropped as too old for the trainer (asynchronous GRPO). A resumed run first drops the steps
    past its checkpoint, as the metrics do, so the file shows what the final weights learned
    from: each sample once."""

    def __init__(self, run_dir: Path, start_step: int, *, enabled: bool) -> None:
        self.path, self.enabled = run_dir / TRAINED_FILE, enabled
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            truncate_after(self.path, start_step)

    def add(self, step: int, samples: list[str], dropped_groups: list[str]) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(
                    json.dumps({"step": step, "samples": samples, "dropped_groups": dropped_groups})
                    + "\n"
                )


class MetricsLogger:
    """Writes on the logging rank only; a resumed run first drops records past its checkpoint,
    so the log never holds a step twice.

    With ``wandb_project`` set, every step also goes to a W&B run whose files live under
    ``run_dir/wandb`` (``wandb_mode``: ``offline``, synced later with ``wandb sync``, or
    ``online``, with the key from ``WANDB_API_KEY``). The progress bar is named ``stage`` and
    shows the ``shown`` metrics of the last step and its tokens/s."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        start_step: int,
        max_steps: int,
        stage: str | None = None,
        shown: tuple[str, ...] = ("loss",),
        wandb_project: str | None = None,
        wandb_mode: str = "offline",
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.enabled, self.shown = enabled, shown
        self.path = run_dir / METRICS_FILE
        self._writer = None
        self._bar = None
        self._wandb = None
        self._last_time = time.perf_counter()
        self.tokens_per_s: list[float] = []
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if wandb_project is not None:
            # First, so a missing package fails before anything else is opened.
            self._wandb = _start_wandb(
                run_dir, project=wandb_project, mode=wandb_mode, name=run_name, config=config
            )
        truncate_after(self.path, start_step)
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(
            log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1
        )
        self._bar = tqdm(
            total=max_steps, initial=start_step, unit="step", dynamic_ncols=True, desc=stage
        )

    @classmethod
    def for_stage(
        cls,
        config: Any,
        stage: str,
        *,
        enabled: bool,
        start_step: int,
        max_steps: int,
        shown: tuple[str, ...] = ("loss",),
    ) -> MetricsLogger:
        """The logger of a training stage (``stage``: sft, grpo, dpo): its run directory and
        ``run.*`` W&B settings, with the resolved config on the W&B run."""
        run = config.run
        return cls(
            run.dir,
            enabled=enabled,
            start_step=start_step,
            max_steps=max_steps,
            stage=stage,
            shown=shown,
            wandb_project=run.wandb_project,
            wandb_mode=run.wandb_mode,
            run_name=run.name,
            config=dataclasses.asdict(config),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step; ``tokens`` (processed, padding included) also yields tokens/s since
        the last call."""
        now = time.perf_counter()
        elapsed, self._last_time = now - self._last_time, now
        if "tokens" in metrics:
            metrics = {**metrics, "tokens_per_s": metrics["tokens"] / max(elapsed, 1e-9)}
            self.tokens_per_s.append(metrics["tokens_per_s"])
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        scalars = {f"train/{key}": value for key, value in metrics.items()}
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        self._bar.set_postfix(
            {
                **{key: f"{metrics[key]:.4f}" for key in self.shown if key in metrics},
                "tok_s": f"{metrics.get('tokens_per_s', 0):.0f}",
            }
        )
        self._bar.update(1)

    def close(self) -> None:
        if self.enabled:
            self._writer.close()
            self._bar.close()
            if self._wandb is not None:
                self._wandb.finish()


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id of a run directory: the same directory always maps to the same id, so a
    resumed run continues its W&B run rather than starting another."""
    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]


def _start_wandb(
    run_dir: Path, *, project: str, mode: str, name: str | None, config: dict[str, Any] | None
):
    try:
        import wandb  # optional dependency: only runs that set run.wandb_project need it
    except ImportError:
        raise ImportError(
            "run.wandb_project is set but the wandb package is not installed: "
            "pip install -r requirements.txt (or pip install wandb)"
        ) from None
    return wandb.init(
        project=project,
        name=name,
        dir=str(run_dir),
        mode=mode,
        config=config,
        id=wandb_run_id(run_dir),
        resume="allow",
    )


def logged_steps(run_dir: Path, through_step: int) -> list[dict[str, Any]]:
    """The records of steps 1..``through_step`` in a run's ``metrics.jsonl`` ({} where a step
    is missing): what a resumed stage reads back of the steps before it."""
    records: list[dict[str, Any]] = [{} for _ in range(through_step)]
    metrics_path = run_dir / METRICS_FILE
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            if 1 <= record.get("step", 0) <= through_step:
                records[record["step"] - 1] = record
    return records


class IdleClock:
    """Seconds during which nothing was busy (``busy(+1)`` / ``busy(-1)`` bracket the work),
    handed out since the last :meth:`take`."""

    def __init__(self) -> None:
        self.running, self.since, self.idle = 0, time.perf_counter(), 0.0

    def busy(self, change: int) -> None:
        now = time.perf_counter()
        if self.running == 0:
            self.idle += now - self.since
        self.running += change
        self.since = now

    def take(self) -> float:
        self.busy(0)
        idle, self.idle = self.idle, 0.0
        return idle
