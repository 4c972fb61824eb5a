"""The GRPO objective, per token: a PPO-style clipped surrogate plus a KL penalty to a frozen
reference, token-mean aggregated over the global batch by :class:`~nemo_orch.train.policy.Policy`.

Micro-batches carry, besides ``tokens``/``labels``/``loss_mask``/``position_ids``, all [b, s] and
aligned with ``labels``:

* ``advantages``: the trajectory's advantage on each of its policy tokens;
* ``old_logprobs``: the ratio's denominator: the policy's log-probabilities before this batch's
  updates (recomputed by the trainer with :meth:`Policy.forward_logprobs`; left out when each
  batch gets exactly one update: they equal this forward pass's own values, which serve
  detached, and the extra pass is saved), or with ``old_logprobs=engine`` the engine's, those of
  the policy that sampled (stale ones under asynchronous GRPO);
* ``ref_logprobs``: the reference model's (may be left out when ``kl_coef`` is 0);
* ``kl_mask`` (optional; default ``loss_mask``): the tokens the KL term covers, the policy's own
  draws (not those exploration forced: see :class:`~nemo_orch.train.grpo_samples.Sample`);
* ``engine_logprobs`` (optional): what the rollout engine reported, to log its mismatch with the
  trainer (``engine_logprob_abs_diff``), which grows with precision or kernel differences and
  with staleness, and, with ``importance_sampling_cap``, to correct for it: each token's
  surrogate is weighted by min(exp(old - engine), cap), the truncated importance ratio of the
  old policy to the policy that sampled the token (``is_weight_mean``, ``is_truncated_frac``).

Clipping is asymmetric (``clip_low``, ``clip_high``: DAPO's clip-higher) with the dual clip of
Ye et al. 2020 for negative advantages (``dual_clip`` > 1; 0 turns it off), as in verl's
``compute_policy_loss``.
"""

from __future__ import annotations

import torch

from nemo_orch.config import GRPOConfig
from nemo_orch.train.policy import Batch, TokenLoss, TokenLossFn

# Log-ratios are clamped before exp(), as in verl: one wild token must not overflow the step.
LOG_RATIO_LIMIT = 20.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) on the sampled tokens: ``k3`` (Schulman's
    non-negative, unbiased estimator exp(r) - r - 1 with r = ref - logp) or ``mse``
    (0.5 (logp - ref)^2)."""
    if kl_type == "mse":
        return 0.5 * (logprobs - ref_logprobs) ** 2
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return log_ratio.exp() - log_ratio - 1


def clipped_surrogate(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, config: GRPOConfig
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy loss -min(r A, clip(r) A) (dual-clipped at -dual_clip A where A < 0), the
    ratio r, and where each bound was active (``clip_frac_low``/``high``/``dual``)."""
    ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    loss = torch.maximum(unclipped, clipped)
    negative = advantages < 0
    bound_active = clipped > unclipped  # r > 1 + clip_high with A > 0, r < 1 - clip_low with A < 0
    # With A < 0 the loss grows without bound in r: cap it at -dual_clip A (no gradient there).
    cap = -advantages * config.dual_clip
    dual = negative & (loss > cap) if config.dual_clip > 0 else torch.zeros_like(negative)
    loss = torch.where(dual, cap, loss)
    active = {
        "clip_frac_high": bound_active & ~negative,
        "clip_frac_low": bound_active & negative,
        "clip_frac_dual": dual,
    }
    return loss, ratio, active


def grpo_token_loss(config: GRPOConfig) -> TokenLossFn:
    """The loss function for :meth:`Policy.train_step`. Its metrics are token means over the global
    batch (``policy_loss``, ``ratio_mean``, ``clip_frac_low``/``high``/``dual``; ``kl`` and
    ``kl_loss`` when there is a KL term; ``engine_logprob_abs_diff`` when the batch has
    ``engine_logprobs``; ``is_weight_mean`` and ``is_truncated_frac`` with the importance-sampling
    correction) and the maximum ``ratio_max``."""

    def token_loss(token_losses: torch.Tensor, batch: Batch) -> TokenLoss:
        mask = batch["loss_mask"].float()
        logprobs = -token_losses.float()
        old_logprobs = batch["old_logprobs"] if "old_logprobs" in batch else logprobs.detach()
        surrogate, ratio, active = clipped_surrogate(
            logprobs, old_logprobs, batch["advantages"], config
        )
        per_token: dict[str, torch.Tensor] = {}
        if config.importance_sampling_cap is not None:
            behaviour = (
                (old_logprobs - batch["engine_logprobs"])
                .detach()
                .clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
                .exp()
            )
            weight = behaviour.clamp(max=config.importance_sampling_cap)
            surrogate = surrogate * weight
            per_token.update(is_weight_mean=weight, is_truncated_frac=(behaviour > weight).float())
        loss = surrogate
        per_token["policy_loss"] = surrogate
        if config.kl_coef > 0 or "ref_logprobs" in batch:
            kl = kl_penalty(logprobs, batch["ref_logprobs"], config.kl_type) * batch.get(
                "kl_mask", mask
            )
            loss = loss + config.kl_coef * kl
            per_token.update(kl=kl, kl_loss=config.kl_coef * kl)
        with torch.no_grad():
            per_token["ratio_mean"] = ratio
            per_token.update({key: flag.float() for key, flag in active.items()})
            if "engine_logprobs" in batch:
                # Against the trainer's: this pass's where the old ones are the engine's.
                trainer = logprobs if config.old_logprobs == "engine" else old_logprobs
                per_token["engine_logprob_abs_diff"] = (batch["engine_logprobs"] - trainer).abs()
            sums = {key: (value.detach() * mask).sum() for key, value in per_token.items()}
            maxima = {"ratio_max": ratio.masked_fill(mask == 0, 0.0).max()}
        return TokenLoss((loss * mask).sum(), mask.sum().to(torch.int), sums, maxima)

    return token_loss
