"""``trainer.optim`` and ``grpo.optim``: the optimizer and learning-rate schedule of a stage."""

from __future__ import annotations

from dataclasses import dataclass

from nemo_orch.config.base import _require


@dataclass
class OptimizerConfig:
    """Adam with decoupled weight decay, gradient clipping at ``grad_clip`` (global norm), and
    a learning rate warmed up linearly from 0 to ``lr`` over ``warmup_steps``, then cosine-decayed
    to ``min_lr`` over the stage's optimizer steps. Each training stage has its own (SFT's
    ``trainer.optim``, GRPO's ``grpo.optim``); :meth:`check` validates it under its section's
    name."""

    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 10
    # Adam's decoupled weight decay.
    weight_decay: float = 0.01
    # Adam's first-moment decay.
    adam_beta1: float = 0.9
    # Adam's second-moment decay.
    adam_beta2: float = 0.95
    grad_clip: float = 1.0

    def check(self, section: str) -> None:
        _require(
            self.lr > 0 and 0 <= self.min_lr <= self.lr,
            f"{section}.lr must be > 0 and 0 <= {section}.min_lr <= {section}.lr",
        )
        _require(self.warmup_steps >= 0, f"{section}.warmup_steps must be >= 0")
        _require(
            self.weight_decay >= 0 and self.grad_clip > 0,
            f"{section}.weight_decay must be >= 0 and {section}.grad_clip > 0",
        )
        _require(
            0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
            f"{section}.adam_beta1 and adam_beta2 must be in [0, 1)",
        )
