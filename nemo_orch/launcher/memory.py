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
- activations: what Megatron's Qwen3 layer saves for its backward pass, tensor by tensor (the
  method of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", applied to this layer: GQA, QK norms, SwiGLU, no dropout; see
  :func:`layer_activation_bytes`), times the layers whose activations the 1F1B schedule keeps in
  flight, plus the peak of the output layer and loss: the 16-bit logits and the loss's FP32 copy,
  ``6sbv/t``. With full recompute the layer being recomputed in the backward pass needs its
  whole activations again; the peak counts the larger of that and the loss. Checked against an
  H200 (``benchmarks/gpu_train_step.py``; the numbers are in docs/launch.md);
- rollout engine: its TP shard of the weights in ``rollout.engine_dtype`` and a KV cache of
  ``layers x 2 x kv_heads/engine_tp x head_dim x bytes`` per token. TensorRT-LLM takes
  ``gpu_memory_utilization`` of the memory free after everything resident (it never sleeps, so
  activations must fit in the rest); vLLM takes that share of the whole GPU and sleeps while the
  policy trains (its memory and the activations are never there at once). Not colocated
  (``rollout.colocate=false``, as asynchronous GRPO needs), the engine's GPUs hold only it
  (:func:`engine_estimate`);
- PPO's critic (``grpo.algo=ppo``; ``nemo_orch/models/qwen3.py``'s ``build_critic``): the
  policy's trunk in the policy's layout, its own embedding table (never tied), a value head
  ``Linear(h, 1)`` replicated over TP in place of the output layer, and its own Adam: weights,
  gradients and optimizer states as the policy's for those parameters. Its activations are the
  policy's trunk's with the value head's in place of the logits; the critic and the policy
  train one after the other, so the peak counts the larger of the two (the policy's, whose
  logits outweigh one value per token);
- refit (GRPO, after each step, when the activations are gone): on the first rank, one
  bucket's received shards and the full HF tensors made of them, twice the larger of
  ``rollout.refit_bucket_mb`` and the largest unit the refit moves whole (the embeddings, the
  LM head, one decoder layer) in ``model.params_dtype``
  (:func:`nemo_orch.models.weights.hf_weight_buckets`);
- runtime: CUDA context, NCCL buffers and allocator fragmentation, a flat allowance.

What GRPO's prefix sharing (``grpo.prefix_sharing``, :mod:`nemo_orch.train.prefix_sharing`)
would save is counted beside the estimate, not in it (:func:`prefix_sharing`): a sample is
split into its group's prompt, a turn's whole prompt budget (``max_context_tokens -
max_new_tokens``), and its own reply (``max_new_tokens``), which is the most a group can share
(one turn after the longest prompt); a shorter prompt shares less, and a micro-batch whose
samples share nothing is as large packed as unpacked, so the table keeps the unshared peak.

Not counted: the frozen reference policy of the KL term (``ReferenceModel``, a weight copy of
the policy's stage) and transient forward-only passes (old logprobs and values).
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
    h, q, kv, d = (
        model.hidden_size,
        model.num_attention_heads,
        model.num_query_groups,
        model.kv_channels,
    )
    return h * (q + 2 * kv) * d + q * d * h + 3 * h * model.ffn_hidden_size


def parameter_share(
    model: ModelConfig, parallel: ParallelConfig, *, critic: bool = False
) -> ParameterShare:
    """The largest pipeline stage's TP shard: ``num_layers / pp`` layers (GEMMs split over TP,
    norms replicated) and what the first stage adds before them (the vocab-parallel embedding)
    or the last after them (the final norm and the output layer: vocab-parallel, none of its own
    when tied to the embedding on the same stage, a copy when tied across stages).

    ``critic``: PPO's critic, whose output layer is a value head ``Linear(h, 1)`` replicated over
    TP (:class:`nemo_orch.models.qwen3.ValueHead`) and whose embedding is its own (never tied)."""
    h, tp = model.hidden_size, parallel.tp
    layers = model.num_layers // parallel.pp
    gemm = layer_gemm_parameters(model) // tp
    norms = 2 * h + (2 * model.kv_channels if model.qk_layernorm else 0)
    embedding = model.vocab_size * h // tp
    if critic:
        output_layer = h + 1
    elif parallel.pp == 1 and model.share_embeddings_and_output_weights:
        output_layer = 0
    else:
        output_layer = embedding
    last_stage_end = h + output_layer
    ends = embedding + last_stage_end if parallel.pp == 1 else max(embedding, last_stage_end)
    total = layers * (gemm + norms) + ends
    fp8_layers = 0
    if model.fp8 is not None:
        kept = (
            model.num_layers_at_start_in_bf16 + model.num_layers_at_end_in_bf16
            if model.first_last_layers_bf16
            else 0
        )
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


def layer_activation_bytes(
    model: ModelConfig, parallel: ParallelConfig, seq_length: int, micro_batch_size: int
) -> float:
    """One layer's saved activations for one micro-batch (16-bit), per token:

    - the inputs of the two RMSNorms and of the QKV and fc1 GEMMs: ``8h`` (sharded over TP with
      sequence parallelism, as Megatron saves them);
    - over TP (``q`` = heads x head size, ``kv`` = query groups x head size, ``f`` = FFN size):
      the attention output GEMM's input ``2q``, the fused SwiGLU's input ``4f`` and fc2's
      ``2f``;
    - core attention, fused (Transformer Engine) or recomputed (selective): the QKV GEMM's
      output, whole, since V (and the QK norms' inputs) are views of it, ``2(q + 2kv)``, and Q
      and K after the norms and rotary embedding, ``2(q + kv)``; the local spec's unfused
      attention: Q and K, V expanded to every head (``6q``), the FP32 softmax and its 16-bit
      copy (``6as``, ``a`` = heads), and the QKV output when QK norms keep it.

    Full recompute keeps only the layer's input, ``2h`` (sharded with sequence parallelism).
    """
    h, t = model.hidden_size, parallel.tp
    q = model.num_attention_heads * model.kv_channels
    kv = model.num_query_groups * model.kv_channels
    f = model.ffn_hidden_size
    sequence_shards = t if parallel.sequence_parallel else 1
    if model.recompute_granularity == "full":
        return seq_length * micro_batch_size * 2 * h / sequence_shards
    per_token = 8 * h / sequence_shards + (2 * q + 6 * f) / t
    qkv_output = 2 * (q + 2 * kv)
    if model.transformer_impl == "local" and model.recompute_granularity is None:
        per_token += (
            6 * q
            + 6 * model.num_attention_heads * seq_length
            + (qkv_output if model.qk_layernorm else 0)
        ) / t
    else:
        per_token += (qkv_output + 2 * (q + kv)) / t
    return seq_length * micro_batch_size * per_token


def output_activation_bytes(
    model: ModelConfig, parallel: ParallelConfig, tokens: int, *, critic: bool = False
) -> float:
    """What the last stage's output layer and loss keep for ``tokens`` at the end of the forward
    pass: the final norm's input ``2h`` (over TP with sequence parallelism), then the policy's
    output GEMM input ``2h`` (saved as sharded, gathered again in the backward pass) and its
    logits, 16-bit and the loss's FP32 copy (``6v/t``); or the critic's value head input,
    gathered whole as the head is replicated over TP (``2h``), and its one value per token,
    16-bit and FP32 (``6``)."""
    h = model.hidden_size
    sequence_shards = parallel.tp if parallel.sequence_parallel else 1
    if critic:
        return tokens * (2 * h / sequence_shards + 2 * h + 6)
    return tokens * (4 * h / sequence_shards + 6 * model.vocab_size / parallel.tp)


def activation_bytes(
    model: ModelConfig,
    parallel: ParallelConfig,
    seq_length: int,
    micro_batch_size: int,
    num_microbatches: int,
    *,
    critic: bool = False,
    packed_row: int | None = None,
) -> float:
    """The stage holding the most: 1F1B keeps ``min(pp, micro-batches)`` micro-batches of its
    ``num_layers / pp`` layers in flight on the first stage. On top of them, at the end of the
    forward pass, the output layer and loss (:func:`output_activation_bytes`; ``critic``: PPO's
    value head in place of the logits); with full recompute, in the backward pass, one layer's
    whole activations instead when that is more.

    ``packed_row``: the micro-batch prefix-shared, its layers running on one row of that many
    tokens beside its tree mask (a boolean per pair of them); the output layer still reads each
    sample's own tokens."""
    in_flight = min(parallel.pp, num_microbatches)
    layers = model.num_layers // parallel.pp * in_flight
    row, rows, mask = (
        (seq_length, micro_batch_size, 0)
        if packed_row is None
        else (packed_row, 1, tree_mask_bytes(parallel, packed_row, num_microbatches))
    )
    peak = output_activation_bytes(model, parallel, seq_length * micro_batch_size, critic=critic)
    if model.recompute_granularity == "full":
        recomputed = dataclasses.replace(model, recompute_granularity=None)
        peak = max(peak, layer_activation_bytes(recomputed, parallel, row, rows))
    return layers * layer_activation_bytes(model, parallel, row, rows) + mask + peak


def tree_mask_bytes(parallel: ParallelConfig, packed_row: int, num_microbatches: int) -> int:
    """The tree masks of the prefix-shared micro-batches in flight: a boolean per pair of a
    packed row's tokens (dense: ``[1, 1, n, n]``), on every TP rank."""
    return min(parallel.pp, num_microbatches) * packed_row**2


def kv_bytes_per_token(model: ModelConfig, engine_tp: int, dtype: str) -> int:
    """Keys and values of every layer for one token, on one of the engine's TP GPUs."""
    return (
        model.num_layers
        * 2
        * (model.num_query_groups // engine_tp)
        * model.kv_channels
        * DTYPE_BYTES[dtype]
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU. ``engine_asleep_in_training``: the engine's memory and the activations
    are never held at once (vLLM sleeping), so the peak counts the larger of the two.
    ``critic``: PPO's critic on the same GPUs (its ``runtime`` is 0: the GPU's is counted here).
    Its states stay resident beside the policy's; its activations come and go in turn with the
    policy's (each mini-batch trains the policy, then the critic), so the peak counts the larger
    of the two."""

    weights: int
    gradients: int
    optimizer: int
    activations: float
    engine_weights: int = 0
    kv_cache: float = 0.0
    kv_tokens: int = 0
    engine_asleep_in_training: bool = False
    refit: int = 0
    runtime: int = RUNTIME_OVERHEAD_BYTES
    critic: MemoryEstimate | None = None

    @property
    def resident(self) -> int:
        """Held for the whole run: weights, gradients, optimizer states (the critic's too)."""
        critic = self.critic.resident if self.critic else 0
        return self.weights + self.gradients + self.optimizer + critic

    @property
    def peak_activations(self) -> float:
        """The policy's activations or, when larger, the critic's."""
        return max(self.activations, self.critic.activations if self.critic else 0.0)

    @property
    def total(self) -> float:
        """The peak: training's activations or, after the step, the refit (beside the engine,
        awake by then)."""
        engine = self.engine_weights + self.kv_cache
        if self.engine_asleep_in_training:
            return self.resident + self.runtime + max(self.peak_activations, engine + self.refit)
        return self.resident + self.runtime + max(self.peak_activations, self.refit) + engine


def training_estimate(
    model: ModelConfig,
    parallel: ParallelConfig,
    seq_length: int,
    micro_batch_size: int,
    num_microbatches: int,
    *,
    critic: bool = False,
) -> MemoryEstimate:
    """One model trained on these GPUs: the policy or (``critic``) PPO's critic."""
    share = parameter_share(model, parallel, critic=critic)
    return MemoryEstimate(
        weights=weight_bytes(model, share),
        gradients=share.total * GRAD_BYTES,
        optimizer=optimizer_bytes(model, parallel, share),
        activations=activation_bytes(
            model, parallel, seq_length, micro_batch_size, num_microbatches, critic=critic
        ),
        runtime=0 if critic else RUNTIME_OVERHEAD_BYTES,
    )


def separate_engine(config: Config) -> bool:
    """Whether the GPU rollout engine has GPUs of its own (``rollout.colocate=false``)."""
    return config.rollout.engine in ("trtllm", "vllm") and not config.rollout.colocate


def _with_engine(estimate: MemoryEstimate, config: Config, gpu_bytes: float) -> MemoryEstimate:
    """``estimate`` plus the engine's weight shard and the KV cache it takes of what is left."""
    rollout = config.rollout
    engine_weights = (
        config.model.num_parameters() * DTYPE_BYTES[rollout.engine_dtype] // rollout.engine_tp
    )
    if rollout.engine == "trtllm":
        free = gpu_bytes - estimate.resident - estimate.runtime - engine_weights
        kv_cache = max(0.0, rollout.gpu_memory_utilization * free)
    else:
        kv_cache = max(0.0, rollout.gpu_memory_utilization * gpu_bytes - engine_weights)
    per_token = kv_bytes_per_token(config.model, rollout.engine_tp, rollout.engine_dtype)
    return dataclasses.replace(
        estimate,
        engine_weights=engine_weights,
        kv_cache=kv_cache,
        kv_tokens=int(kv_cache // per_token),
        engine_asleep_in_training=rollout.engine == "vllm" and not separate_engine(config),
    )


def with_colocated_engine(
    estimate: MemoryEstimate, config: Config, gpu_bytes: float
) -> MemoryEstimate:
    """``estimate`` plus the rollout engine when it shares the training GPUs (else unchanged)."""
    if not config.rollout.colocate or config.rollout.engine not in ("trtllm", "vllm"):
        return estimate
    return _with_engine(estimate, config, gpu_bytes)


def engine_estimate(config: Config, gpu_bytes: float) -> MemoryEstimate:
    """One of the ``rollout.engine_tp`` GPUs of an engine that has GPUs of its own: its weight
    shard and KV cache, nothing of training."""
    return _with_engine(
        MemoryEstimate(weights=0, gradients=0, optimizer=0, activations=0.0), config, gpu_bytes
    )


def refit_bytes(config: Config) -> int:
    """The refit's transient bytes on the first rank (see the module docstring)."""
    model = config.model
    h, d = model.hidden_size, model.kv_channels
    layer = (
        h * (model.num_attention_heads + 2 * model.num_query_groups) * d
        + model.num_attention_heads * d * h
        + 3 * h * model.ffn_hidden_size
    )
    largest = max(model.vocab_size * h, layer) * DTYPE_BYTES[model.params_dtype]
    return 2 * max(config.rollout.refit_bucket_mb << 20, largest)


def sft_estimate(config: Config) -> MemoryEstimate:
    """The SFT stage: ``data.seq_length`` x ``trainer.micro_batch_size``, no engine."""
    return training_estimate(
        config.model,
        config.parallel,
        config.data.seq_length,
        config.trainer.micro_batch_size,
        config.num_microbatches,
    )


def grpo_microbatches(config: Config, micro_batch_size: int | None = None) -> int:
    """Micro-batches per data-parallel rank in one GRPO optimizer step (of
    ``grpo.micro_batch_size`` samples, or ``micro_batch_size``)."""
    grpo = config.grpo
    samples = grpo.prompts_per_step * config.rollout.group_size
    size = micro_batch_size or grpo.micro_batch_size
    return max(1, samples // (grpo.mini_batches * config.parallel.dp * size))


def sharing_unavailable(config: Config) -> str | None:
    """Why the job's update would not share prefixes (None: it would). Only the local layer
    spec's attention on CPU takes a token tree's mask (``nemo_orch.train.grpo.shares_prefixes``
    decides at run time on the machine itself; a plan reads the job's GPUs from the launcher)."""
    from nemo_orch.models.qwen3 import tree_mask_refusal

    if config.grpo.prefix_sharing == "off":
        return "grpo.prefix_sharing=off"
    return tree_mask_refusal(config.model, on_gpu=bool(config.launcher.gpus_per_node))


def group_samples_per_rank(config: Config) -> int:
    """How many samples of one group a rank trains on in a mini-batch, on average: its share is
    drawn at random (:func:`nemo_orch.train.grpo_samples.even_split`), ``group_size /
    (mini_batches x dp)`` of each group; ordered by their tokens, they sit together."""
    return config.rollout.group_size // (config.grpo.mini_batches * config.parallel.dp)


def sharing_micro_batch(config: Config) -> int | None:
    """The micro-batch size to count sharing at: ``grpo.micro_batch_size`` where it holds two
    or more samples of a group, else the smallest that holds as many as a rank has (None: a
    rank holds one sample of a group, and no micro-batch size shares)."""
    size, per_rank = config.grpo.micro_batch_size, group_samples_per_rank(config)
    if per_rank < 2:
        return None
    return size if size > 1 else per_rank


@dataclass(frozen=True)
class PrefixSharing:
    """A GRPO micro-batch of ``micro_batch_size`` samples of ``prompt_tokens + reply_tokens``
    from ``groups`` groups, packed with each group's prompt once: ``row_tokens`` (against
    ``micro_batch_size x`` the sample) and the policy's activations both ways, per GPU.
    ``mask``: the shared activations' tree masks. ``unavailable``: why the job would not share
    (None: it does)."""

    micro_batch_size: int
    prompt_tokens: int
    reply_tokens: int
    groups: int
    row_tokens: int
    unshared_activations: float
    shared_activations: float
    mask: int
    unavailable: str | None


def prefix_sharing(config: Config, size: int) -> PrefixSharing:
    """What packing shared prefixes would save at micro-batch ``size``, under the split of
    the module docstring."""
    context: int = config.resolved_rollout().max_context_tokens
    reply = min(config.rollout.max_new_tokens, context)
    groups = -(-size // max(1, min(size, group_samples_per_rank(config))))
    row = groups * (context - reply) + size * reply
    micro_batches = grpo_microbatches(config, size)
    shape = (config.model, config.parallel, context, size, micro_batches)
    return PrefixSharing(
        micro_batch_size=size,
        prompt_tokens=context - reply,
        reply_tokens=reply,
        groups=groups,
        row_tokens=row,
        unshared_activations=activation_bytes(*shape),
        shared_activations=activation_bytes(*shape, packed_row=row),
        mask=tree_mask_bytes(config.parallel, row, micro_batches),
        unavailable=sharing_unavailable(config),
    )


def grpo_estimate(config: Config, gpu_bytes: float) -> MemoryEstimate:
    """The GRPO stage: whole trajectories of up to the rollout's context budget x
    ``grpo.micro_batch_size``, with the colocated engine and, with ``grpo.algo=ppo``, the critic
    (the policy's trunk and layout, trained on the same micro-batches)."""
    shape = (
        config.model,
        config.parallel,
        config.resolved_rollout().max_context_tokens,
        config.grpo.micro_batch_size,
        grpo_microbatches(config),
    )
    training = dataclasses.replace(training_estimate(*shape), refit=refit_bytes(config))
    if config.grpo.algo == "ppo":
        training = dataclasses.replace(training, critic=training_estimate(*shape, critic=True))
    return with_colocated_engine(training, config, gpu_bytes)
