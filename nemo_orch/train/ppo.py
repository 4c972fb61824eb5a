"""PPO's side of the RL stage (``grpo.algo=ppo``): the critic's start and checkpoints, GAE over
the tokens the policy wrote, whitening, and the clipped value loss. The rollouts, the policy
loss and the update loop are GRPO's (:mod:`nemo_orch.train.grpo`).

A micro-batch's tensors are aligned with its labels: position ``i`` holds label ``i`` (the token
written after input ``i``), whether the policy wrote it (``loss_mask``), and the critic's value
of the state before it (``values``). The trajectory's reward sits on its last policy token
(``rewards``, see :func:`~nemo_orch.train.grpo_samples.micro_batches`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_orch.config import Config, ConfigError, PPOConfig
from nemo_orch.distributed import ParallelContext
from nemo_orch.models import checkpoint
from nemo_orch.train.policy import (
    Batch,
    Critic,
    TokenLoss,
    TokenLossFn,
    load_start_weights,
    start_architecture,
)

log = logging.getLogger(__name__)

CRITIC_DIR = "critic"  # <run>/critic/step_<N>: the critic's checkpoints, saved with the policy's
WHITEN_EPS = 1e-8


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimates and returns, [b, s], over the positions ``mask`` sets.

    The recursion runs over those positions alone, in order: a masked position (an observation
    token) is skipped, not zeroed: the next policy token's value and advantage are carried back
    across it, so A_k = delta_k + gamma lam A_{k+1} and delta_k = r_k + gamma V_{k+1} - V_k with
    k, k + 1 consecutive policy tokens, and V = 0 after the last. Masked positions get 0 (their
    rewards must be 0: a trajectory's rewards sit on its policy tokens)."""
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for position in reversed(range(rewards.shape[1])):
        written = mask[:, position] > 0
        delta = rewards[:, position] + gamma * next_value - values[:, position]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, position] = torch.where(written, advantage, 0.0)
        next_value = torch.where(written, values[:, position], next_value)
        next_advantage = torch.where(written, advantage, next_advantage)
    return advantages, (advantages + values) * mask


def global_moments(
    tensors: list[torch.Tensor], masks: list[torch.Tensor]
) -> tuple[float, float, float]:
    """Mean, variance and count of the masked entries of ``tensors`` over every rank's (a
    collective: ranks without any pass empty lists; a tensor-parallel group's ranks hold the
    same entries, which leaves the mean and variance as they are)."""
    sums = torch.zeros(3, dtype=torch.float64)
    for tensor, mask in zip(tensors, masks, strict=True):
        mask = mask.double()
        tensor = tensor.double() * mask
        sums += torch.stack([mask.sum(), tensor.sum(), (tensor * tensor).sum()])
    if dist.is_initialized():
        dist.all_reduce(sums)
    count, total, squares = sums.tolist()
    if count == 0:
        return 0.0, 1.0, 0.0
    mean = total / count
    return mean, max(squares / count - mean * mean, 0.0), count


def whiten(tensors: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zero mean and unit variance over the masked entries of every rank's ``tensors`` (a
    collective), masked entries 0."""
    mean, variance, _ = global_moments(tensors, masks)
    scale = (variance + WHITEN_EPS) ** -0.5
    return [(tensor - mean) * scale * mask for tensor, mask in zip(tensors, masks)]


class ReturnStatistics:
    """The running mean and variance of the returns the critic is trained on, in its value
    head's buffers (saved with its checkpoints; on the last pipeline stage, the same on every
    rank there): with ``grpo.ppo.whiten_values`` the critic predicts ``(return - mean) / std``."""

    def __init__(self, critic: Critic, enabled: bool) -> None:
        self.head = critic.head if enabled else None

    def scale(self) -> tuple[float, float]:
        """(mean, std) to de-normalize values with: (0, 1) when values are not normalized."""
        if self.head is None:
            return 0.0, 1.0
        return float(self.head.return_mean), float(self.head.return_var) ** 0.5

    def update(self, mean: float, variance: float, count: float) -> None:
        """Fold in a batch's moments (Chan et al.'s parallel combination)."""
        if self.head is None or count == 0:
            return
        head = self.head
        seen = float(head.return_count)
        total = seen + count
        delta = mean - float(head.return_mean)
        combined = (
            float(head.return_var) * seen + variance * count + delta * delta * seen * count / total
        ) / total
        head.return_count.fill_(total)
        head.return_mean.fill_(float(head.return_mean) + delta * count / total)
        head.return_var.fill_(max(combined, WHITEN_EPS))


def attach_advantages(
    minis: list[list[Batch]], critic: Critic, ppo: PPOConfig, kl_coef: float
) -> dict[str, float]:
    """PPO's advantages and value targets into every micro-batch (a collective: every rank
    calls it with its micro-batches; those of the last pipeline stage carry ``values`` from the
    critic's forward pass, and ``reward_kl`` with ``use_kl_in_reward``).

    Per-token rewards (the trajectory's reward on its last policy token, minus ``kl_coef`` times
    the KL on every policy token), GAE on de-normalized values, advantages whitened over the
    global batch; then the return statistics take the batch's returns, and the critic's targets
    (``returns``) and old values (``old_values``, for the value clip) are normalized by them.
    Returns the step's ``critic/*`` metrics (before normalization)."""
    batches = [batch for mini in minis for batch in mini if "values" in batch]
    statistics = ReturnStatistics(critic, ppo.whiten_values)
    mean, std = statistics.scale()
    advantages, returns, values = [], [], []
    for batch in batches:
        mask = batch["loss_mask"]
        rewards = batch["rewards"]
        if "reward_kl" in batch:
            rewards = rewards - kl_coef * batch["reward_kl"] * mask
        value = batch.pop("values") * std + mean
        advantage, target = gae(rewards, value, mask, ppo.gamma, ppo.lam)
        advantages.append(advantage)
        returns.append(target)
        values.append(value)
    masks = [batch["loss_mask"] for batch in batches]
    metrics = {
        "critic/advantage_mean": global_moments(advantages, masks)[0],
        "critic/value_mean": global_moments(values, masks)[0],
    }
    return_mean, return_variance, count = global_moments(returns, masks)
    metrics.update({"critic/return_mean": return_mean, "critic/return_std": return_variance**0.5})
    if ppo.whiten_advantages:
        advantages = whiten(advantages, masks)
    statistics.update(return_mean, return_variance, count)
    mean, std = statistics.scale()
    for batch, advantage, target, value in zip(batches, advantages, returns, values):
        mask = batch["loss_mask"]
        # Only the routing decisions with grpo.advantage_tokens=decisions (the advantage mask).
        batch["advantages"] = advantage * batch["advantage_mask"]
        batch["returns"] = (target - mean) / std * mask
        batch["old_values"] = (value - mean) / std * mask
    return metrics


def value_loss(ppo: PPOConfig) -> TokenLossFn:
    """The critic's loss for :meth:`Critic.train_step`: 0.5 (V - R)^2 per policy token,
    the larger of it and its clipped twin (V clipped to ``value_clip`` around the old values)
    with ``value_clip``, token-mean over the global batch. Metrics ``critic/value_loss``,
    ``critic/clip_frac`` (where the clipped twin was the larger) and ``critic/squared_error``
    ((V - R)^2, unclipped), in the normalized units of the targets."""

    def token_loss(values: torch.Tensor, batch: Batch) -> TokenLoss:
        mask = batch["loss_mask"].float()
        values = values.float()
        error = 0.5 * (values - batch["returns"]) ** 2
        loss, clipped_more = error, torch.zeros_like(error)
        if ppo.value_clip is not None:
            old = batch["old_values"]
            clipped = old + (values - old).clamp(-ppo.value_clip, ppo.value_clip)
            clipped_error = 0.5 * (clipped - batch["returns"]) ** 2
            loss = torch.maximum(error, clipped_error)
            clipped_more = (clipped_error > error).float()
        sums = {
            "critic/value_loss": (loss.detach() * mask).sum(),
            "critic/clip_frac": (clipped_more * mask).sum(),
            "critic/squared_error": (2 * error.detach() * mask).sum(),
        }
        return TokenLoss((loss * mask).sum(), mask.sum().to(torch.int), sums)

    return token_loss


# ----------------------------------------------------------------------------- the critic


def critic_dir(config: Config) -> Path:
    return config.run.dir / CRITIC_DIR


def critic_config(config: Config) -> Config:
    """The config the critic is built from: the policy's (``grpo.policy_config``) with the
    optimizer of ``grpo.ppo.critic_optim``."""
    trainer = dataclasses.replace(config.trainer, optim=config.grpo.ppo.critic_optim)
    return dataclasses.replace(config, trainer=trainer)


def start_critic(config: Config, context: ParallelContext, resumed_step: int | None) -> Critic:
    """The critic: resumed from its checkpoint of ``resumed_step`` (the policy's), else from
    ``grpo.ppo.critic_init_from`` (a critic checkpoint of the policy's architecture), else the
    trunk of ``trainer.init_from`` with a zero value head."""
    critic = Critic(critic_config(config), context)
    init_from = config.grpo.ppo.critic_init_from
    if resumed_step is not None:
        path = critic_dir(config) / f"step_{resumed_step}"
        if not path.is_dir():
            raise checkpoint.CheckpointError(
                f"{path}: the critic's checkpoint of step {resumed_step}, where the policy "
                "resumes, is missing"
            )
        checkpoint.load(
            checkpoint.open_checkpoint(path), critic.module, critic.optimizer, critic.scheduler
        )
        log.info("resumed the critic from %s", path)
    elif init_from is not None:
        differs = {
            name: (value, getattr(config.model, name))
            for name, value in start_architecture(Path(init_from), config.model).items()
            if getattr(config.model, name) != value
        }
        if differs:
            raise ConfigError(
                f"grpo.ppo.critic_init_from={init_from}: its architecture differs "
                "from the policy's (checkpoint vs policy: "
                + "; ".join(f"{name} {saved} vs {own}" for name, (saved, own) in differs.items())
                + ")"
            )
        checkpoint.load(checkpoint.open_checkpoint(init_from), critic.module)
    else:
        load_start_weights(
            critic.module, config.model, Path(config.trainer.init_from), skip=Critic.HEAD
        )
    critic.optimizer.reload_model_params()
    return critic


def save_critic(config: Config, step: int, critic: Critic) -> Path:
    """The critic's checkpoint of ``step``, saved before the policy's (whose manifest marks the
    step complete: a run resumed from it finds the critic's)."""
    return checkpoint.save(
        critic_config(config),
        step,
        critic.module,
        critic.optimizer,
        critic.scheduler,
        directory=critic_dir(config),
    )
