"""``trainer.*``: the SFT loop and its optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from nemo_orch.config.base import _require, _require_file
from nemo_orch.config.optim import OptimizerConfig


@dataclass
class TrainerConfig:
    """The SFT stage (``nemo-orch sft``, the main job's SFT): its steps, batches, optimizer and
    checkpoints."""

    # SFT's optimizer steps.
    max_steps: int = 250
    # Conversations per forward/backward pass.
    micro_batch_size: int = 16
    # Conversations per optimizer step, over all data-parallel ranks.
    global_batch_size: int = 16
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    # Save a checkpoint every this many steps (and at the last).
    save_interval: int = 200
    # Continue from the stage's latest complete checkpoint, if any.
    resume: bool = False
    # The checkpoint the stage's weights start from (`step_N`, or one `nemo-orch import` wrote);
    # null: a random initialization.
    init_from: Optional[str] = None
    # torch's intra-op threads per rank (0: this machine's CPUs over its ranks).
    num_threads: int = 0

    def __post_init__(self) -> None:
        _require(self.max_steps >= 1, "trainer.max_steps must be >= 1")
        _require(self.micro_batch_size >= 1, "trainer.micro_batch_size must be >= 1")
        _require(
            self.global_batch_size % self.micro_batch_size == 0,
            "trainer.global_batch_size must be a multiple of trainer.micro_batch_size",
        )
        self.optim.check("trainer.optim")
        _require(self.save_interval >= 1, "trainer.save_interval must be >= 1")
        _require(
            self.num_threads >= 0,
            "trainer.num_threads must be >= 0 (0: this machine's CPUs over its ranks)",
        )
        _require_file(self.init_from, "trainer.init_from")
