"""``nemo-orch export`` and ``nemo-orch import``: checkpoints to and from HF / TensorRT-LLM.

Both run in one process: distributed checkpoints are layout-agnostic, so whatever TP/PP layout
trained the policy, it is read here as a single unsharded model. :func:`export_engine` goes one
step further on a GPU machine: a TensorRT-LLM checkpoint, then ``trtllm-build`` on it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from nemo_orch import config as config_lib
from nemo_orch import distributed
from nemo_orch.config import Config, ConfigError, ParallelConfig
from nemo_orch.models import checkpoint, qwen3, trtllm, weights
from nemo_orch.models.hf_mapping import (HFCheckpoint, load_hf_checkpoint_config,
                                         model_config_from_hf, save_hf_checkpoint)

EXPORT_FORMATS = ("hf", "trtllm")
# The largest batch a built engine schedules: a GRPO step's rollouts (tasks x group size).
DEFAULT_ENGINE_MAX_BATCH_SIZE = 256
EXPORT_MANIFEST = "nemo_orch_export.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja")


def checkpoint_config(ckpt: checkpoint.Checkpoint, overrides: list[str] = ()) -> Config:
    """The config a checkpoint was trained with, as one process, with overrides applied."""
    if not ckpt.config_path.exists():
        raise checkpoint.CheckpointError(f"{ckpt.path}: missing {checkpoint.CONFIG_FILE}")
    return config_lib.load_saved(ckpt.config_path, ["parallel.tp=1", "parallel.pp=1",
                                                    "parallel.dp=1", *overrides])


def _copy_tokenizer(source: Path, out: Path) -> None:
    for name in _TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, out / name)


def export(checkpoint_path: str, fmt: str, out: str, *, tp: int = 1, dtype: str | None = None,
           overrides: list[str] = ()) -> Path:
    """Write an HF directory or a TensorRT-LLM checkpoint (``tp`` rank files) from a checkpoint."""
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"--format must be one of {'|'.join(EXPORT_FORMATS)}, got {fmt!r}")
    ckpt = checkpoint.open_checkpoint(checkpoint_path)
    config = checkpoint_config(ckpt, overrides)
    dtype = _resolve_dtype(config, dtype)
    with distributed.parallel_session(ParallelConfig(), config.run.seed):
        module = qwen3.build_model(config.model, config.parallel, pre_process=True,
                                   post_process=True)
        checkpoint.load(ckpt, module)
        hf = weights.gather_hf_weights(module, config.model)
    out_dir = Path(out)
    if fmt == "hf":
        save_hf_checkpoint(out_dir, hf, config.model, dtype=qwen3.DTYPES[dtype])
    else:
        trtllm.save_trtllm_checkpoint(out_dir, hf, config.model, tp=tp, dtype=dtype)
    if ckpt.tokenizer_path.is_dir():
        _copy_tokenizer(ckpt.tokenizer_path, out_dir)
    (out_dir / EXPORT_MANIFEST).write_text(json.dumps(
        {"source": str(ckpt.path), "step": ckpt.step, "format": fmt, "dtype": dtype, "tp": tp}))
    return out_dir


def _resolve_dtype(config: Config, dtype: str | None) -> str:
    dtype = dtype or config.model.params_dtype
    if dtype not in qwen3.DTYPES:
        raise ConfigError(f"--dtype must be one of {'|'.join(qwen3.DTYPES)}, got {dtype!r}")
    return dtype


@dataclass(frozen=True)
class EngineExport:
    """Where ``export_engine`` wrote, and how long ``trtllm-build`` took."""

    checkpoint_dir: Path
    engine_dir: Path
    build_seconds: float


def export_engine(checkpoint_path: str, out: str, *, tp: int = 1, dtype: str | None = None,
                  max_batch_size: int = DEFAULT_ENGINE_MAX_BATCH_SIZE,
                  max_seq_len: int | None = None, overrides: list[str] = ()) -> EngineExport:
    """A TensorRT-LLM checkpoint in ``out/checkpoint`` and its engine in ``out/engine``.

    Everything that can be checked up front (``trtllm-build`` on PATH, a CUDA GPU, the build
    options) is checked before anything is written. ``max_seq_len`` defaults to the model's
    ``max_position_embeddings``. The engine directory gets the tokenizer too, so it is all a
    TensorRT-LLM runtime needs.
    """
    executable = trtllm.engine_build_requirements()
    ckpt = checkpoint.open_checkpoint(checkpoint_path)
    config = checkpoint_config(ckpt, overrides)
    dtype = _resolve_dtype(config, dtype)
    max_seq_len = max_seq_len or config.model.max_position_embeddings
    if max_seq_len > config.model.max_position_embeddings:
        raise ConfigError(f"--max-seq-len {max_seq_len} exceeds the model's "
                          f"max_position_embeddings ({config.model.max_position_embeddings})")
    out_dir = Path(out)
    checkpoint_dir, engine_dir = out_dir / "checkpoint", out_dir / "engine"
    command = trtllm.trtllm_build_command(
        checkpoint_dir, engine_dir, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
        workers=min(tp, max(torch.cuda.device_count(), 1)), executable=executable)
    export(checkpoint_path, "trtllm", str(checkpoint_dir), tp=tp, dtype=dtype,
           overrides=overrides)
    seconds = trtllm.build_engine(command)
    if ckpt.tokenizer_path.is_dir():
        _copy_tokenizer(ckpt.tokenizer_path, engine_dir)
    (out_dir / EXPORT_MANIFEST).write_text(json.dumps(
        {"source": str(ckpt.path), "step": ckpt.step, "format": "trtllm-engine", "dtype": dtype,
         "tp": tp, "max_batch_size": max_batch_size, "max_seq_len": max_seq_len,
         "build_seconds": round(seconds, 3), "command": command}))
    return EngineExport(checkpoint_dir, engine_dir, seconds)


def import_hf(hf_dir: str, out: str, overrides: list[str] = ()) -> Path:
    """A model-only nemo-orch checkpoint (``step_0``) from an HF Qwen3 directory, with the
    model fields taken from its ``config.json``; train from it with ``trainer.init_from``."""
    hf_config = load_hf_checkpoint_config(hf_dir)
    base = config_lib.load(["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", *overrides])
    model = model_config_from_hf(hf_config, base.model)
    source = Path(hf_dir)
    tokenizer_dir = source if (source / "tokenizer.json").exists() else None
    config = config_lib.replace(base, model=model,
                                tokenizer=config_lib.TokenizerConfig(
                                    path=str(source) if tokenizer_dir else None))
    hf = HFCheckpoint(hf_dir)
    with distributed.parallel_session(config.parallel, config.run.seed):
        module = qwen3.build_model(config.model, config.parallel, pre_process=True,
                                   post_process=True)
        weights.load_hf_weights(module, hf, config.model)
        return checkpoint.save(config, 0, module, tokenizer_dir=tokenizer_dir,
                               directory=Path(out))
