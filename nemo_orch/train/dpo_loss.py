"""The DPO objective, per pair, on sequence log-probabilities summed over the policy's tokens.

With ``h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r))`` for the chosen ``c`` and the
rejected ``r`` continuation of one prompt:

* ``sigmoid`` (Rafailov et al. 2023): ``-log sigmoid(beta h)``; with ``label_smoothing`` eps the
  conservative form of cDPO, ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``, for
  labels that are wrong with probability eps;
* ``ipo`` (Azar et al. 2023): ``(h - 1 / (2 beta))^2``, which stops pushing once the margin
  reaches its target instead of driving it to infinity on separable pairs.

Log-probabilities are sums over each side's loss mask (the tokens the policy wrote; prompt,
observations and padding are context), as in the DPO paper; TRL's IPO averages them per token
instead. Micro-batches hold a pair's two sides in adjacent rows (chosen at 2i, rejected at
2i + 1) and ``ref_logprob_sums`` [b], the frozen reference's sums for the same rows. The loss is
a mean over the pairs of the global batch: :class:`~nemo_orch.train.policy.Policy` divides the
summed loss by the summed count, here the number of pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_orch.config import DPOConfig
from nemo_orch.train.policy import Batch, TokenLoss, TokenLossFn


def preference_losses(
    chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, config: DPOConfig
) -> torch.Tensor:
    """Per-pair loss from the log-ratios log pi - log ref of each side's sequence."""
    margin = chosen_logratios - rejected_logratios
    if config.loss_type == "ipo":
        return (margin - 1 / (2 * config.beta)) ** 2
    smoothing = config.label_smoothing
    return -(1 - smoothing) * F.logsigmoid(config.beta * margin) - smoothing * F.logsigmoid(
        -config.beta * margin
    )


def sequence_logprobs(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[b]: each row's label log-probabilities [b, s] summed over its loss mask."""
    return (logprobs.float() * loss_mask).sum(dim=-1)


def dpo_token_loss(config: DPOConfig) -> TokenLossFn:
    """The loss function for :meth:`Policy.train_step`. Its metrics are means over the global
    batch's pairs: ``rewards/chosen`` and ``rewards/rejected`` (the implicit rewards
    beta (log pi - log ref)), ``rewards/margins`` (their difference), ``rewards/accuracies``
    (the share of pairs whose chosen reward is the higher) and ``logps/chosen``,
    ``logps/rejected`` (the policy's sequence log-probabilities: DPO can raise the margin while
    both fall)."""

    def token_loss(token_losses: torch.Tensor, batch: Batch) -> TokenLoss:
        logprobs = sequence_logprobs(-token_losses, batch["loss_mask"])
        logratios = logprobs - batch["ref_logprob_sums"]
        chosen, rejected = logratios[0::2], logratios[1::2]
        losses = preference_losses(chosen, rejected, config)
        with torch.no_grad():
            chosen_rewards, rejected_rewards = config.beta * chosen, config.beta * rejected
            per_pair = {
                "rewards/chosen": chosen_rewards,
                "rewards/rejected": rejected_rewards,
                "rewards/margins": chosen_rewards - rejected_rewards,
                "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
                "logps/chosen": logprobs[0::2],
                "logps/rejected": logprobs[1::2],
            }
            sums = {key: value.detach().sum() for key, value in per_pair.items()}
        return TokenLoss(
            losses.sum(), torch.tensor(len(losses), dtype=torch.int, device=losses.device), sums
        )

    return token_loss
