"""Qwen3 weights between Hugging Face and Megatron-Core, for any TP/PP layout.

HF tensors are full; a Megatron rank holds its pipeline stage's layers (local indices) and its
tensor-parallel slice. Megatron fuses Q/K/V per query group (``[q heads of group g; k_g; v_g]``
for each group) and gate/up as ``[gate; up]`` per TP rank, so both are sliced before fusing.
Slices are made contiguous: a non-contiguous view sent over gloo carries the wrong bytes.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nemo_orch.config import ConfigError, ModelConfig

if TYPE_CHECKING:  # the tokenizer module loads transformers
    from nemo_orch.models.tokenizer import SpecialTokenIds

HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SAFETENSORS_WEIGHTS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# huggingface_hub's sharding default; transformers 5's save_pretrained default (50GB) would
# leave an 8B model in one 16 GB file.
DEFAULT_MAX_SHARD_SIZE = "5GB"
_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


@dataclass(frozen=True)
class Layout:
    """Where one rank sits: its TP slice and its pipeline stage's layers."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0

    def layers(self, num_layers: int) -> range:
        """Global indices of this stage's layers (local index = position in the range)."""
        per_stage = num_layers // self.pp_size
        return range(self.pp_rank * per_stage, (self.pp_rank + 1) * per_stage)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def _layer_names(transformer_impl: str) -> dict[str, str]:
    """Megatron per-layer suffix for each HF per-layer suffix (norms and plain linears)."""
    fused_norms = transformer_impl == "transformer_engine"
    return {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"
        if fused_norms
        else "input_layernorm.weight",
        "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"
        if fused_norms
        else "pre_mlp_layernorm.weight",
        "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
        "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    }


def hf_parameter_names(model: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not model.share_embeddings_and_output_weights:
        names.append("lm_head.weight")
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    if model.qk_layernorm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    names += [f"model.layers.{i}.{s}" for i in range(model.num_layers) for s in per_layer]
    return names


def hf_parameter_shape(model: ModelConfig, name: str) -> tuple[int, ...]:
    h, d, f = model.hidden_size, model.kv_channels, model.ffn_hidden_size
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    shapes = {
        "embed_tokens.weight": (model.vocab_size, h),
        "lm_head.weight": (model.vocab_size, h),
        "q_proj.weight": (q, h),
        "k_proj.weight": (kv, h),
        "v_proj.weight": (kv, h),
        "o_proj.weight": (h, q),
        "gate_proj.weight": (f, h),
        "up_proj.weight": (f, h),
        "down_proj.weight": (h, f),
        "q_norm.weight": (d,),
        "k_norm.weight": (d,),
    }
    suffix = ".".join(name.split(".")[-2:])
    return shapes.get(suffix, (h,))  # every other parameter is a hidden-size norm


class SeededHFWeights(Mapping[str, torch.Tensor]):
    """Initial weights in HF naming, each drawn from its own seed (run seed + name).

    Generated on access, so a pipeline stage only draws its own layers, and every TP/PP layout
    starts from the same full weights. Output projections use std / sqrt(2 * num_layers), as
    Megatron's ``output_layer_init_method`` does.
    """

    def __init__(self, model: ModelConfig, seed: int) -> None:
        self._model = model
        self._seed = seed
        self._names = hf_parameter_names(model)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        shape = hf_parameter_shape(self._model, name)
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        std = self._model.init_method_std
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std /= (2.0 * self._model.num_layers) ** 0.5
        generator = torch.Generator().manual_seed(
            self._seed * 1_000_003 + zlib.crc32(name.encode())
        )
        return torch.randn(shape, generator=generator) * std

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _tp_chunk(tensor: torch.Tensor, layout: Layout, dim: int) -> torch.Tensor:
    return torch.chunk(tensor, layout.tp_size, dim=dim)[layout.tp_rank].contiguous()


def _fuse_qkv(
    model: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout
) -> torch.Tensor:
    d, groups = model.kv_channels, model.num_query_groups
    heads_per_group = model.num_attention_heads // groups
    hidden = q.shape[-1]
    q = q.view(groups, heads_per_group * d, hidden)
    k, v = k.view(groups, d, hidden), v.view(groups, d, hidden)
    fused = torch.cat([q, k, v], dim=1)  # [groups, (heads_per_group + 2) * d, hidden]
    return _tp_chunk(fused, layout, dim=0).reshape(-1, hidden)


def _split_qkv(model: ModelConfig, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`_fuse_qkv` for one TP rank's slice (its share of the query groups)."""
    d = model.kv_channels
    heads_per_group = model.num_attention_heads // model.num_query_groups
    hidden = fused.shape[-1]
    fused = fused.view(-1, (heads_per_group + 2) * d, hidden)
    q, k, v = torch.split(fused, [heads_per_group * d, d, d], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor],
    model: ModelConfig,
    layout: Layout,
    transformer_impl: str | None = None,
) -> dict[str, torch.Tensor]:
    """The state dict of one Megatron rank, cut from full HF tensors (read lazily by key)."""
    impl = transformer_impl or model.transformer_impl
    tied = model.share_embeddings_and_output_weights
    out: dict[str, torch.Tensor] = {}
    if layout.is_first_stage:
        out["embedding.word_embeddings.weight"] = _tp_chunk(
            hf["model.embed_tokens.weight"], layout, 0
        )
    for local, layer in enumerate(layout.layers(model.num_layers)):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        for hf_suffix, mg_suffix in _layer_names(impl).items():
            if hf_suffix.startswith("self_attn.") and not model.qk_layernorm:
                continue
            out[dst + mg_suffix] = hf[src + hf_suffix].clone()
        out[dst + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            model,
            hf[src + "self_attn.q_proj.weight"],
            hf[src + "self_attn.k_proj.weight"],
            hf[src + "self_attn.v_proj.weight"],
            layout,
        )
        out[dst + "self_attention.linear_proj.weight"] = _tp_chunk(
            hf[src + "self_attn.o_proj.weight"], layout, 1
        )
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [
                _tp_chunk(hf[src + "mlp.gate_proj.weight"], layout, 0),
                _tp_chunk(hf[src + "mlp.up_proj.weight"], layout, 0),
            ],
            dim=0,
        )
        out[dst + "mlp.linear_fc2.weight"] = _tp_chunk(hf[src + "mlp.down_proj.weight"], layout, 1)
    if layout.is_last_stage:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        # With tied embeddings and pp == 1 the output layer reuses the embedding parameter.
        if not tied or not layout.is_first_stage:
            head = hf["model.embed_tokens.weight" if tied else "lm_head.weight"]
            out["output_layer.weight"] = _tp_chunk(head, layout, 0)
    return out


def megatron_layer_to_hf(
    stage: list[Mapping[str, torch.Tensor]],
    local: int,
    layer: int,
    model: ModelConfig,
    transformer_impl: str | None = None,
) -> dict[str, torch.Tensor]:
    """Full HF tensors of global decoder layer ``layer`` from one pipeline stage's state dicts
    (``stage[tp_rank]``), where it is layer ``local``."""
    impl = transformer_impl or model.transformer_impl
    src, dst = f"decoder.layers.{local}.", f"model.layers.{layer}."
    hf: dict[str, torch.Tensor] = {}

    def cat(key: str, dim: int) -> torch.Tensor:
        return torch.cat([shard[src + key] for shard in stage], dim=dim)

    for hf_suffix, mg_suffix in _layer_names(impl).items():
        if hf_suffix.startswith("self_attn.") and not model.qk_layernorm:
            continue
        hf[dst + hf_suffix] = stage[0][src + mg_suffix].clone()
    per_rank = [
        _split_qkv(model, shard[src + "self_attention.linear_qkv.weight"]) for shard in stage
    ]
    for index, name in enumerate(("q_proj", "k_proj", "v_proj")):
        hf[dst + f"self_attn.{name}.weight"] = torch.cat([p[index] for p in per_rank])
    hf[dst + "self_attn.o_proj.weight"] = cat("self_attention.linear_proj.weight", 1)
    gate_up = [torch.chunk(shard[src + "mlp.linear_fc1.weight"], 2, dim=0) for shard in stage]
    hf[dst + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in gate_up])
    hf[dst + "mlp.up_proj.weight"] = torch.cat([u for _, u in gate_up])
    hf[dst + "mlp.down_proj.weight"] = cat("mlp.linear_fc2.weight", 1)
    return hf


def megatron_embedding_to_hf(
    first_stage: list[Mapping[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """The full HF embeddings from the first pipeline stage's state dicts (``[tp_rank]``)."""
    return {
        "model.embed_tokens.weight": torch.cat(
            [shard["embedding.word_embeddings.weight"] for shard in first_stage]
        )
    }


def megatron_head_to_hf(
    last_stage: list[Mapping[str, torch.Tensor]], model: ModelConfig
) -> dict[str, torch.Tensor]:
    """The full HF final norm and (untied) LM head from the last pipeline stage's state dicts
    (``[tp_rank]``)."""
    hf = {"model.norm.weight": last_stage[0]["decoder.final_layernorm.weight"].clone()}
    if not model.share_embeddings_and_output_weights:
        hf["lm_head.weight"] = torch.cat([shard["output_layer.weight"] for shard in last_stage])
    return hf


def megatron_ends_to_hf(
    first_stage: list[Mapping[str, torch.Tensor]],
    last_stage: list[Mapping[str, torch.Tensor]],
    model: ModelConfig,
) -> dict[str, torch.Tensor]:
    """Full HF embeddings, final norm and (untied) LM head from the first and last pipeline
    stages' state dicts (``stage[tp_rank]``)."""
    return megatron_embedding_to_hf(first_stage) | megatron_head_to_hf(last_stage, model)


def megatron_to_hf(
    stages: list[list[Mapping[str, torch.Tensor]]],
    model: ModelConfig,
    transformer_impl: str | None = None,
) -> dict[str, torch.Tensor]:
    """Full HF tensors from every rank's state dict, ``stages[pp_rank][tp_rank]``."""
    pp_size, tp_size = len(stages), len(stages[0])
    hf = megatron_ends_to_hf(stages[0], stages[-1], model)
    for pp_rank, stage in enumerate(stages):
        layout = Layout(tp_size=tp_size, pp_size=pp_size, pp_rank=pp_rank)
        for local, layer in enumerate(layout.layers(model.num_layers)):
            hf.update(megatron_layer_to_hf(stage, local, layer, model, transformer_impl))
    return hf


def hf_config_dict(
    model: ModelConfig,
    torch_dtype: str | None = None,
    special_tokens: SpecialTokenIds | None = None,
) -> dict:
    """``config.json`` of the equivalent ``Qwen3ForCausalLM``, with the bos and eos ids of the
    tokenizer's ``special_tokens`` as Qwen3's own has them.

    No ``pad_token_id``, as in Qwen3's: transformers makes it the embedding's ``padding_idx``,
    whose row then never trains when the model is fine-tuned there. It is in
    :func:`generation_config_dict`.
    """
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "num_hidden_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.kv_channels,
        "intermediate_size": model.ffn_hidden_size,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "rope_theta": model.rotary_base,
        "rms_norm_eps": model.layernorm_epsilon,
        "tie_word_embeddings": model.share_embeddings_and_output_weights,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": model.init_method_std,
        "use_cache": True,
        "torch_dtype": torch_dtype or model.params_dtype,
    }
    if special_tokens is not None:
        config |= {
            "bos_token_id": special_tokens.end_of_text,
            "eos_token_id": special_tokens.end_of_turn,
        }
    return config


def generation_config_dict(special_tokens: SpecialTokenIds) -> dict:
    """``generation_config.json`` as Qwen3's, without its sampling defaults: generation stops at
    ``<|im_end|>`` (or ``<|endoftext|>``) and pads with ``<|endoftext|>``."""
    return {
        "bos_token_id": special_tokens.end_of_text,
        "eos_token_id": [special_tokens.end_of_turn, special_tokens.end_of_text],
        "pad_token_id": special_tokens.end_of_text,
    }


def build_hf_model(model: ModelConfig, attn_implementation: str | None = None) -> torch.nn.Module:
    """transformers' ``Qwen3ForCausalLM`` for ``model`` (float32, freshly initialised: load
    weights into it next)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {
        key: value
        for key, value in hf_config_dict(model).items()
        if key not in ("architectures", "model_type", "torch_dtype")
    }
    if attn_implementation is not None:
        fields["attn_implementation"] = attn_implementation
    return Qwen3ForCausalLM(Qwen3Config(**fields))


ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "vocab_size",
    "rotary_base",
    "layernorm_epsilon",
    "qk_layernorm",
    "share_embeddings_and_output_weights",
)


def architecture_mismatch(a: ModelConfig, b: ModelConfig) -> list[str]:
    """``field: a != b`` for each architecture field on which two model configs differ."""
    return [
        f"{name}: {getattr(a, name)} != {getattr(b, name)}"
        for name in ARCHITECTURE_FIELDS
        if getattr(a, name) != getattr(b, name)
    ]


def model_config_from_hf(hf_config: Mapping, base: ModelConfig) -> ModelConfig:
    """Our model config for an HF Qwen3 ``config.json``; implementation fields come from base."""
    from dataclasses import replace

    if hf_config.get("model_type") != "qwen3":
        raise ValueError(
            f"expected an HF Qwen3 config (model_type 'qwen3'), got {hf_config.get('model_type')!r}"
        )
    rope = hf_config.get("rope_theta") or hf_config.get("rope_parameters", {}).get("rope_theta")
    return replace(
        base,
        preset=f"hf:{hf_config.get('_name_or_path', 'qwen3')}",
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hf_config["hidden_size"],
        num_attention_heads=hf_config["num_attention_heads"],
        num_query_groups=hf_config["num_key_value_heads"],
        kv_channels=hf_config.get("head_dim")
        or hf_config["hidden_size"] // hf_config["num_attention_heads"],
        ffn_hidden_size=hf_config["intermediate_size"],
        vocab_size=hf_config["vocab_size"],
        max_position_embeddings=hf_config["max_position_embeddings"],
        rotary_base=float(rope),
        layernorm_epsilon=hf_config["rms_norm_eps"],
        qk_layernorm=True,
        share_embeddings_and_output_weights=bool(hf_config.get("tie_word_embeddings", False)),
    )


def load_hf_checkpoint_config(directory: str | Path) -> dict:
    path = Path(directory) / HF_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: not an HF checkpoint (no {HF_CONFIG})")
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None


class HFCheckpoint(Mapping[str, torch.Tensor]):
    """An HF safetensors directory read lazily, tensor by tensor (single file or sharded)."""

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        self.directory = Path(directory)
        self.config = load_hf_checkpoint_config(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.directory}: no *.safetensors weights")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where: dict[str, Callable[[str], torch.Tensor]] = {}
        for handle in self._handles:
            for key in handle.keys():
                self._where[key] = handle.get_tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name](name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def parse_size(size: int | str) -> int:
    """Bytes from a byte count or a size with HF's decimal units (``"5GB"``: 5 * 10**9, as
    ``max_shard_size`` reads it) or binary ones (``"512MiB"``)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
    value = int(float(match[1]) * _SIZE_UNITS[(match[2] or "B").upper()]) if match else 0
    if value <= 0:
        raise ConfigError(
            f"max shard size must be a positive size like 5GB, 500MiB or a byte count, got {size!r}"
        )
    return value


class _ShardWriter:
    """Safetensors shards filled in order, each written as soon as it is full.

    HF's rule (``huggingface_hub.split_torch_state_dict_into_shards``): a tensor that would
    push the current shard past the limit starts the next one, so one larger than the limit gets
    a shard of its own. Shards get their final names (``-of-N``) once N is known.
    """

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self.total_size = self.total_parameters = 0
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._written: list[list[str]] = []  # tensor names of each shard written so far

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._shard and self._shard_bytes + size > self.max_bytes:
            self._flush()
        self._shard[name] = tensor
        self._shard_bytes += size
        self.total_size += size
        self.total_parameters += tensor.numel()

    def _partial(self, index: int) -> Path:
        return self.directory / f"model-{index + 1:05d}.safetensors.partial"

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self._shard, str(self._partial(len(self._written))), metadata={"format": "pt"})
        self._written.append(list(self._shard))
        self._shard, self._shard_bytes = {}, 0

    def close(self) -> None:
        """Write the last shard, name every shard and, when there are several, the index."""
        if self._shard:
            self._flush()
        count = len(self._written)
        if count == 1:  # HF writes no index for a model that fits one shard
            self._partial(0).rename(self.directory / SAFETENSORS_WEIGHTS)
            return
        weight_map = {}
        for index, names in enumerate(self._written):
            file = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            self._partial(index).rename(self.directory / file)
            weight_map.update(dict.fromkeys(names, file))
        index = {
            "metadata": {"total_parameters": self.total_parameters, "total_size": self.total_size},
            "weight_map": weight_map,
        }
        (self.directory / SAFETENSORS_INDEX).write_text(
            json.dumps(index, indent=2, sort_keys=True) + "\n"
        )


def write_hf_checkpoint(
    directory: str | Path,
    groups: Iterable[Mapping[str, torch.Tensor]],
    model: ModelConfig,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    special_tokens: SpecialTokenIds | None = None,
) -> Path:
    """Write ``config.json`` + safetensors weights loadable by ``Qwen3ForCausalLM``, as HF's
    ``save_pretrained`` lays them out: ``model.safetensors`` when the weights fit one shard of
    ``max_shard_size``, else ``model-0000i-of-0000N.safetensors`` and
    ``model.safetensors.index.json``.

    ``groups`` are taken one at a time (a generator can read each from disk as it is asked for),
    so memory holds one group and the shard being filled, never the whole model.

    With the ``special_tokens`` of the tokenizer going with the weights, ``config.json`` names
    them and ``generation_config.json`` is written, so that ``generate()`` stops at the end of a
    turn; without, neither has token ids.
    """
    max_bytes = parse_size(max_shard_size)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # A previous export's weights (single file, shards, index) would be read along with these,
    # and its generation config would name its tokenizer's ids.
    for stale in [*directory.glob("model*.safetensors*"), directory / GENERATION_CONFIG]:
        stale.unlink(missing_ok=True)
    shards = _ShardWriter(directory, max_bytes)
    dtype_name = None
    for group in groups:
        for name, tensor in group.items():
            tensor = (tensor.to(dtype) if dtype else tensor).contiguous()
            dtype_name = dtype_name or str(tensor.dtype).removeprefix("torch.")
            shards.add(name, tensor)
        del group  # freed, but for the shard still filling, before the next one is built
    shards.close()
    (directory / HF_CONFIG).write_text(
        json.dumps(hf_config_dict(model, dtype_name, special_tokens), indent=2)
    )
    if special_tokens is not None:
        (directory / GENERATION_CONFIG).write_text(
            json.dumps(generation_config_dict(special_tokens), indent=2)
        )
    return directory


def save_hf_checkpoint(
    directory: str | Path,
    weights: Mapping[str, torch.Tensor],
    model: ModelConfig,
    dtype: torch.dtype | None = None,
    special_tokens: SpecialTokenIds | None = None,
) -> Path:
    """:func:`write_hf_checkpoint` of one mapping of weights, at the default shard size."""
    return write_hf_checkpoint(
        directory, [weights], model, dtype=dtype, special_tokens=special_tokens
    )
