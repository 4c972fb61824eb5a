"""``run.*``: the run's identity and where its outputs go."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from nemo_orch.config.base import _require


@dataclass
class RunConfig:
    """Run identity: outputs go to ``output_dir/name``.

    ``wandb_project`` (null: off) also logs the training metrics to Weights & Biases, from the
    logging rank. ``wandb_mode``: ``offline`` writes under the run directory (upload later with
    ``wandb sync``); ``online`` streams, with the key from ``WANDB_API_KEY`` in the environment
    (never in the config).
    """

    # The run's name: its outputs go to output_dir/name.
    name: str = "tiny-sft"
    # Seeds data, initialization, sampling and tools: a seed gives the same run.
    seed: int = 1234
    output_dir: str = "runs"
    wandb_project: Optional[str] = None
    wandb_mode: str = "offline"

    def __post_init__(self) -> None:
        _require(
            self.wandb_mode in ("online", "offline"),
            f"run.wandb_mode must be online|offline, got {self.wandb_mode!r}",
        )

    @property
    def dir(self) -> Path:
        return Path(self.output_dir) / self.name
