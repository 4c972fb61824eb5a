"""Megatron distributed checkpoints under ``runs/<name>/checkpoints/step_<N>/``, written atomically.

Every rank writes its shards into ``.step_<N>.partial/``; once all have finished, rank 0 writes
``nemo_orch.json`` (step, resolved config) and renames the directory to ``step_<N>``. A run killed
mid-save leaves only a ``.partial`` directory, which resume never picks up. Model weights are
layout-agnostic (a TP=2 run can be exported, or trained on, as TP=1); optimizer state resumes
under the same TP/PP layout.

Checkpoints also cross between the Transformer Engine and local layer specs (train on a GPU with
TE, evaluate on a CPU with the local spec): megatron-core 0.16.1 saves the local
spec's ``input_layernorm`` / ``pre_mlp_layernorm`` under TE's fused names
(``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``), and its linears carry an
empty ``_extra_state`` like TE's. What remains is TE's FP8 metadata (``_extra_state``) of modules
the local spec has no counterpart for: a local model ignores it, and a TE model loading a
local-spec checkpoint keeps its own (freshly initialized) metadata.

:class:`ModelTensors` reads a checkpoint's weights without building the model, a layer at a time
(``nemo-orch export``).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from nemo_orch import faults
from nemo_orch.config import Config, to_yaml
from nemo_orch.distributed import barrier, is_writer

MANIFEST = "nemo_orch.json"
CONFIG_FILE = "config.yaml"
TOKENIZER_DIR = "tokenizer"
EXTRA_STATE = "_extra_state"
LAYERS_PREFIX = "decoder.layers."
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Model weights reshard across any TP/PP/DP layout; optimizer state across DP only. megatron-core
# 0.16.1's "fully_reshardable" optimizer format cannot be loaded with torch's AdamW (no Apex/TE):
# it expects a per-parameter "step" tensor that it never saved.
_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or unreadable; the message names its path."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    manifest: dict

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def tokenizer_path(self) -> Path:
        return self.path / TOKENIZER_DIR


def checkpoints_dir(config: Config) -> Path:
    return config.run.dir / "checkpoints"


def open_checkpoint(path: str | Path) -> Checkpoint:
    """A complete checkpoint directory, or a ``checkpoints/`` directory (its latest step)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint not found")
    if not (path / MANIFEST).exists() and not _STEP_DIR.match(path.name):
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"{path}: no complete checkpoint (step_<N>/ with {MANIFEST})")
        return latest
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        return Checkpoint(path=path, step=int(manifest["step"]), manifest=manifest)
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(
            f"{path}: incomplete or corrupt checkpoint ({MANIFEST} unreadable: {error})"
        ) from None


def identity(path: str | Path) -> str:
    """What names a checkpoint's weights in an evaluation cache: the complete ``step_<N>``
    directory ``path`` resolves to and when its manifest was written, so a run trained again
    into the same directory is not taken for the weights cached before."""
    opened = open_checkpoint(path)
    return f"{opened.path.resolve()}@{(opened.path / MANIFEST).stat().st_mtime_ns}"


def latest_checkpoint(directory: Path) -> Checkpoint | None:
    """The highest complete ``step_<N>`` under ``directory``; partial saves are ignored."""
    if not directory.is_dir():
        return None
    steps = sorted(
        (int(m.group(1)), p)
        for p in directory.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / MANIFEST).exists()
    )
    return open_checkpoint(steps[-1][1]) if steps else None


def save(
    config: Config,
    step: int,
    module,
    optimizer=None,
    scheduler=None,
    *,
    tokenizer_dir: Path | None = None,
    directory: Path | None = None,
) -> Path:
    """Collectively save a model stage (and, for training, its optimizer and LR schedule) as
    ``step_<step>`` under ``directory`` (default: the run's ``checkpoints/``)."""
    from megatron.core import dist_checkpointing

    final = (directory or checkpoints_dir(config)) / f"step_{step}"
    partial = final.with_name(f".{final.name}.partial")
    if is_writer():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier()
    model_state = module.sharded_state_dict(metadata=_SHARDING)
    state = {"model": model_state}
    if optimizer is not None:
        if not any(adam.state for adam in _torch_adams(optimizer)):
            # Never stepped (e.g. GRPO's first steps filtered every group): the empty Adam state
            # equals a fresh one, and megatron-core cannot write a state with no step count.
            _materialize_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_state, metadata=_SHARDING)
        state["scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(state, str(partial))
    faults.maybe_kill("save", step)
    barrier()
    if is_writer():
        (partial / CONFIG_FILE).write_text(to_yaml(config))
        if tokenizer_dir is not None:
            from nemo_orch.models.tokenizer import copy_tokenizer  # transformers: a heavy import

            # Only the tokenizer's files (its directory may be a whole HF model's), in the
            # layout transformers 4.x and 5.x both load.
            (partial / TOKENIZER_DIR).mkdir()
            copy_tokenizer(tokenizer_dir, partial / TOKENIZER_DIR)
        # The manifest is written last: its presence marks the directory complete.
        manifest = {"step": step, "format": "megatron-dist", "contents": sorted(state)}
        (partial / MANIFEST).write_text(json.dumps(manifest))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
    barrier()
    return final


def _torch_adams(optimizer):
    return [chained.optimizer for chained in getattr(optimizer, "chained_optimizers", [optimizer])]


def _materialize_optimizer_state(optimizer) -> None:
    """Give every parameter an (empty) Adam state before loading into it.

    Without Apex/TE, megatron-core's DistributedOptimizer reads ``state["step"]`` of the wrapped
    torch optimizer while building the state dict to load into, which a fresh optimizer lacks.
    """
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                if not adam.state[param]:
                    adam.state[param].update(
                        step=torch.tensor(0.0),
                        exp_avg=torch.zeros_like(param),
                        exp_avg_sq=torch.zeros_like(param),
                    )


def _restore_adam_steps(optimizer) -> None:
    """torch's AdamW counts steps per parameter (bias correction); megatron-core restores the
    count only into ``param_groups[i]["step"]``. Without this a resumed run diverges."""
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            if "step" in group:
                for param in group["params"]:
                    adam.state[param]["step"] = torch.tensor(float(group["step"]))


def _with_own_entries(state: dict, module, skip: str | None) -> dict:
    """``state`` completed with the module's own ``_extra_state`` entries it lacks, and its own
    entries under ``skip``.

    The former are Transformer Engine's FP8 scaling metadata of modules whose checkpoint came
    from the local spec, which has none to give; a strict ``load_state_dict`` would reject their
    absence. The latter were not asked for (e.g. a critic's head, started from a policy)."""
    own = {
        name: value
        for name, value in module.state_dict().items()
        if name not in state
        and (name.endswith(EXTRA_STATE) or (skip is not None and name.startswith(skip)))
    }
    return {**state, **own}


@contextlib.contextmanager
def _reading(checkpoint: Checkpoint) -> Iterator[None]:
    """Any failure to read the checkpoint's tensors as a :class:`CheckpointError` naming it."""
    try:
        yield
    # torch.distributed.checkpoint's CheckpointException derives from BaseException.
    except (Exception, DCPException) as error:
        raise CheckpointError(
            f"{checkpoint.path}: cannot load checkpoint "
            f"({type(error).__name__}: {str(error)[:300]})"
        ) from None


@torch.no_grad()
def load(
    checkpoint: Checkpoint, module, optimizer=None, scheduler=None, *, skip: str | None = None
) -> None:
    """Collectively restore a model stage (and optimizer/schedule) from any TP/PP layout; the
    model's state under ``skip`` (a name prefix) is not read and keeps its values."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if optimizer is not None and "optimizer" not in checkpoint.manifest.get("contents", []):
        raise CheckpointError(
            f"{checkpoint.path}: holds model weights only, no optimizer state; "
            f"start from it with trainer.init_from instead of resuming"
        )
    model_state = module.sharded_state_dict(metadata=_SHARDING)
    if skip is not None:
        model_state = {key: value for key, value in model_state.items() if not key.startswith(skip)}
    request = {"model": model_state}
    if optimizer is not None:
        _materialize_optimizer_state(optimizer)
        request["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=True, metadata=_SHARDING
        )
    with _reading(checkpoint):
        # RETURN_UNEXPECTED drops what the checkpoint lacks from the request and names it.
        loaded, _, absent = dist_checkpointing.load(
            request, str(checkpoint.path), strict=StrictHandling.RETURN_UNEXPECTED
        )
    missing = sorted(key for key in absent if not key.endswith(EXTRA_STATE))
    if missing:
        raise CheckpointError(
            f"{checkpoint.path}: the checkpoint has no {missing[:5]} "
            f"({len(missing)} missing); was it written for another model?"
        )
    module.load_state_dict(_with_own_entries(loaded["model"], module, skip))
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer)
        scheduler.load_state_dict(loaded["scheduler"])


class ModelTensors:
    """A checkpoint's model weights, read a piece at a time by this process alone.

    A distributed checkpoint holds each weight whole (the TP=1 layout, whatever layout saved it),
    a decoder-layer weight as one tensor with a leading layer axis
    (``decoder.layers.mlp.linear_fc1.weight``: ``[num_layers, ...]``) saved in per-layer chunks,
    so :meth:`layer` reads one layer's bytes and none of the others'. Names are the checkpoint's,
    whose norms carry Transformer Engine's fused names whichever spec saved them.
    """

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self._storage = FileSystemReader(str(checkpoint.path))
        with _reading(checkpoint):
            entries = self._storage.read_metadata().state_dict_metadata
        self._tensors = {
            key: entry for key, entry in entries.items() if isinstance(entry, TensorStorageMetadata)
        }  # not _extra_state bytes
        self._layer_keys = [key for key in self._tensors if key.startswith(LAYERS_PREFIX)]
        self.num_layers = self._tensors[self._layer_keys[0]].size[0] if self._layer_keys else 0

    @property
    def names(self) -> list[str]:
        """The checkpoint keys of the model's weights (not the optimizer's state)."""
        return [key for key in self._tensors if not key.startswith("optimizer.")]

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """Decoder layer ``index``'s weights, named as in a one-rank model's state dict
        (``decoder.layers.<index>.<name>``)."""
        if not 0 <= index < self.num_layers:
            raise CheckpointError(
                f"{self.checkpoint.path}: no decoder layer {index} "
                f"(the checkpoint has {self.num_layers})"
            )
        slices = self._read(self._layer_keys, index)
        return {
            f"{LAYERS_PREFIX}{index}.{key.removeprefix(LAYERS_PREFIX)}": tensor[0]
            for key, tensor in slices.items()
        }

    def tensors(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """Whole tensors by checkpoint key (``embedding.word_embeddings.weight``, ...)."""
        keys = list(keys)
        missing = sorted(set(keys) - self._tensors.keys())
        if missing:
            raise CheckpointError(
                f"{self.checkpoint.path}: the checkpoint has no {missing}; "
                f"was it written for another model?"
            )
        return self._read(keys, None)

    def _read(self, keys: list[str], layer: int | None) -> dict[str, torch.Tensor]:
        """``keys`` whole, or their slice ``[layer]`` of the leading layer axis (kept, size 1)."""
        state, offsets = {}, {}
        for key in keys:
            entry = self._tensors[key]
            offsets[key] = (layer or 0,) + (0,) * (len(entry.size) - 1)
            shape = entry.size if layer is None else (1, *entry.size[1:])
            state[key] = torch.empty(shape, dtype=entry.properties.dtype)
        with _reading(self.checkpoint), warnings.catch_warnings():
            # One process by design: torch warns that, without a process group, it assumes so.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state, storage_reader=self._storage, planner=_SlicePlanner(offsets), no_dist=True
            )
        return state


class _SlicePlanner(DefaultLoadPlanner):
    """Loads each requested tensor from ``offsets[key]`` of the saved one (as much of it as the
    requested tensor holds); torch's own planner reads a plain tensor from the origin only."""

    def __init__(self, offsets: dict[str, tuple[int, ...]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._offsets = offsets

    def create_local_plan(self) -> LoadPlan:
        reads = []
        for key, tensor in self.state_dict.items():
            chunk = ChunkStorageMetadata(
                offsets=torch.Size(self._offsets[key]), sizes=tensor.size()
            )
            reads += create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], [chunk]
            )
        return LoadPlan(reads)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]
