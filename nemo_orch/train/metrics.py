"""Training metrics: ``metrics.jsonl`` (one record per step), TensorBoard, and a progress bar."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm import tqdm


class MetricsLogger:
    """Writes on the logging rank only; a resumed run first drops records past its checkpoint,
    so the log never holds a step twice."""

    def __init__(self, run_dir: Path, *, enabled: bool, start_step: int, max_steps: int) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._writer = None
        self._bar = None
        self._last_time = time.perf_counter()
        self.tokens_per_s: list[float] = []
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)
        self._bar = tqdm(total=max_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

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
        for key, value in metrics.items():
            self._writer.add_scalar(f"train/{key}", value, step)
        self._bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.4f}",
                              tok_s=f"{metrics.get('tokens_per_s', 0):.0f}")
        self._bar.update(1)

    def close(self) -> None:
        if self.enabled:
            self._writer.close()
            self._bar.close()
