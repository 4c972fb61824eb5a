"""TensorRT-LLM checkpoints of the Qwen3 policy: ``config.json`` + ``rank{r}.safetensors``.

Written from full HF tensors, one file per TP rank (``trtllm-build`` turns them into engines on a
GPU). Names follow TensorRT-LLM's Qwen model: Q/K/V concatenated per rank as ``[q; k; v]``, and
``mlp.fc`` holds HF's **gate_proj** while ``mlp.gate`` holds HF's **up_proj**.

:func:`build_engine` runs ``trtllm-build`` on such a checkpoint (``nemo-orch export --format
trtllm-engine``); :func:`engine_build_requirements` says what is missing before anything is written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from nemo_orch.config import ConfigError, ModelConfig

TRTLLM_BUILD = "trtllm-build"

_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_layernorm.weight",
    "self_attn.q_norm.weight": "attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "attention.k_layernorm.weight",
}
# (HF suffix, TRT-LLM suffix, split dim) for the row/column-parallel linears
_LINEARS = [
    ("self_attn.o_proj.weight", "attention.dense.weight", 1),
    ("mlp.gate_proj.weight", "mlp.fc.weight", 0),
    ("mlp.up_proj.weight", "mlp.gate.weight", 0),
    ("mlp.down_proj.weight", "mlp.proj.weight", 1),
]
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def trtllm_config(model: ModelConfig, tp: int, dtype: str) -> dict:
    return {
        "architecture": "Qwen3ForCausalLM",
        "qwen_type": "qwen3",
        "dtype": dtype,
        "logits_dtype": "float32",
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_size": model.kv_channels,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": model.rotary_base,
        "norm_epsilon": model.layernorm_epsilon,
        "hidden_act": "silu",
        "qk_layernorm": model.qk_layernorm,
        "tie_word_embeddings": model.share_embeddings_and_output_weights,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }


def _check_tp(model: ModelConfig, tp: int) -> None:
    for name in ("num_query_groups", "num_attention_heads", "ffn_hidden_size", "vocab_size"):
        if getattr(model, name) % tp:
            raise ValueError(
                f"TensorRT-LLM export with tp={tp}: model.{name}="
                f"{getattr(model, name)} is not divisible by {tp}"
            )


def hf_to_trtllm_shards(
    hf: Mapping[str, torch.Tensor], model: ModelConfig, tp: int
) -> list[dict[str, torch.Tensor]]:
    """One TensorRT-LLM state dict per TP rank."""
    _check_tp(model, tp)
    head = hf[
        "model.embed_tokens.weight"
        if model.share_embeddings_and_output_weights
        else "lm_head.weight"
    ]
    shards = []
    for rank in range(tp):

        def part(tensor: torch.Tensor, dim: int, rank: int = rank) -> torch.Tensor:
            return torch.chunk(tensor, tp, dim=dim)[rank].contiguous()

        shard = {
            "transformer.vocab_embedding.weight": hf["model.embed_tokens.weight"].clone(),
            "transformer.ln_f.weight": hf["model.norm.weight"].clone(),
            "lm_head.weight": part(head, 0),
        }
        for layer in range(model.num_layers):
            src, dst = f"model.layers.{layer}.", f"transformer.layers.{layer}."
            for hf_suffix, trt_suffix in _NORMS.items():
                if src + hf_suffix in hf:
                    shard[dst + trt_suffix] = hf[src + hf_suffix].clone()
            shard[dst + "attention.qkv.weight"] = torch.cat(
                [part(hf[src + f"self_attn.{p}_proj.weight"], 0) for p in "qkv"], dim=0
            )
            for hf_suffix, trt_suffix, dim in _LINEARS:
                shard[dst + trt_suffix] = part(hf[src + hf_suffix], dim)
        shards.append(shard)
    return shards


def trtllm_shards_to_hf(
    shards: list[Mapping[str, torch.Tensor]], model: ModelConfig
) -> dict[str, torch.Tensor]:
    """Full HF tensors re-assembled from the per-rank TensorRT-LLM state dicts."""
    tp = len(shards)
    q_rows = model.num_attention_heads * model.kv_channels // tp
    kv_rows = model.num_query_groups * model.kv_channels // tp
    first = shards[0]
    hf = {
        "model.embed_tokens.weight": first["transformer.vocab_embedding.weight"].clone(),
        "model.norm.weight": first["transformer.ln_f.weight"].clone(),
    }
    if not model.share_embeddings_and_output_weights:
        hf["lm_head.weight"] = torch.cat([s["lm_head.weight"] for s in shards])
    for layer in range(model.num_layers):
        src, dst = f"transformer.layers.{layer}.", f"model.layers.{layer}."
        for hf_suffix, trt_suffix in _NORMS.items():
            if src + trt_suffix in first:
                hf[dst + hf_suffix] = first[src + trt_suffix].clone()
        qkv = [
            torch.split(s[src + "attention.qkv.weight"], [q_rows, kv_rows, kv_rows]) for s in shards
        ]
        for index, name in enumerate("qkv"):
            hf[dst + f"self_attn.{name}_proj.weight"] = torch.cat([parts[index] for parts in qkv])
        for hf_suffix, trt_suffix, dim in _LINEARS:
            hf[dst + hf_suffix] = torch.cat([s[src + trt_suffix] for s in shards], dim=dim)
    return hf


def save_trtllm_checkpoint(
    directory: str | Path, hf: Mapping[str, torch.Tensor], model: ModelConfig, tp: int, dtype: str
) -> Path:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for rank, shard in enumerate(hf_to_trtllm_shards(hf, model, tp)):
        save_file(
            {k: v.to(_TORCH_DTYPES[dtype]) for k, v in shard.items()},
            str(directory / f"rank{rank}.safetensors"),
        )
    (directory / "config.json").write_text(json.dumps(trtllm_config(model, tp, dtype), indent=2))
    return directory


def load_trtllm_checkpoint(directory: str | Path) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """``(config, per-rank state dicts)`` of a TensorRT-LLM checkpoint directory."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    world = config["mapping"]["world_size"]
    return config, [load_file(str(directory / f"rank{r}.safetensors")) for r in range(world)]


class EngineBuildError(RuntimeError):
    """``trtllm-build`` ran and failed; its own output (passed through) says why."""


def engine_build_requirements() -> str:
    """The path of ``trtllm-build``, after checking that an engine can be built here at all.

    Raises one :class:`ConfigError` naming everything that is missing, so that a CPU machine (or
    one without TensorRT-LLM) fails before any checkpoint is read or written.
    """
    executable = shutil.which(TRTLLM_BUILD)
    missing = []
    if executable is None:
        missing.append(
            f"`{TRTLLM_BUILD}` on PATH (install TensorRT-LLM: pip install "
            "'nemo-orch[gpu]', or use an NGC TensorRT-LLM container)"
        )
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU (none is visible)")
    if missing:
        raise ConfigError(
            "--format trtllm-engine needs "
            + " and ".join(missing)
            + "; --format trtllm writes the TensorRT-LLM checkpoint without either"
        )
    return executable


def trtllm_build_command(
    checkpoint_dir: str | Path,
    engine_dir: str | Path,
    *,
    max_batch_size: int,
    max_seq_len: int,
    workers: int = 1,
    executable: str = TRTLLM_BUILD,
) -> list[str]:
    """The ``trtllm-build`` command line for a checkpoint written by
    :func:`save_trtllm_checkpoint`.

    ``max_seq_len`` bounds prompt + generated tokens of one request; with padding removal and
    fused attention (trtllm-build's defaults) there is no separate input-length limit to set.
    ``--gemm_plugin auto`` uses the plugin GEMMs in the checkpoint's dtype. ``workers`` builds
    that many TP ranks in parallel (one GPU each).
    """
    for name, value in (
        ("max_batch_size", max_batch_size),
        ("max_seq_len", max_seq_len),
        ("workers", workers),
    ):
        if value < 1:
            raise ConfigError(f"trtllm-build: {name} must be >= 1, got {value}")
    command = [
        executable,
        "--checkpoint_dir",
        str(checkpoint_dir),
        "--output_dir",
        str(engine_dir),
        "--gemm_plugin",
        "auto",
        "--max_batch_size",
        str(max_batch_size),
        "--max_seq_len",
        str(max_seq_len),
    ]
    if workers > 1:
        command += ["--workers", str(workers)]
    return command


def build_engine(command: Sequence[str]) -> float:
    """Run ``trtllm-build`` (its output goes to this process's terminal); the build's seconds."""
    started = time.perf_counter()
    returncode = subprocess.call(list(command))
    seconds = time.perf_counter() - started
    if returncode != 0:
        raise EngineBuildError(
            f"{TRTLLM_BUILD} exited {returncode} after {seconds:.1f} s: {' '.join(command)}"
        )
    return seconds
