"""``nemo-orch export`` and ``nemo-orch import``: checkpoints to and from HF / TensorRT-LLM.

Both run in one process: distributed checkpoints are layout-agnostic, so whatever TP/PP layout
trained the policy, it is read here as a single unsharded model, by export a decoder layer at a
time (:func:`hf_weight_groups`). :func:`export_engine` goes one step further on a GPU machine: a
TensorRT-LLM checkpoint, then ``trtllm-build`` on it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from nemo_orch import config as config_lib
from nemo_orch import distributed
from nemo_orch.config import Config, ConfigError, ModelConfig
from nemo_orch.models import checkpoint, qwen3, trtllm, weights
from nemo_orch.models.hf_mapping import (
    DEFAULT_MAX_SHARD_SIZE,
    HFCheckpoint,
    hf_parameter_shape,
    load_hf_checkpoint_config,
    megatron_ends_to_hf,
    megatron_layer_to_hf,
    model_config_from_hf,
    write_hf_checkpoint,
)
from nemo_orch.models.tokenizer import copy_tokenizer, load_tokenizer, special_token_ids

log = logging.getLogger(__name__)

EXPORT_FORMATS = ("hf", "trtllm")
# The largest batch a built engine schedules: a GRPO step's rollouts (tasks x group size).
DEFAULT_ENGINE_MAX_BATCH_SIZE = 256
EXPORT_MANIFEST = "nemo_orch_export.json"


def checkpoint_config(ckpt: checkpoint.Checkpoint, overrides: list[str] = ()) -> Config:
    """The config to use a checkpoint with, from any working directory, as one process: the
    defaults with the checkpoint's own ``model`` and ``tokenizer`` sections, the tokenizer read
    from the copy inside the checkpoint, then ``overrides``.

    The rest of the saved config records how the checkpoint was trained (data, starting weights,
    run directory), in paths relative to the directory that trained it: none of it is needed to
    use the weights, so none of it has to exist where they are used.
    """
    if not ckpt.config_path.exists():
        raise checkpoint.CheckpointError(f"{ckpt.path}: missing {checkpoint.CONFIG_FILE}")
    try:
        saved = OmegaConf.load(ckpt.config_path)
        sections = {"model": saved.model, "tokenizer": saved.tokenizer}
    except Exception as error:  # a YAML or key error of any kind
        raise checkpoint.CheckpointError(
            f"{ckpt.config_path}: no readable model and tokenizer sections ({error})"
        ) from None
    if ckpt.tokenizer_path.is_dir():
        sections["tokenizer"].path = str(ckpt.tokenizer_path.resolve())
    tree = OmegaConf.merge(
        config_lib.compose(overrides=["parallel.tp=1", "parallel.pp=1", "parallel.dp=1"]), sections
    )
    try:
        tree.merge_with_dotlist(list(overrides))
    except Exception as error:  # an override of any kind
        raise ConfigError(f"{ckpt.path}: cannot apply the overrides ({error})") from None
    return config_lib.validate(tree)


def _export_tokenizer(ckpt: checkpoint.Checkpoint, config: Config) -> Path | None:
    """The tokenizer that goes with a checkpoint's weights: :func:`checkpoint_config`'s
    ``tokenizer.path`` (the checkpoint's copy, else the saved path, or an override); None, with
    a warning, when there is none (e.g. a checkpoint imported from an HF directory without one)."""
    if config.tokenizer.path is not None:
        return Path(config.tokenizer.path)
    log.warning(
        "%s has no tokenizer and tokenizer.path is not set: the export gets no tokenizer "
        "files and no special-token ids, so generate() will not stop at the end of a "
        "turn; export again with tokenizer.path=<the policy's tokenizer>",
        ckpt.path,
    )
    return None


def hf_weight_groups(
    ckpt: checkpoint.Checkpoint, model: ModelConfig
) -> Iterator[dict[str, torch.Tensor]]:
    """A checkpoint's weights in HF naming, read and converted as the embeddings, final norm and
    LM head, then one decoder layer at a time; each tensor checked against ``model``'s shapes.

    The largest group comes first, while a consumer writing shards holds nothing yet.
    """
    tensors = checkpoint.ModelTensors(ckpt)
    if tensors.num_layers != model.num_layers:
        raise checkpoint.CheckpointError(
            f"{ckpt.path}: {tensors.num_layers} decoder layers, "
            f"the config's model has {model.num_layers}"
        )
    ends = tensors.tensors(
        [
            "embedding.word_embeddings.weight",
            "decoder.final_layernorm.weight",
            *([] if model.share_embeddings_and_output_weights else ["output_layer.weight"]),
        ]
    )
    yield _checked_shapes(ckpt, model, megatron_ends_to_hf([ends], [ends], model))
    del ends  # the tensors as read, which would otherwise live through every layer
    for layer in range(model.num_layers):
        yield _checked_shapes(ckpt, model, _hf_layer(tensors, layer, model))


def _hf_layer(
    tensors: checkpoint.ModelTensors, layer: int, model: ModelConfig
) -> dict[str, torch.Tensor]:
    try:
        # A checkpoint's norms carry TE's fused names whichever spec saved it.
        return megatron_layer_to_hf(
            [tensors.layer(layer)], layer, layer, model, "transformer_engine"
        )
    except KeyError as missing:
        raise checkpoint.CheckpointError(
            f"{tensors.checkpoint.path}: the checkpoint has no "
            f"{missing}; was it written for another model?"
        ) from None


def _checked_shapes(
    ckpt: checkpoint.Checkpoint, model: ModelConfig, group: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    for name, tensor in group.items():
        expected = hf_parameter_shape(model, name)
        if tuple(tensor.shape) != expected:
            raise checkpoint.CheckpointError(
                f"{ckpt.path}: {name} has shape "
                f"{tuple(tensor.shape)}, the config's model "
                f"expects {expected}"
            )
    return group


def export(
    checkpoint_path: str,
    fmt: str,
    out: str,
    *,
    tp: int = 1,
    dtype: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overrides: list[str] = (),
) -> Path:
    """Write an HF directory or a TensorRT-LLM checkpoint (``tp`` rank files) from a checkpoint.

    The HF directory's weights go in safetensors shards of at most ``max_shard_size`` (one
    ``model.safetensors`` when they fit), written as they fill: memory holds one decoder layer
    (or the embeddings and LM head) and one shard, not the model. The TensorRT-LLM checkpoint
    needs the whole model at once, to cut each tensor per rank.

    Either gets the checkpoint's tokenizer (:func:`_export_tokenizer`) in the layout transformers
    4.x and 5.x both load; the HF directory's ``config.json`` and ``generation_config.json`` get
    its special-token ids, so ``generate()`` stops at ``<|im_end|>``.
    """
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"--format must be one of {'|'.join(EXPORT_FORMATS)}, got {fmt!r}")
    ckpt = checkpoint.open_checkpoint(checkpoint_path)
    config = checkpoint_config(ckpt, overrides)
    dtype = _resolve_dtype(config, dtype)
    tokenizer_dir = _export_tokenizer(ckpt, config)
    groups = hf_weight_groups(ckpt, config.model)
    out_dir = Path(out)
    if fmt == "hf":
        special_tokens = (
            special_token_ids(load_tokenizer(tokenizer_dir)) if tokenizer_dir is not None else None
        )
        write_hf_checkpoint(
            out_dir,
            groups,
            config.model,
            dtype=qwen3.DTYPES[dtype],
            max_shard_size=max_shard_size,
            special_tokens=special_tokens,
        )
    else:
        hf = {name: tensor for group in groups for name, tensor in group.items()}
        trtllm.save_trtllm_checkpoint(out_dir, hf, config.model, tp=tp, dtype=dtype)
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out_dir)
    (out_dir / EXPORT_MANIFEST).write_text(
        json.dumps(
            {"source": str(ckpt.path), "step": ckpt.step, "format": fmt, "dtype": dtype, "tp": tp}
        )
    )
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


def export_engine(
    checkpoint_path: str,
    out: str,
    *,
    tp: int = 1,
    dtype: str | None = None,
    max_batch_size: int = DEFAULT_ENGINE_MAX_BATCH_SIZE,
    max_seq_len: int | None = None,
    overrides: list[str] = (),
) -> EngineExport:
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
        raise ConfigError(
            f"--max-seq-len {max_seq_len} exceeds the model's "
            f"max_position_embeddings ({config.model.max_position_embeddings})"
        )
    out_dir = Path(out)
    checkpoint_dir, engine_dir = out_dir / "checkpoint", out_dir / "engine"
    command = trtllm.trtllm_build_command(
        checkpoint_dir,
        engine_dir,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        workers=min(tp, max(torch.cuda.device_count(), 1)),
        executable=executable,
    )
    export(checkpoint_path, "trtllm", str(checkpoint_dir), tp=tp, dtype=dtype, overrides=overrides)
    seconds = trtllm.build_engine(command)
    if config.tokenizer.path is not None:
        copy_tokenizer(config.tokenizer.path, engine_dir)
    (out_dir / EXPORT_MANIFEST).write_text(
        json.dumps(
            {
                "source": str(ckpt.path),
                "step": ckpt.step,
                "format": "trtllm-engine",
                "dtype": dtype,
                "tp": tp,
                "max_batch_size": max_batch_size,
                "max_seq_len": max_seq_len,
                "build_seconds": round(seconds, 3),
                "command": command,
            }
        )
    )
    return EngineExport(checkpoint_dir, engine_dir, seconds)


def import_hf(hf_dir: str, out: str, overrides: list[str] = ()) -> Path:
    """A model-only nemo-orch checkpoint (``step_0``) from an HF Qwen3 directory, with the
    model fields taken from its ``config.json``; train from it with ``trainer.init_from``."""
    hf_config = load_hf_checkpoint_config(hf_dir)
    base = config_lib.load(["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", *overrides])
    model = model_config_from_hf(hf_config, base.model)
    source = Path(hf_dir)
    tokenizer_dir = source if (source / "tokenizer.json").exists() else None
    config = config_lib.replace(
        base,
        model=model,
        tokenizer=config_lib.TokenizerConfig(path=str(source) if tokenizer_dir else None),
    )
    hf = HFCheckpoint(hf_dir)
    with distributed.parallel_session(config.parallel, config.run.seed):
        module = qwen3.build_model(
            config.model, config.parallel, pre_process=True, post_process=True
        )
        weights.load_hf_weights(module, hf, config.model)
        return checkpoint.save(config, 0, module, tokenizer_dir=tokenizer_dir, directory=Path(out))
