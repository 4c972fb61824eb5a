"""``model.*``, ``parallel.*``, ``tokenizer.*``: the architecture, its layout, the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nemo_orch.config.base import _require, _require_file


@dataclass
class ModelConfig:
    """Qwen3 architecture (field names as in Megatron-Core/NeMo) and its implementation choices.

    HF ``Qwen3Config`` equivalents: num_hidden_layers=num_layers, num_key_value_heads=
    num_query_groups, head_dim=kv_channels, intermediate_size=ffn_hidden_size, rope_theta=
    rotary_base, rms_norm_eps=layernorm_epsilon, tie_word_embeddings=
    share_embeddings_and_output_weights.

    FP8 (Transformer Engine on Ada/Hopper or newer; fields as in megatron-core 0.16.1's
    ``TransformerConfig``): ``fp8`` picks the formats (``hybrid``: E4M3 forward, E5M2 gradients),
    ``fp8_recipe`` the scaling (``delayed``: scales from an amax history of
    ``fp8_amax_history_len`` steps reduced by ``fp8_amax_compute_algo``, with ``fp8_margin``;
    ``tensorwise``: per-tensor current scaling; ``blockwise``: 128-element block scales;
    ``mxfp8``: Blackwell only). ``fp8_param`` keeps the GEMM weights themselves in FP8 (half the
    weight memory, FP8 parameter all-gathers; FP32 main weights live in the distributed
    optimizer). ``fp8_wgrad=false`` computes weight gradients in high precision.
    ``first_last_layers_bf16`` keeps the first ``num_layers_at_start_in_bf16`` and last
    ``num_layers_at_end_in_bf16`` layers (of each pipeline stage) out of FP8, which Megatron
    does not support with the delayed recipe. A Hopper FP8 run of the 0.6B preset, for example:
    ``model=qwen3-0.6b model.fp8=hybrid model.fp8_recipe=tensorwise``.
    """

    # The preset's name (conf/model/<preset>.yaml), as `nemo-orch plan` reports it.
    preset: str = "micro"
    # Transformer layers (HF num_hidden_layers).
    num_layers: int = 4
    # Width of the residual stream.
    hidden_size: int = 128
    # Query heads per layer.
    num_attention_heads: int = 4
    # Key/value heads (grouped-query attention; HF num_key_value_heads).
    num_query_groups: int = 2
    # Width of one attention head (HF head_dim).
    kv_channels: int = 32
    # Width of the SwiGLU MLP (HF intermediate_size).
    ffn_hidden_size: int = 512
    # Rows of the embedding and output layers; at least the tokenizer's vocabulary.
    vocab_size: int = 2048
    # The longest sequence the model takes (RoPE positions).
    max_position_embeddings: int = 1024
    # RoPE's base (HF rope_theta).
    rotary_base: float = 1_000_000.0
    # RMSNorm's epsilon (HF rms_norm_eps).
    layernorm_epsilon: float = 1e-6
    # RMSNorm on each head's queries and keys (Qwen3's QK-norm).
    qk_layernorm: bool = True
    # Tie the output layer to the input embedding (HF tie_word_embeddings).
    share_embeddings_and_output_weights: bool = False
    # Standard deviation of the random initial weights (HF initializer_range).
    init_method_std: float = 0.02
    # The parameters' dtype: float32, bfloat16 or float16.
    params_dtype: str = "float32"
    # Megatron's layer spec: `local` (plain PyTorch, the CPU path) or `transformer_engine` (GPU,
    # FP8).
    transformer_impl: str = "local"
    fp8: Optional[str] = None
    fp8_recipe: str = "delayed"
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"
    fp8_margin: int = 0
    fp8_param: bool = False
    fp8_wgrad: bool = True
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    # Activation recomputation: null (none), `selective` (attention) or `full` (every layer's, one
    # at a time).
    recompute_granularity: Optional[str] = None

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "ffn_hidden_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            _require(getattr(self, name) > 0, f"model.{name} must be positive")
        _require(
            self.num_attention_heads % self.num_query_groups == 0,
            "model.num_attention_heads must be a multiple of model.num_query_groups",
        )
        _require(
            self.params_dtype in ("float32", "bfloat16", "float16"),
            f"model.params_dtype must be float32|bfloat16|float16, got {self.params_dtype!r}",
        )
        _require(
            self.transformer_impl in ("local", "transformer_engine"),
            f"model.transformer_impl must be local|transformer_engine, "
            f"got {self.transformer_impl!r}",
        )
        _require(
            self.fp8 in (None, "hybrid", "e4m3"),
            f"model.fp8 must be null|hybrid|e4m3, got {self.fp8!r}",
        )
        _require(
            self.fp8 is None or self.transformer_impl == "transformer_engine",
            "model.fp8 requires model.transformer_impl=transformer_engine",
        )
        _require(
            self.fp8_recipe in ("delayed", "tensorwise", "blockwise", "mxfp8"),
            f"model.fp8_recipe must be delayed|tensorwise|blockwise|mxfp8, got {self.fp8_recipe!r}",
        )
        self._check_fp8_options()
        _require(
            self.recompute_granularity in (None, "full", "selective"),
            "model.recompute_granularity must be null|full|selective",
        )

    def _check_fp8_options(self) -> None:
        """What megatron-core / Transformer Engine would reject later (at build time or in the
        first forward pass, with less helpful messages), checked when the config is loaded."""
        _require(
            self.fp8_amax_compute_algo in ("max", "most_recent"),
            f"model.fp8_amax_compute_algo must be max|most_recent, "
            f"got {self.fp8_amax_compute_algo!r}",
        )
        _require(self.fp8_amax_history_len >= 1, "model.fp8_amax_history_len must be >= 1")
        _require(self.fp8_margin >= 0, "model.fp8_margin must be >= 0")
        for name in ("fp8_param", "first_last_layers_bf16"):
            _require(
                not getattr(self, name) or self.fp8 is not None,
                f"model.{name} requires model.fp8 (hybrid|e4m3)",
            )
        _require(
            self.fp8_wgrad or self.fp8 is not None,
            "model.fp8_wgrad=false requires model.fp8 (hybrid|e4m3)",
        )
        # The distributed optimizer keeps FP32 main weights only for 16-bit models; FP8 weights of
        # an FP32 model would be updated in place, in FP8.
        _require(
            not self.fp8_param or self.params_dtype in ("bfloat16", "float16"),
            "model.fp8_param requires model.params_dtype=bfloat16|float16",
        )
        _require(
            not self.first_last_layers_bf16 or self.fp8_recipe != "delayed",
            "model.first_last_layers_bf16 is not supported with model.fp8_recipe=delayed "
            "(use tensorwise|blockwise|mxfp8)",
        )
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            _require(
                0 <= getattr(self, name) <= self.num_layers,
                f"model.{name} must be in [0, model.num_layers]",
            )
        if self.fp8 is not None:
            # TE's FP8 GEMMs need every weight's input dimension to be a multiple of 16.
            for name, size in (
                ("hidden_size", self.hidden_size),
                ("ffn_hidden_size", self.ffn_hidden_size),
                ("num_attention_heads * kv_channels", self.num_attention_heads * self.kv_channels),
            ):
                _require(
                    size % 16 == 0,
                    f"model.fp8 needs model.{name} to be a multiple of 16, got {size}",
                )

    def num_parameters(self) -> int:
        """Parameter count of the unsharded model."""
        h, q, kv = self.hidden_size, self.num_attention_heads, self.num_query_groups
        d = self.kv_channels
        attention = h * (q + 2 * kv) * d + q * d * h + (2 * d if self.qk_layernorm else 0)
        mlp = 3 * h * self.ffn_hidden_size
        layer = attention + mlp + 2 * h
        embeddings = self.vocab_size * h * (1 if self.share_embeddings_and_output_weights else 2)
        return self.num_layers * layer + embeddings + h


@dataclass
class ParallelConfig:
    """Megatron parallel sizes; world size must equal tp * pp * dp."""

    # Tensor-parallel size.
    tp: int = 1
    # Pipeline-parallel size; divides model.num_layers.
    pp: int = 1
    # Data-parallel size.
    dp: int = 1
    # Shard the activations outside attention and MLP along the sequence over the TP ranks
    # (Transformer Engine only).
    sequence_parallel: bool = False
    # Shard the optimizer's state (and FP32 main weights) over the data-parallel ranks.
    use_distributed_optimizer: bool = True

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            _require(getattr(self, name) >= 1, f"parallel.{name} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


# The keys of nemo_orch.models.tokenizer.CHAT_TEMPLATES (not imported here: transformers is heavy).
CHAT_FORMATS = ("qwen3", "compact")


@dataclass
class TokenizerConfig:
    """``path`` points at an HF tokenizer directory (e.g. a real Qwen3 one, which uses the
    ``qwen3`` chat format); null trains a BPE tokenizer on the training data into the run
    directory, saved with ``chat_format`` (``compact`` lists tools as signatures, not JSON
    schemas: sequences a third as long for a model trained from scratch)."""

    path: Optional[str] = None
    # Size of the BPE vocabulary trained for the run (path null).
    vocab_size: int = 2000
    # A pair merges into a BPE token only if it occurs at least this often (path null).
    min_frequency: int = 2
    chat_format: str = "compact"

    def __post_init__(self) -> None:
        _require_file(self.path, "tokenizer.path")
        _require(self.vocab_size >= 512, "tokenizer.vocab_size must be >= 512")
        _require(
            self.chat_format in CHAT_FORMATS, f"tokenizer.chat_format must be one of {CHAT_FORMATS}"
        )
