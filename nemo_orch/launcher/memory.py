"""Per-GPU memory of a training layout, estimated on paper before a cluster is asked for it.

What one GPU holds while the policy trains (``nemo_orch/train/policy.py``: Megatron DDP with
FP32 gradient buffers, Adam in the distributed optimizer) and, when the rollout engine shares
the GPUs (``rollout.colocate``), the engine's weights and KV cache:

- weights: the GPU's share of the parameters (its TP shard of the largest pipeline stage) in
  ``model.params_dtype``; with ``model.fp8`` Transformer Engine also caches an FP8 copy of each
  GEMM weight (1 byte); with ``model.fp8_param`` the GEMM weights are that FP8 copy;
- gradients: 4 bytes per parameter (``grad_reduce_in_fp32``; the buffer is whole even with the
  distributed optimizer, which reduce-scatters it);
- optimizer: Adam's two FP32 moments, plus FP32 main weights for 16-bit (or FP8) parameters,
  divided over the data-parallel ranks with the distributed optimizer;
- activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Table 2 per layer (16-bit activations; their GPT layer, an upper bound for Qwen3's
  dropout-free one), times the layers whose activations the 1F1B schedule keeps in flight, plus
  the output layer and cross-entropy term ``4sbh/t (1 + v/h)`` of their Sec. 4.3;
- rollout engine: its TP shard of the weights in ``rollout.engine_dtype`` and a KV cache of
  ``layers x 2 x kv_heads/engine_tp x head_dim x bytes`` per token. TensorRT-LLM takes
  ``gpu_memory_utilization`` of the memory free after everything resident (it never sleeps, so
  activations must fit in the rest); vLLM takes that share of the whole GPU and sleeps while the
  policy trains (its memory and the activations are never there at once);
- runtime: CUDA context, NCCL buffers and allocator fragmentation, a flat allowance.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nemo_orch.config import Config, ModelConfig, ParallelConfig

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP8_BYTES = 1
GRAD_BYTES = 4
ADAM_MOMENT_BYTES = 8
MAIN_WEIGHT_BYTES = 4
# CUDA context (~0.5 GiB), NCCL communicators and buffers, and what the caching allocator cannot
# reuse: what stays unaccounted by the formulas on a busy H100.
RUNTIME_OVERHEAD_BYTES = 4 * GIB


@dataclass(frozen=True)
class ParameterShare:
    """Parameters on the GPU holding the most: ``total``, of which ``fp8_gemm`` run in FP8."""

    total: int
    fp8_gemm: int


def layer_gemm_parameters(model: ModelConfig) -> int:
    """A layer's GEMM weights, unsharded: QKV, attention output, SwiGLU fc1 (gate, up) and fc2."""
    h, q, kv, d = (model.hidden_size, model.num_attention_heads, model.num_query_groups,
                   model.kv_channels)
    return h * (q + 2 * kv) * d + q * d * h + 3 * h * model.ffn_hidden_size


def parameter_share(model: ModelConfig, parallel: ParallelConfig) -> ParameterShare:
    """The largest pipeline stage's TP shard: ``num_layers / pp`` layers (GEMMs split over TP,
    norms replicated) and the vocab-parallel embedding and output layer (the last stage keeps
    both with PP=1, one of them plus the final norm otherwise; a tied output layer is a copy on
    the last stage)."""
    h, tp = model.hidden_size, parallel.tp
    layers = model.num_layers // parallel.pp
    gemm = layer_gemm_parameters(model) // tp
    norms = 2 * h + (2 * model.kv_channels if model.qk_layernorm else 0)
    vocab = model.vocab_size * h // tp
    vocab_tables = 2 if parallel.pp == 1 and not model.share_embeddings_and_output_weights else 1
    total = layers * (gemm + norms) + vocab_tables * vocab + h
    fp8_layers = 0
    if model.fp8 is not None:
        kept = (model.num_layers_at_start_in_bf16 + model.num_layers_at_end_in_bf16
                if model.first_last_layers_bf16 else 0)
        fp8_layers = max(0, layers - kept)
    return ParameterShare(total=total, fp8_gemm=fp8_layers * gemm)


def weight_bytes(model: ModelConfig, share: ParameterShare) -> int:
    dtype = DTYPE_BYTES[model.params_dtype]
    if model.fp8_param:
        return (share.total - share.fp8_gemm) * dtype + share.fp8_gemm * FP8_BYTES
    return share.total * dtype + share.fp8_gemm * FP8_BYTES


def optimizer_bytes(model: ModelConfig, parallel: ParallelConfig, share: ParameterShare) -> int:
    main = MAIN_WEIGHT_BYTES if model.params_dtype != "float32" or model.fp8_param else 0
    per_parameter = ADAM_MOMENT_BYTES + main
    shards = parallel.dp if parallel.use_distributed_optimizer else 1
    return share.total * per_parameter // shards


def layer_activation_bytes(model: ModelConfig, parallel: ParallelConfig, seq_length: int,
                           micro_batch_size: int) -> float:
    """Korthikanti et al. 2022, Table 2: one layer's stored activations for one micro-batch.
    Full recompute keeps only the layer's input (``2sbh``, sharded over TP with sequence
    parallelism, as Megatron stores it)."""
    s, b, h, a, t = (seq_length, micro_batch_size, model.hidden_size,
                     model.num_attention_heads, parallel.tp)
    sbh = s * b * h
    sp = parallel.sequence_parallel
    if model.recompute_granularity == "full":
        return 2 * sbh / (t if sp else 1)
    attention_scores = 0 if model.recompute_granularity == "selective" else 5 * a * s / h
    if sp:
        return sbh / t * (34 + attention_scores)
    return sbh * (10 + 24 / t + attention_scores / t)


def activation_bytes(model: ModelConfig, parallel: ParallelConfig, seq_length: int,
                     micro_batch_size: int, num_microbatches: int) -> float:
    """The stage holding the most: 1F1B keeps ``min(pp, micro-batches)`` micro-batches of its
    ``num_layers / pp`` layers in flight on the first stage; plus the output layer and loss."""
    in_flight = min(parallel.pp, num_microbatches)
    layers = model.num_layers // parallel.pp * in_flight
    sbh_t = seq_length * micro_batch_size * model.hidden_size / parallel.tp
    output = 4 * sbh_t * (1 + model.vocab_size / model.hidden_size)
    return layers * layer_activation_bytes(model, parallel, seq_length, micro_batch_size) + output


def kv_bytes_per_token(model: ModelConfig, engine_tp: int, dtype: str) -> int:
    """Keys and values of every layer for one token, on one of the engine's TP GPUs."""
    return (model.num_layers * 2 * (model.num_query_groups // engine_tp) * model.kv_channels
            * DTYPE_BYTES[dtype])


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU. ``engine_asleep_in_training``: the engine's memory and the activations
    are never held at once (vLLM sleeping), so the peak counts the larger of the two."""

    weights: int
    gradients: int
    optimizer: int
    activations: float
    engine_weights: int = 0
    kv_cache: float = 0.0
    kv_tokens: int = 0
    engine_asleep_in_training: bool = False
    runtime: int = RUNTIME_OVERHEAD_BYTES

    @property
    def resident(self) -> int:
        """Held for the whole run: weights, gradients, optimizer states."""
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        engine = self.engine_weights + self.kv_cache
        if self.engine_asleep_in_training:
            return self.resident + self.runtime + max(self.activations, engine)
        return self.resident + self.runtime + self.activations + engine


def training_estimate(model: ModelConfig, parallel: ParallelConfig, seq_length: int,
                      micro_batch_size: int, num_microbatches: int) -> MemoryEstimate:
    share = parameter_share(model, parallel)
    return MemoryEstimate(
        weights=weight_bytes(model, share), gradients=share.total * GRAD_BYTES,
        optimizer=optimizer_bytes(model, parallel, share),
        activations=activation_bytes(model, parallel, seq_length, micro_batch_size,
                                     num_microbatches))


def with_colocated_engine(estimate: MemoryEstimate, config: Config,
                          gpu_bytes: float) -> MemoryEstimate:
    """``estimate`` plus the rollout engine when it shares the training GPUs (else unchanged)."""
    rollout = config.rollout
    if not rollout.colocate or rollout.engine not in ("trtllm", "vllm"):
        return estimate
    engine_weights = (config.model.num_parameters() * DTYPE_BYTES[rollout.engine_dtype]
                      // rollout.engine_tp)
    if rollout.engine == "trtllm":
        free = gpu_bytes - estimate.resident - estimate.runtime - engine_weights
        kv_cache = max(0.0, rollout.gpu_memory_utilization * free)
    else:
        kv_cache = max(0.0, rollout.gpu_memory_utilization * gpu_bytes - engine_weights)
    per_token = kv_bytes_per_token(config.model, rollout.engine_tp, rollout.engine_dtype)
    return dataclasses.replace(estimate, engine_weights=engine_weights, kv_cache=kv_cache,
                               kv_tokens=int(kv_cache // per_token),
                               engine_asleep_in_training=rollout.engine == "vllm")


def sft_estimate(config: Config) -> MemoryEstimate:
    """The SFT stage: ``data.seq_length`` x ``trainer.micro_batch_size``, no engine."""
    return training_estimate(config.model, config.parallel, config.data.seq_length,
                             config.trainer.micro_batch_size, config.num_microbatches)


def grpo_microbatches(config: Config) -> int:
    """Micro-batches per data-parallel rank in one GRPO optimizer step."""
    grpo = config.grpo
    samples = grpo.prompts_per_step * config.rollout.group_size
    return max(1, samples // (grpo.mini_batches * config.parallel.dp * grpo.micro_batch_size))


def grpo_estimate(config: Config, gpu_bytes: float) -> MemoryEstimate:
    """The GRPO stage: whole trajectories of up to the rollout's context budget x
    ``grpo.micro_batch_size``, with the colocated engine."""
    rollout = config.resolved_rollout()
    training = training_estimate(config.model, config.parallel, rollout.max_context_tokens,
                                 config.grpo.micro_batch_size, grpo_microbatches(config))
    return with_colocated_engine(training, config, gpu_bytes)
