"""The Qwen3 policy as a Megatron-Core ``GPTModel``, and PPO's critic on the same trunk.

Local layer spec on CPU (its core attention fused by PyTorch:
:mod:`nemo_orch.models.sdpa_attention`), Transformer Engine spec (and FP8) on GPU. Dropout is
off, as in Qwen3, so forward passes are deterministic and parallel layouts agree with a single
process.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
import torch.nn.functional as F

from nemo_orch.config import ConfigError, ModelConfig, ParallelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_runtime(model: ModelConfig) -> None:
    """Fail early, with the reason, when the config asks for what this machine lacks."""
    if model.transformer_impl == "transformer_engine":
        if not torch.cuda.is_available():
            raise ConfigError(
                "model.transformer_impl=transformer_engine needs a CUDA GPU; "
                "use model.transformer_impl=local on CPU"
            )
        if importlib.util.find_spec("transformer_engine") is None:
            raise ConfigError(
                "model.transformer_impl=transformer_engine needs Transformer Engine "
                "(pip install 'nemo-orch[gpu]' or an NGC PyTorch container)"
            )
    if model.fp8 is not None:
        capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        if capability is None or capability < (8, 9):
            raise ConfigError("model.fp8 needs an FP8-capable GPU (Ada/Hopper or newer)")
        if model.fp8_recipe == "mxfp8" and capability < (10, 0):
            raise ConfigError(
                "model.fp8_recipe=mxfp8 needs a Blackwell GPU; use delayed or "
                "tensorwise (or blockwise on Hopper) before Blackwell"
            )


def _check_fp8_layout(model: ModelConfig, parallel: ParallelConfig) -> None:
    """FP8 constraints that involve the parallel layout (the rest are checked in ModelConfig)."""
    if model.fp8_param and not parallel.use_distributed_optimizer:
        raise ConfigError(
            "model.fp8_param needs parallel.use_distributed_optimizer=true (it "
            "keeps the FP32 main weights of the FP8 parameters)"
        )
    if model.first_last_layers_bf16:
        per_stage = model.num_layers // parallel.pp
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if getattr(model, name) > per_stage:
                raise ConfigError(
                    f"model.{name}={getattr(model, name)} exceeds the "
                    f"{per_stage} layers of a pipeline stage (counted per stage)"
                )


def _fused_softmax_available() -> bool:
    """Whether the local spec's fused masked-softmax kernels (built by Apex; NGC containers have
    them) are importable. Megatron imports them unguarded when the fusion is on, so without them
    a bf16 local-spec model on a GPU would fail in its first attention."""
    return all(
        importlib.util.find_spec(name) is not None
        for name in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda")
    )


def fp8_options(model: ModelConfig) -> dict:
    """The ``TransformerConfig`` FP8 fields (none when FP8 is off: Megatron's defaults)."""
    if model.fp8 is None:
        return {}
    return dict(
        fp8=model.fp8,
        fp8_recipe=model.fp8_recipe,
        fp8_margin=model.fp8_margin,
        fp8_amax_history_len=model.fp8_amax_history_len,
        fp8_amax_compute_algo=model.fp8_amax_compute_algo,
        fp8_param=model.fp8_param,
        fp8_wgrad=model.fp8_wgrad,
        first_last_layers_bf16=model.first_last_layers_bf16,
        num_layers_at_start_in_bf16=model.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=model.num_layers_at_end_in_bf16,
    )


def transformer_config(model: ModelConfig, parallel: ParallelConfig):
    from megatron.core.transformer import TransformerConfig

    _check_fp8_layout(model, parallel)
    on_gpu = torch.cuda.is_available()
    dtype = DTYPES[model.params_dtype]
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.layernorm_epsilon,
        qk_layernorm=model.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        sequence_parallel=parallel.sequence_parallel,
        # Weights are overwritten right after construction (seed-derived or HF state dict), but
        # Megatron only tags tensor-parallel parameters (needed for grad norms) when it initializes.
        perform_initialization=True,
        use_cpu_initialization=not on_gpu,
        # Megatron's fused SwiGLU keeps only its input for the backward pass; its Python
        # version keeps two more copies of the FFN width (measured: ~12 KB per token and layer
        # of Qwen3-0.6B).
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=False,
        masked_softmax_fusion=on_gpu and _fused_softmax_available(),
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=True,
        recompute_granularity=model.recompute_granularity,
        recompute_method="uniform" if model.recompute_granularity == "full" else None,
        recompute_num_layers=1 if model.recompute_granularity == "full" else None,
        **fp8_options(model),
    )


def tree_mask_refusal(model: ModelConfig, on_gpu: bool) -> str | None:
    """Why the model's core attention would not take a prefix-shared micro-batch's tree mask
    (None: it takes it, :class:`~nemo_orch.models.sdpa_attention.SDPAttention`, the local spec
    on CPU)."""
    if model.transformer_impl != "local":
        return "Transformer Engine's attention does not take the tree mask yet"
    if on_gpu:
        return "the local spec's fused softmax on GPUs ignores the tree mask"
    return None


def fused_local_attention(model: ModelConfig) -> bool:
    """Whether the model's core attention here is :class:`~nemo_orch.models.sdpa_attention.
    SDPAttention`, the one that takes a tree mask."""
    return tree_mask_refusal(model, on_gpu=torch.cuda.is_available()) is None


def layer_spec(model: ModelConfig):
    from megatron.core.models.gpt import gpt_layer_specs

    if model.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=model.qk_layernorm
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        qk_layernorm=model.qk_layernorm, normalization="RMSNorm"
    )
    if fused_local_attention(model):
        from nemo_orch.models.sdpa_attention import SDPAttention

        # PyTorch's fused causal attention instead of Megatron's unfused local one (3 kernels,
        # the scores kept for the backward pass): the CPU step's largest cost.
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def build_model(
    model: ModelConfig, parallel: ParallelConfig, *, pre_process: bool, post_process: bool
):
    """One pipeline stage of the policy (the whole model when pp=1). Weights are uninitialized.
    Its rotary embedding follows ``position_ids`` (:mod:`nemo_orch.models.positioned_gpt`), which
    prefix-shared micro-batches need."""
    from nemo_orch.models.positioned_gpt import PositionedGPTModel

    check_runtime(model)
    gpt = PositionedGPTModel(
        config=transformer_config(model, parallel),
        transformer_layer_spec=layer_spec(model),
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=model.share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=int(model.rotary_base),
        rotary_percent=1.0,
    )
    if model.transformer_impl == "local":
        # The local spec builds torch's RMSNorm in float32 whatever params_dtype says (Megatron-LM
        # casts whole models with its Float16Module). Left so in bf16, each norm would keep an
        # FP32 copy of its input for the backward pass and miss the fused kernel (measured on an
        # H200: 15% more activation memory).
        for module in gpt.modules():
            if isinstance(module, torch.nn.RMSNorm):
                module.to(DTYPES[model.params_dtype])
    if torch.cuda.is_available():
        gpt.cuda(torch.cuda.current_device())
    return gpt


class ValueHead(torch.nn.Module):
    """The critic's output layer in place of the vocabulary projection: one value per position
    (``[s, b]``, which ``GPTModel`` returns as ``[b, s]``), replicated over TP ranks. With
    sequence parallelism the trunk's output is gathered first; its gradient is split back, not
    reduced, as every TP rank computes the same loss on the whole sequence.

    It keeps the running mean and variance of the returns it is trained on (``grpo.ppo.
    whiten_values``) as buffers, so they are saved and resharded with its checkpoints."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool) -> None:
        super().__init__()
        # Named as the vocabulary projection's (Megatron's state dict expects an
        # output_layer.weight); zero: every value starts at the returns' mean, in any layout.
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        self.register_buffer("return_count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("return_mean", torch.zeros((), dtype=torch.float64))
        self.register_buffer("return_var", torch.ones((), dtype=torch.float64))

    def forward(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        return F.linear(hidden_states, self.weight, self.bias).squeeze(-1).float(), None


def build_critic(
    model: ModelConfig, parallel: ParallelConfig, *, pre_process: bool, post_process: bool
):
    """One pipeline stage of PPO's critic: the policy's trunk (embeddings untied: the critic
    has no vocabulary projection to tie them to) with a :class:`ValueHead` on the last stage."""
    gpt = build_model(
        dataclasses.replace(model, share_embeddings_and_output_weights=False),
        parallel,
        pre_process=pre_process,
        post_process=post_process,
    )
    if post_process:
        gpt.output_layer = ValueHead(
            model.hidden_size, DTYPES[model.params_dtype], parallel.sequence_parallel
        )
        if torch.cuda.is_available():
            gpt.output_layer.cuda(torch.cuda.current_device())
    return gpt
