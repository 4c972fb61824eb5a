"""The trainable policy: Megatron model stage, DDP wrapper, optimizer, LR schedule, one train step.

Losses are summed per token and divided by the number of loss tokens in the *global* batch
(``calculate_per_token_loss``), so TP, PP, DP and micro-batching all give the same gradients as one
process. Used by SFT and by GRPO, which supplies its own per-token loss (with extra metrics) and
reads per-token log-probabilities through forward-only passes (:func:`forward_logprobs`), also of a
frozen :class:`ReferenceModel`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from nemo_orch.config import Config, ConfigError, ModelConfig
from nemo_orch.distributed import ParallelContext
from nemo_orch.models import qwen3, weights
from nemo_orch.train.prefix_sharing import is_packed, unpacked

Batch = Mapping[str, torch.Tensor]


class TokenLoss(NamedTuple):
    """One micro-batch's loss: summed over its loss tokens (differentiable), their number, and
    detached metrics that are summed over tokens (reported as means over the global batch's loss
    tokens) or maxima (reported as the global maximum)."""

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    metric_sums: Mapping[str, torch.Tensor] = {}
    metric_maxima: Mapping[str, torch.Tensor] = {}


# (per-token cross entropy [b, s] = -logprob of each label, micro-batch) -> its loss
TokenLossFn = Callable[[torch.Tensor, Batch], TokenLoss]


def masked_token_loss(token_losses: torch.Tensor, batch: Batch) -> TokenLoss:
    """Cross entropy summed over the tokens whose loss mask is set (the SFT objective)."""
    mask = batch["loss_mask"]
    return TokenLoss((token_losses.float() * mask).sum(), mask.sum().to(torch.int))


@dataclass
class StepResult:
    loss: float  # mean per-token loss over the global batch
    num_tokens: int  # loss tokens in the global batch
    grad_norm: float
    lr: float
    # the loss function's metrics: token means (sums / num_tokens) and maxima, global batch
    metrics: dict[str, float] = field(default_factory=dict)


def forward_logprobs(
    model: torch.nn.Module, micro_batches: list[Batch]
) -> list[torch.Tensor | None]:
    """Log-probabilities of the labels, [b, s] per micro-batch (0 where ``loss_mask`` is not
    set), from a forward-only pass (see :func:`forward_only`)."""
    return forward_only(model, micro_batches, labels=True)


def forward_values(model: torch.nn.Module, micro_batches: list[Batch]) -> list[torch.Tensor | None]:
    """A critic's values, [b, s] per micro-batch (position ``i``: the value of the state before
    label ``i``), from a forward-only pass (see :func:`forward_only`)."""
    return forward_only(model, micro_batches, labels=False)


def forward_only(
    model: torch.nn.Module, micro_batches: list[Batch], labels: bool
) -> list[torch.Tensor | None]:
    """The last stage's output per micro-batch, [b, s]: label log-probabilities (``labels``) or
    the model's own output (a critic's values), from a forward-only pass.

    Runs through Megatron's pipeline schedule, so every pipeline stage must call it with the same
    micro-batches. Returns the tensors on the last stage (the same on each of its TP ranks, which is
    where a token loss is computed) and None per micro-batch elsewhere.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, stage):
        batch = next(data_iterator)
        output = _stage_output(stage, batch, labels)

        def collect(result: torch.Tensor):  # per-token cross entropy, or values
            kept = -result if labels else result
            return (
                result.sum(),
                torch.zeros((), dtype=torch.int),
                {"output": kept.detach().float()},
            )

        return output, collect

    model.eval()
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=micro_batches[0]["tokens"].shape[1],
            micro_batch_size=micro_batches[0]["tokens"].shape[0],
            forward_only=True,
        )
    if not parallel_state.is_pipeline_last_stage():
        return [None] * len(micro_batches)
    return [entry["output"] for entry in outputs]


def _stage_output(stage: torch.nn.Module, batch: Batch, labels: bool) -> torch.Tensor:
    """A pipeline stage's output: on the last, per-token cross entropy of the labels (a policy;
    see :func:`_masked_label_losses`) or the head's output (a critic's values); before it,
    hidden states."""
    model = stage
    while hasattr(model, "module"):  # the DDP wrapper
        model = model.module
    if labels and model.post_process:
        return _masked_label_losses(stage, model, batch)
    output = _stage_forward(stage, batch)
    if model.post_process and is_packed(batch):
        return unpacked(output[0], batch)  # the critic's values, [1, n] -> [b, s]
    return output


def _stage_forward(stage: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The stage on the batch's inputs: its rows, or a prefix-shared micro-batch's packed row
    under its token tree's mask (:mod:`nemo_orch.train.prefix_sharing`)."""
    mask = batch["attention_mask"] if is_packed(batch) else None
    return stage(batch["tokens"], batch["position_ids"], mask)


def _masked_label_losses(
    stage: torch.nn.Module, model: torch.nn.Module, batch: Batch
) -> torch.Tensor:
    """Per-token cross entropy of the labels, [b, s], at the positions ``loss_mask`` sets and 0
    elsewhere: the output layer and the (vocabulary-parallel) cross entropy run on those
    positions alone, not on the prompt's, whose log-probabilities nothing reads. The values are
    the full forward's at those positions (the same layer, position by position).

    The last stage's GPTModel returns its final hidden states with ``post_process`` off for the
    call; the rest is its own ``_postprocess``'s tail on the selected rows (gathered first from
    the sequence-parallel region, as its inference path does; every TP rank then holds the same
    rows, so the gather's backward keeps its own share of the gradient)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    model.post_process = False
    try:
        hidden = _stage_forward(stage, batch)  # [s, b, h]; packed: [n, 1, h]
    finally:
        model.post_process = True
    output_layer = model.output_layer
    sequence_parallel = output_layer.sequence_parallel
    if sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
    if is_packed(batch):
        hidden = unpacked(hidden[:, 0], batch).transpose(0, 1)  # [s, b, h]
    positions = batch["loss_mask"].transpose(0, 1) > 0  # [s, b], as the hidden states
    weight = (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else None
    )
    output_layer.sequence_parallel = False
    try:
        logits, _ = output_layer(hidden[positions].unsqueeze(1), weight=weight)  # [n, 1, v/tp]
    finally:
        output_layer.sequence_parallel = sequence_parallel
    labels = batch["labels"].transpose(0, 1)[positions].unsqueeze(0)  # [1, n]
    losses = model.compute_language_model_loss(labels, logits)[0]  # [n]
    return (
        torch.zeros(positions.shape, dtype=losses.dtype, device=losses.device)
        .masked_scatter(positions, losses)
        .transpose(0, 1)
    )


class Policy:
    """One rank's pipeline stage of the Qwen3 policy with its optimizer (``trainer.optim``)."""

    # The loss reads per-token cross entropy of the labels (a critic's: its values).
    LABELS = True

    def __init__(self, config: Config, context: ParallelContext) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.config = config
        self.context = context
        trainer = config.trainer
        stage = self.build_stage(config, context)
        self.transformer_config = stage.config
        self.model = DistributedDataParallel(
            config=stage.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                use_distributed_optimizer=config.parallel.use_distributed_optimizer,
            ),
            module=stage,
        )
        self.transformer_config.finalize_model_grads_func = finalize_model_grads
        self.transformer_config.no_sync_func = self.model.no_sync
        dtype = qwen3.DTYPES[config.model.params_dtype]
        optim = trainer.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=optim.lr,
                min_lr=optim.min_lr,
                weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1,
                adam_beta2=optim.adam_beta2,
                clip_grad=optim.grad_clip,
                bf16=dtype == torch.bfloat16,
                fp16=dtype == torch.float16,
                params_dtype=dtype,
                use_distributed_optimizer=config.parallel.use_distributed_optimizer,
            ),
            [self.model],
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=optim.lr,
            min_lr=optim.min_lr,
            lr_warmup_steps=optim.warmup_steps,
            lr_decay_steps=max(trainer.max_steps, optim.warmup_steps + 1),
            lr_decay_style="cosine",
            start_wd=optim.weight_decay,
            end_wd=optim.weight_decay,
            wd_incr_steps=trainer.max_steps,
            wd_incr_style="constant",
        )

    @staticmethod
    def build_stage(config: Config, context: ParallelContext) -> torch.nn.Module:
        return qwen3.build_model(
            config.model,
            config.parallel,
            pre_process=context.is_first_stage,
            post_process=context.is_last_stage,
        )

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel stage (no DDP wrapper)."""
        return self.model.module

    def load_hf_weights(self, hf: Mapping[str, torch.Tensor]) -> None:
        weights.load_hf_weights(self.module, hf, self.config.model)
        # The distributed optimizer keeps fp32 main params: refresh them from the model.
        self.optimizer.reload_model_params()

    def forward_logprobs(self, micro_batches: list[Batch]) -> list[torch.Tensor | None]:
        """The current policy's label log-probabilities (see :func:`forward_logprobs`), e.g. the
        ``old_logprobs`` of a GRPO batch before its updates."""
        return forward_logprobs(self.model, micro_batches)

    def copy_weights(self) -> list[torch.Tensor]:
        """A copy of this rank's weights in host memory (the KL guard takes one every step: it
        must not cost accelerator memory), to roll updates back with :meth:`restore_weights`."""
        return [parameter.detach().to("cpu", copy=True) for parameter in self.module.parameters()]

    def restore_weights(self, copied: list[torch.Tensor]) -> None:
        """Back to the weights of :meth:`copy_weights` (the optimizer's moments stay)."""
        with torch.no_grad():
            for parameter, saved in zip(self.module.parameters(), copied, strict=True):
                parameter.copy_(saved)
        self.optimizer.reload_model_params()

    def train_step(
        self, micro_batches: list[Batch], token_loss: TokenLossFn = masked_token_loss
    ) -> StepResult:
        """Forward/backward over this DP rank's micro-batches, then one optimizer step."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, token_loss),
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=micro_batches[0]["tokens"].shape[1],
            micro_batch_size=micro_batches[0]["tokens"].shape[0],
            forward_only=False,
        )
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        loss_sum, num_tokens, metrics = self._global_totals([entry["loss"] for entry in losses])
        return StepResult(
            loss=loss_sum / max(num_tokens, 1),
            num_tokens=num_tokens,
            grad_norm=float(grad_norm or 0.0),
            lr=self.optimizer.param_groups[0]["lr"],
            metrics=metrics,
        )

    def _forward_step(self, token_loss: TokenLossFn, data_iterator, model):
        batch = next(data_iterator)
        output = _stage_output(model, batch, self.LABELS)

        def loss_func(outputs: torch.Tensor):
            result = token_loss(outputs, batch)
            kept = result._replace(loss_sum=result.loss_sum.detach())
            return result.loss_sum, result.num_tokens, {"loss": kept}

        return output, loss_func

    def _global_totals(self, losses: list[TokenLoss]) -> tuple[float, int, dict[str, float]]:
        """Loss sum, token count and metrics over the global batch, known on every rank.

        Each DP rank's last stage (TP rank 0; the others hold the same values) contributes its
        micro-batches. Metric names are only known where the loss ran, hence an object gather.
        """
        mine: dict = {"loss": 0.0, "tokens": 0, "sums": {}, "maxima": {}}
        if self.context.is_last_stage and self.context.tp_rank == 0:
            for entry in losses:
                mine["loss"] += float(entry.loss_sum)
                mine["tokens"] += int(entry.num_tokens)
                for key, value in entry.metric_sums.items():
                    mine["sums"][key] = float(value) + mine["sums"].get(key, 0.0)
                for key, value in entry.metric_maxima.items():
                    mine["maxima"][key] = max(float(value), mine["maxima"].get(key, -math.inf))
        everyone = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        num_tokens = sum(part["tokens"] for part in everyone)
        metrics: dict[str, float] = {}
        for part in everyone:
            for key, value in part["sums"].items():
                metrics[key] = value / max(num_tokens, 1) + metrics.get(key, 0.0)
            for key, value in part["maxima"].items():
                metrics[key] = max(value, metrics.get(key, -math.inf))
        return sum(part["loss"] for part in everyone), num_tokens, metrics


class Critic(Policy):
    """One rank's pipeline stage of PPO's critic (the policy's trunk with a value head:
    :func:`~nemo_orch.models.qwen3.build_critic`) with its optimizer (``trainer.optim`` of the
    config it is given: ``grpo.ppo.critic_optim``). Its loss functions get values [b, s] where a
    policy's get per-token cross entropy."""

    LABELS = False
    HEAD = "output_layer."  # the value head's state: what a policy's weights do not have

    @staticmethod
    def build_stage(config: Config, context: ParallelContext) -> torch.nn.Module:
        return qwen3.build_critic(
            config.model,
            config.parallel,
            pre_process=context.is_first_stage,
            post_process=context.is_last_stage,
        )

    def load_hf_weights(self, hf: Mapping[str, torch.Tensor]) -> None:
        """A policy's HF weights into the trunk; the head keeps its own."""
        weights.load_hf_weights(self.module, hf, self.config.model, skip=self.HEAD)
        self.optimizer.reload_model_params()

    def forward_values(self, micro_batches: list[Batch]) -> list[torch.Tensor | None]:
        """The current values (see :func:`forward_values`), e.g. the old values of a PPO
        batch before its updates."""
        return forward_values(self.model, micro_batches)

    @property
    def head(self) -> qwen3.ValueHead | None:
        """The value head (on the last pipeline stage; None elsewhere)."""
        return self.module.output_layer if self.context.is_last_stage else None


class ReferenceModel:
    """The frozen policy a GRPO loss's KL term is measured against: the same pipeline stage as
    :class:`Policy` on this rank, without optimizer or gradients."""

    def __init__(self, config: Config, context: ParallelContext) -> None:
        self.config = config
        self.module = qwen3.build_model(
            config.model,
            config.parallel,
            pre_process=context.is_first_stage,
            post_process=context.is_last_stage,
        )
        self.module.requires_grad_(False).eval()

    def load_hf_weights(self, hf: Mapping[str, torch.Tensor]) -> None:
        weights.load_hf_weights(self.module, hf, self.config.model)

    def forward_logprobs(self, micro_batches: list[Batch]) -> list[torch.Tensor | None]:
        """Label log-probabilities under the reference weights (see :func:`forward_logprobs`)."""
        return forward_logprobs(self.module, micro_batches)


def start_architecture(source: Path, model: ModelConfig) -> dict[str, Any]:
    """The architecture (``ARCHITECTURE_FIELDS``) of starting weights: an HF directory's
    ``config.json`` (read over ``model``) or the model section a nemo-orch checkpoint saved."""
    from nemo_orch.models import checkpoint
    from nemo_orch.models.hf_mapping import (
        ARCHITECTURE_FIELDS,
        HF_CONFIG,
        load_hf_checkpoint_config,
        model_config_from_hf,
    )

    if (source / HF_CONFIG).is_file():
        hf = model_config_from_hf(load_hf_checkpoint_config(source), model)
        return {name: getattr(hf, name) for name in ARCHITECTURE_FIELDS}
    saved = checkpoint.open_checkpoint(source).config_path
    try:
        section = OmegaConf.load(saved)["model"]
        return {name: section[name] for name in ARCHITECTURE_FIELDS}
    except Exception as error:  # a YAML or key error of any kind
        raise ConfigError(f"{saved}: no readable model section ({error})") from None


def load_start_weights(
    module: torch.nn.Module, model: ModelConfig, source: Path, skip: str | None = None
) -> None:
    """A stage's starting weights (``trainer.init_from``): an HF model directory, whose
    architecture must be ``model``'s, or a nemo-orch checkpoint; the module's state under
    ``skip`` (a name prefix, e.g. a critic's head) keeps its own values."""
    from nemo_orch.models import checkpoint
    from nemo_orch.models.hf_mapping import (
        HF_CONFIG,
        HFCheckpoint,
        architecture_mismatch,
        model_config_from_hf,
    )

    if not (source / HF_CONFIG).is_file():
        checkpoint.load(checkpoint.open_checkpoint(source), module, skip=skip)
        return
    hf = HFCheckpoint(source)
    mismatch = architecture_mismatch(model, model_config_from_hf(hf.config, model))
    if mismatch:
        raise ConfigError(
            f"trainer.init_from={source}: architecture differs from model.* "
            f"(config vs checkpoint: {'; '.join(mismatch)})"
        )
    weights.load_hf_weights(module, hf, model, skip=skip)
