"""``nemo-orch plan``: check a configuration's layout on CPU and print its per-GPU memory.

What a cluster would reject later, after queueing (a world size that does not match the
allocation, batches that do not split over the data-parallel ranks, TP sizes that do not divide
the heads, FP8 shapes Transformer Engine refuses), found before anything is submitted; and the
estimate of :mod:`nemo_orch.launcher.memory` against the GPU's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_orch.config import Config
from nemo_orch.launcher.memory import (
    GIB,
    MemoryEstimate,
    PrefixSharing,
    engine_estimate,
    group_samples_per_rank,
    grpo_estimate,
    prefix_sharing,
    separate_engine,
    sft_estimate,
    sharing_micro_batch,
    sharing_unavailable,
)

# Transformer Engine's FP8 GEMMs need each dimension of a weight shard to be a multiple of this.
FP8_ALIGNMENT = 16


def layout_problems(config: Config) -> list[str]:
    """Everything wrong with the layout, each naming the keys to change (empty: none)."""
    model, parallel, launcher = config.model, config.parallel, config.launcher
    rollout, grpo = config.rollout, config.grpo
    problems = []
    gpus = launcher.nodes * launcher.gpus_per_node
    # An engine with GPUs of its own takes rollout.engine_tp of the (single) node's GPUs.
    engine_gpus = rollout.engine_tp if separate_engine(config) else 0
    if launcher.gpus_per_node and parallel.world_size + engine_gpus != gpus:
        engine = f" + rollout.engine_tp = {engine_gpus} engine GPUs" if engine_gpus else ""
        problems.append(
            f"parallel: tp x pp x dp = {parallel.world_size} ranks{engine}, but the "
            f"launcher gives {launcher.nodes} nodes x {launcher.gpus_per_node} GPUs "
            f"= {gpus}"
        )
    if engine_gpus and launcher.nodes > 1:
        problems.append(
            "rollout.colocate=false: the engine runs on the first node's last "
            f"rollout.engine_tp GPUs beside the training ranks, so launcher.nodes must "
            f"be 1 (got {launcher.nodes})"
        )
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        if getattr(model, name) % parallel.tp:
            problems.append(
                f"model.{name} ({getattr(model, name)}) is not divisible by "
                f"parallel.tp ({parallel.tp})"
            )
    samples = grpo.prompts_per_step * rollout.group_size
    per_update = grpo.mini_batches * parallel.dp * grpo.micro_batch_size
    if samples % per_update:
        problems.append(
            f"GRPO: grpo.prompts_per_step x rollout.group_size = {samples} samples "
            f"do not split into grpo.mini_batches x parallel.dp x "
            f"grpo.micro_batch_size = {per_update}"
        )
    if rollout.engine in ("trtllm", "vllm"):
        problems += _engine_problems(config)
    if model.fp8 is not None:
        problems += _fp8_problems(config)
    if launcher.ray is not None and rollout.backend != "ray":
        problems.append(
            "launcher.ray starts a Ray cluster that rollout.backend="
            f"{rollout.backend} does not use (rollout.backend=ray)"
        )
    if launcher.ray is not None and rollout.backend == "ray" and rollout.ray.address != "auto":
        problems.append(
            "rollout.ray.address must be auto to join launcher.ray's cluster (the "
            "job gets its RAY_ADDRESS)"
        )
    for expert in launcher.experts:
        if expert.tp > launcher.gpus_per_node:
            problems.append(
                f"launcher.experts[{expert.name}].tp ({expert.tp}) exceeds "
                f"launcher.gpus_per_node ({launcher.gpus_per_node})"
            )
    return problems


def _engine_problems(config: Config) -> list[str]:
    model, rollout, launcher = config.model, config.rollout, config.launcher
    tp = rollout.engine_tp
    problems = [
        f"model.{name} ({getattr(model, name)}) is not divisible by rollout.engine_tp ({tp})"
        for name in ("num_attention_heads", "num_query_groups")
        if getattr(model, name) % tp
    ]
    if rollout.colocate and launcher.gpus_per_node and launcher.gpus_per_node % tp:
        problems.append(
            f"rollout.engine_tp ({tp}) does not divide launcher.gpus_per_node "
            f"({launcher.gpus_per_node}) the colocated engines share"
        )
    return problems


def _fp8_problems(config: Config) -> list[str]:
    model, tp = config.model, config.parallel.tp
    problems = []
    if config.launcher.gpus_per_node == 0:
        problems.append("model.fp8 needs GPUs (Hopper or newer): launcher.gpus_per_node is 0")
    shards = {
        "ffn_hidden_size / parallel.tp": model.ffn_hidden_size // tp,
        "num_attention_heads x kv_channels / parallel.tp": model.num_attention_heads
        * model.kv_channels
        // tp,
        "num_query_groups x kv_channels / parallel.tp": model.num_query_groups
        * model.kv_channels
        // tp,
    }
    problems += [
        f"model.fp8: {name} = {size} is not a multiple of {FP8_ALIGNMENT}"
        for name, size in shards.items()
        if size % FP8_ALIGNMENT
    ]
    return problems


@dataclass(frozen=True)
class Plan:
    """Per-GPU memory of the training GPUs in each stage and, when the rollout engine has GPUs
    of its own, of one of those (``engine``); what prefix sharing would save (``sharing``;
    None: no micro-batch would hold two samples of a group)."""

    sft: MemoryEstimate
    grpo: MemoryEstimate
    gpu_bytes: float
    min_kv_tokens: int
    engine: MemoryEstimate | None = None
    sharing: PrefixSharing | None = None

    def fits(self) -> bool:
        """Every GPU within its memory, and the KV cache (if any) holds one whole context."""
        engine = self.engine or self.grpo
        kv_ok = engine.engine_weights == 0 or engine.kv_tokens >= self.min_kv_tokens
        totals = [self.sft.total, self.grpo.total, self.engine.total if self.engine else 0]
        return max(totals) <= self.gpu_bytes and kv_ok


def plan(config: Config) -> Plan:
    gpu_bytes = config.launcher.gpu_memory_gib * GIB
    size = sharing_micro_batch(config)
    return Plan(
        sft=sft_estimate(config),
        grpo=grpo_estimate(config, gpu_bytes),
        gpu_bytes=gpu_bytes,
        min_kv_tokens=config.resolved_rollout().max_context_tokens,
        engine=engine_estimate(config, gpu_bytes) if separate_engine(config) else None,
        sharing=None if size is None else prefix_sharing(config, size),
    )


def _gib(value: float) -> str:
    return f"{value / GIB:8.2f}"


def _row_value(estimate: MemoryEstimate, name: str) -> float:
    """A table row's bytes: ``estimate``'s field ``name``, or with ``critic.`` its critic's
    (0 in a stage without one)."""
    owner, _, field = name.rpartition(".")
    part = estimate.critic if owner == "critic" else estimate
    return getattr(part, field) if part else 0


def report(config: Config, result: Plan) -> list[str]:
    """The table ``nemo-orch plan`` prints."""
    model, parallel, launcher, rollout = (
        config.model,
        config.parallel,
        config.launcher,
        config.rollout,
    )
    grpo, algo = result.grpo, config.grpo.algo
    count = model.num_parameters()
    params = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"
    fp8 = f"FP8 {model.fp8}/{model.fp8_recipe}" if model.fp8 else "no FP8"
    recompute = model.recompute_granularity or "no"
    context = config.resolved_rollout().max_context_tokens
    engine = "none on these GPUs"
    if grpo.engine_weights or result.engine:
        engine = (
            f"{rollout.engine} TP{rollout.engine_tp} {rollout.engine_dtype}, "
            f"gpu_memory_utilization {rollout.gpu_memory_utilization}"
            + (f", on {rollout.engine_tp} GPUs of its own" if result.engine else "")
        )
    lines = [
        f"plan: {config.run.name}: {model.preset} ({params} parameters, "
        f"{model.params_dtype}, {fp8}), {launcher.nodes} node(s) x {launcher.gpus_per_node} "
        f"GPUs, TP{parallel.tp} x PP{parallel.pp} x DP{parallel.dp}"
        f"{' + SP' if parallel.sequence_parallel else ''}",
        "  checks: world size, TP/PP divisibility, batches, engine TP, FP8 shapes: ok",
        f"  sft: {config.data.seq_length} tokens x micro-batch {config.trainer.micro_batch_size};"
        f" {algo}: {context} tokens x micro-batch {config.grpo.micro_batch_size}; "
        f"{recompute} recompute; rollout engine: {engine}",
        f"  {'per-GPU memory (GiB)':46} {'sft':>8} {algo:>8}",
    ]
    main = " + fp32 main" if model.params_dtype != "float32" or model.fp8_param else ""
    shards = parallel.dp if parallel.use_distributed_optimizer else 1
    # A trained model's states; PPO's critic has the same rows.
    states = [
        (
            "weights" + (" (+ FP8 GEMM copies)" if model.fp8 and not model.fp8_param else ""),
            "weights",
        ),
        ("gradients (fp32 buffers)", "gradients"),
        (f"optimizer (Adam{main}, /DP{shards})", "optimizer"),
    ]
    rows = states + [("activations (layers in flight + loss peak)", "activations")]
    if grpo.critic:
        rows += [(f"critic {label}", f"critic.{name}") for label, name in states]
        rows.append(("critic activations (layers + value head peak)", "critic.activations"))
    rows += [
        ("rollout engine weights", "engine_weights"),
        ("rollout KV cache", "kv_cache"),
        ("refit on the first rank (after the step)", "refit"),
        ("runtime (CUDA context, NCCL, fragmentation)", "runtime"),
    ]
    for label, name in rows:
        lines.append(
            f"  {label:46} {_gib(_row_value(result.sft, name))} {_gib(_row_value(grpo, name))}"
        )
    peak = "peak (vLLM sleeps while training)" if grpo.engine_asleep_in_training else "total"
    lines.append(f"  {peak:46} {_gib(result.sft.total)} {_gib(grpo.total)}")
    if grpo.critic:
        larger = "critic" if grpo.critic.activations > grpo.activations else "policy"
        lines.append(
            f"  activations: the {larger}'s count (the policy and the critic train in "
            "turn, never at once)"
        )
    if result.engine:
        lines.append(
            f"  {'engine GPU: weights + KV cache + runtime':46} {'':8} {_gib(result.engine.total)}"
        )
    with_kv = result.engine or grpo
    if with_kv.engine_weights:
        lines.append(
            f"  KV cache: {with_kv.kv_tokens:,} tokens = "
            f"{with_kv.kv_tokens / context:.1f} contexts of {context} tokens "
            f"(needs >= 1)"
        )
    lines += _sharing_lines(config, result.sharing)
    verdict = "fits" if result.fits() else "does not fit"
    lines.append(f"  {verdict} on a {launcher.gpu_memory_gib:g} GiB GPU (launcher.gpu_memory_gib)")
    return lines


def _sharing_lines(config: Config, sharing: PrefixSharing | None) -> list[str]:
    """What prefix sharing would save in the policy's activations (not in the table, which
    keeps the unshared peak: a micro-batch whose samples share little is as large packed)."""
    reason = sharing_unavailable(config)
    state = "applied" if reason is None else f"not applied ({reason})"
    size = config.grpo.micro_batch_size
    if sharing is None:
        return [
            f"  prefix sharing: {state}; none would share: a rank holds "
            f"{max(1, group_samples_per_rank(config))} sample of a group of "
            f"{config.rollout.group_size} on average (grpo.mini_batches x parallel.dp = "
            f"{config.grpo.mini_batches * config.parallel.dp})"
        ]
    other = sharing.micro_batch_size != size
    prompts = "1 group's prompt" if sharing.groups == 1 else f"{sharing.groups} groups' prompts"
    return [
        f"  prefix sharing: {state}"
        + (f"; micro-batch {size} shares nothing" if other else "")
        + "; the table counts none",
        f"  at micro-batch {sharing.micro_batch_size}"
        + (" (a rank's samples of a group, on average)" if other else "")
        + f": a row of {sharing.row_tokens:,} tokens ({prompts} of up to "
        f"{sharing.prompt_tokens:,} tokens, max_context_tokens - max_new_tokens, once, then "
        f"{sharing.micro_batch_size} replies of {sharing.reply_tokens:,}) in place of "
        f"{sharing.micro_batch_size} x {sharing.prompt_tokens + sharing.reply_tokens:,}; "
        f"activations {sharing.shared_activations / GIB:.2f} GiB (its tree mask "
        f"{sharing.mask / GIB:.2f}) in place of {sharing.unshared_activations / GIB:.2f}",
    ]
