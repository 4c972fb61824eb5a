"""Moving whole-model weights in and out of a (possibly sharded) Megatron policy."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from nemo_orch.config import ModelConfig
from nemo_orch.models.hf_mapping import Layout, hf_to_megatron, megatron_to_hf


def rank_layout() -> Layout:
    from megatron.core import parallel_state as ps

    return Layout(tp_size=ps.get_tensor_model_parallel_world_size(),
                  tp_rank=ps.get_tensor_model_parallel_rank(),
                  pp_size=ps.get_pipeline_model_parallel_world_size(),
                  pp_rank=ps.get_pipeline_model_parallel_rank())


def parameter_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by name (Megatron's ``_extra_state`` entries and wrappers' prefixes dropped)."""
    while hasattr(module, "module"):  # DDP / Float16Module wrappers
        module = module.module
    return {name: tensor.detach() for name, tensor in module.state_dict().items()
            if not name.endswith("_extra_state")}


def load_parameters(module: torch.nn.Module, state: Mapping[str, torch.Tensor],
                    skip: str | None = None) -> None:
    """Copy a full local state into the module; every parameter must be covered exactly, but
    those named under ``skip`` (a prefix), which keep their values and take nothing."""
    own = parameter_state(module)
    if skip is not None:
        own = {name: tensor for name, tensor in own.items() if not name.startswith(skip)}
        state = {name: tensor for name, tensor in state.items() if not name.startswith(skip)}
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    if missing or unexpected:
        raise KeyError(f"state does not match the model: missing {sorted(missing)[:5]}, "
                       f"unexpected {sorted(unexpected)[:5]}")
    with torch.no_grad():
        for name, tensor in own.items():
            if tensor.shape != state[name].shape:
                raise ValueError(f"{name}: shape {tuple(state[name].shape)} does not match the "
                                 f"model's {tuple(tensor.shape)}")
            tensor.copy_(state[name])


def load_hf_weights(module: torch.nn.Module, hf: Mapping[str, torch.Tensor],
                    model: ModelConfig, skip: str | None = None) -> None:
    """Load full HF-named weights into this rank's shard of the policy (those of the module's
    state under ``skip``, a name prefix, excepted: see :func:`load_parameters`)."""
    load_parameters(module, hf_to_megatron(hf, model, rank_layout()), skip)


def gather_hf_weights(module: torch.nn.Module, model: ModelConfig) -> dict[str, torch.Tensor] | None:
    """Full HF-named weights on global rank 0 (None elsewhere), from one data-parallel replica."""
    from megatron.core import parallel_state as ps

    layout = rank_layout()
    local = {k: v.cpu() for k, v in parameter_state(module).items()}
    shards: list = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (ps.get_data_parallel_rank(), layout.pp_rank, layout.tp_rank,
                                    local))
    if dist.get_rank() != 0:
        return None
    stages = [[None] * layout.tp_size for _ in range(layout.pp_size)]
    for dp_rank, pp_rank, tp_rank, state in shards:
        if dp_rank == 0:
            stages[pp_rank][tp_rank] = state
    return megatron_to_hf(stages, model)
