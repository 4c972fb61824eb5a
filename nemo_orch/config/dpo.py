"""``dpo.*``: direct preference optimization from a checkpoint (``nemo-orch dpo``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from nemo_orch.config.base import _require, _require_file
from nemo_orch.config.optim import OptimizerConfig

DPO_LOSSES = ("sigmoid", "ipo")


@dataclass
class DPOConfig:
    """DPO on preference pairs, against the frozen starting policy (``trainer.init_from``).

    Pairs come from ``pairs_path`` (the format of :mod:`nemo_orch.data.pairs`), or, when it is
    null, from the starting policy's own rollouts on ``env``: ``tasks`` training tasks, each
    rolled out ``rollout.group_size`` times and scored by ``reward.*``; a task gives a pair
    when its best and worst episodes' rewards differ by ``min_margin`` or more (written to
    ``<run>/dpo/pairs.jsonl``). ``loss_type``: ``sigmoid`` (DPO; ``label_smoothing`` > 0 is
    cDPO's for noisy labels) or ``ipo``; ``beta`` scales the implicit reward (higher: stay
    closer to the reference). Each step trains on ``global_batch_size`` pairs, in micro-batches
    of ``micro_batch_size`` pairs (two sequences each), read in seeded epochs.
    """

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    pairs_path: Optional[str] = None
    tasks: int = 256
    min_margin: float = 0.1
    # DPO's optimizer steps.
    max_steps: int = 50
    micro_batch_size: int = 4
    global_batch_size: int = 16
    # A constant learning rate 12.5x below GRPO's: the loss moves every policy token, with no
    # clip; on the main job 5e-4 broke the call format (docs/dpo.md).
    optim: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=2e-5, min_lr=2e-5, warmup_steps=0)
    )
    # Save a checkpoint every this many steps (and at the last).
    save_interval: int = 25

    def __post_init__(self) -> None:
        _require(self.beta > 0, "dpo.beta must be > 0")
        _require(
            self.loss_type in DPO_LOSSES,
            f"dpo.loss_type must be {'|'.join(DPO_LOSSES)}, got {self.loss_type!r}",
        )
        _require(0 <= self.label_smoothing < 0.5, "dpo.label_smoothing must be in [0, 0.5)")
        _require(
            self.loss_type == "sigmoid" or self.label_smoothing == 0,
            "dpo.label_smoothing applies to loss_type=sigmoid only",
        )
        _require_file(self.pairs_path, "dpo.pairs_path")
        # A pair needs a preference: equal rewards are none.
        _require(self.min_margin > 0, "dpo.min_margin must be > 0")
        for name in ("tasks", "max_steps", "micro_batch_size", "save_interval"):
            _require(getattr(self, name) >= 1, f"dpo.{name} must be >= 1")
        _require(
            self.global_batch_size % self.micro_batch_size == 0,
            "dpo.global_batch_size must be a multiple of dpo.micro_batch_size",
        )
        self.optim.check("dpo.optim")
