"""The trainable policy: Megatron model stage, DDP wrapper, optimizer, LR schedule, one train step.

Losses are summed per token and divided by the number of loss tokens in the *global* batch
(``calculate_per_token_loss``), so TP, PP, DP and micro-batching all give the same gradients as one
process. Used by SFT now and by GRPO, which supplies its own per-token loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from nemo_orch.config import Config
from nemo_orch.distributed import ParallelContext
from nemo_orch.models import qwen3, weights

Batch = Mapping[str, torch.Tensor]
# (per-token loss [b, s] or logits, batch) -> (loss summed over tokens, number of loss tokens)
TokenLossFn = Callable[[torch.Tensor, Batch], tuple[torch.Tensor, torch.Tensor]]


def masked_token_loss(token_losses: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy summed over the tokens whose loss mask is set (the SFT objective)."""
    mask = batch["loss_mask"]
    return (token_losses.float() * mask).sum(), mask.sum().to(torch.int)


@dataclass
class StepResult:
    loss: float          # mean per-token loss over the global batch
    num_tokens: int      # loss tokens in the global batch
    grad_norm: float
    lr: float


class Policy:
    """One rank's pipeline stage of the Qwen3 policy with its optimizer."""

    def __init__(self, config: Config, context: ParallelContext) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.config = config
        self.context = context
        trainer = config.trainer
        stage = qwen3.build_model(config.model, config.parallel,
                                  pre_process=context.is_first_stage,
                                  post_process=context.is_last_stage)
        self.transformer_config = stage.config
        self.model = DistributedDataParallel(
            config=stage.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                use_distributed_optimizer=config.parallel.use_distributed_optimizer),
            module=stage,
        )
        self.transformer_config.finalize_model_grads_func = finalize_model_grads
        self.transformer_config.no_sync_func = self.model.no_sync
        dtype = qwen3.DTYPES[config.model.params_dtype]
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=trainer.lr, min_lr=trainer.min_lr,
                weight_decay=trainer.weight_decay, adam_beta1=trainer.adam_beta1,
                adam_beta2=trainer.adam_beta2, clip_grad=trainer.grad_clip,
                bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
                use_distributed_optimizer=config.parallel.use_distributed_optimizer),
            [self.model],
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=trainer.lr, min_lr=trainer.min_lr,
            lr_warmup_steps=trainer.warmup_steps,
            lr_decay_steps=max(trainer.max_steps, trainer.warmup_steps + 1),
            lr_decay_style="cosine", start_wd=trainer.weight_decay, end_wd=trainer.weight_decay,
            wd_incr_steps=trainer.max_steps, wd_incr_style="constant")

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel stage (no DDP wrapper)."""
        return self.model.module

    def load_hf_weights(self, hf: Mapping[str, torch.Tensor]) -> None:
        weights.load_hf_weights(self.module, hf, self.config.model)
        # The distributed optimizer keeps fp32 main params: refresh them from the model.
        self.optimizer.reload_model_params()

    def train_step(self, micro_batches: list[Batch],
                   token_loss: TokenLossFn = masked_token_loss) -> StepResult:
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
        loss_sum, num_tokens = self._global_loss(losses)
        return StepResult(loss=loss_sum / max(num_tokens, 1), num_tokens=num_tokens,
                          grad_norm=float(grad_norm or 0.0),
                          lr=self.optimizer.param_groups[0]["lr"])

    def _forward_step(self, token_loss: TokenLossFn, data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(token_losses: torch.Tensor):
            loss_sum, num_tokens = token_loss(token_losses, batch)
            return loss_sum, num_tokens, {"loss": torch.stack([loss_sum.detach(),
                                                               num_tokens.float()])}

        return output, loss_func

    def _global_loss(self, losses: list[dict]) -> tuple[float, int]:
        """Loss sum and token count over the global batch, known on every rank."""
        totals = torch.zeros(2)
        if self.context.is_last_stage and self.context.tp_rank == 0:
            for entry in losses:
                totals += entry["loss"].float().cpu()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals)
        return float(totals[0]), int(totals[1])
