"""Moving whole-model weights in and out of a (possibly sharded) Megatron policy."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_orch.config import ModelConfig
from nemo_orch.models.hf_mapping import (
    Layout,
    hf_parameter_names,
    hf_parameter_shape,
    hf_to_megatron,
    megatron_embedding_to_hf,
    megatron_head_to_hf,
    megatron_layer_to_hf,
)


def rank_layout() -> Layout:
    from megatron.core import parallel_state as ps

    return Layout(
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
    )


def parameter_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by name (Megatron's ``_extra_state`` entries and wrappers' prefixes dropped)."""
    while hasattr(module, "module"):  # DDP / Float16Module wrappers
        module = module.module
    return {
        name: tensor.detach()
        for name, tensor in module.state_dict().items()
        if not name.endswith("_extra_state")
    }


def load_parameters(
    module: torch.nn.Module, state: Mapping[str, torch.Tensor], skip: str | None = None
) -> None:
    """Copy a full local state into the module; every parameter must be covered exactly, but
    those named under ``skip`` (a prefix), which keep their values and take nothing."""
    own = parameter_state(module)
    if skip is not None:
        own = {name: tensor for name, tensor in own.items() if not name.startswith(skip)}
        state = {name: tensor for name, tensor in state.items() if not name.startswith(skip)}
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    if missing or unexpected:
        raise KeyError(
            f"state does not match the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    with torch.no_grad():
        for name, tensor in own.items():
            if tensor.shape != state[name].shape:
                raise ValueError(
                    f"{name}: shape {tuple(state[name].shape)} does not match the "
                    f"model's {tuple(tensor.shape)}"
                )
            tensor.copy_(state[name])


def load_hf_weights(
    module: torch.nn.Module,
    hf: Mapping[str, torch.Tensor],
    model: ModelConfig,
    skip: str | None = None,
) -> None:
    """Load full HF-named weights into this rank's shard of the policy (those of the module's
    state under ``skip``, a name prefix, excepted: see :func:`load_parameters`)."""
    load_parameters(module, hf_to_megatron(hf, model, rank_layout()), skip)


@dataclass(frozen=True)
class _Unit:
    """What the refit moves in one piece, held by pipeline stage ``stage`` as its parameters
    ``names``: the embeddings (``kind`` "embedding"), the final norm and output layer ("head"),
    or decoder layer ``layer``, local layer ``local`` of its stage ("layer")."""

    kind: str
    stage: int
    names: list[str]
    layer: int = -1
    local: int = -1

    def to_hf(
        self, stage: list[dict[str, torch.Tensor]], model: ModelConfig
    ) -> dict[str, torch.Tensor]:
        """Its full HF tensors from its stage's parameters (``stage[tp_rank]``)."""
        if self.kind == "embedding":
            return megatron_embedding_to_hf(stage)
        if self.kind == "head":
            return megatron_head_to_hf(stage, model)
        return megatron_layer_to_hf(stage, self.local, self.layer, model)


def _local_shapes(model: ModelConfig, layout: Layout) -> dict[str, torch.Size]:
    """The shape of each parameter of the rank at ``layout`` (the mapping run on meta tensors,
    so nothing is allocated)."""
    meta = {
        name: torch.empty(hf_parameter_shape(model, name), device="meta")
        for name in hf_parameter_names(model)
    }
    return {name: tensor.shape for name, tensor in hf_to_megatron(meta, model, layout).items()}


def _refit_plan(
    model: ModelConfig, tp_size: int, pp_size: int
) -> tuple[list[_Unit], list[dict[str, torch.Size]]]:
    """The units in refit order (embeddings, layers, head) and each stage's parameter shapes
    (those of every TP rank of a stage are equal)."""
    shapes = [
        _local_shapes(model, Layout(tp_size=tp_size, pp_size=pp_size, pp_rank=stage))
        for stage in range(pp_size)
    ]
    last = pp_size - 1
    units = [_Unit("embedding", 0, ["embedding.word_embeddings.weight"])]
    for stage in range(pp_size):
        layout = Layout(tp_size=tp_size, pp_size=pp_size, pp_rank=stage)
        for local, layer in enumerate(layout.layers(model.num_layers)):
            prefix = f"decoder.layers.{local}."
            units.append(
                _Unit(
                    "layer",
                    stage,
                    [name for name in shapes[stage] if name.startswith(prefix)],
                    layer,
                    local,
                )
            )
    # (With tied embeddings and PP the last stage's output layer is a copy: not sent.)
    head = ["decoder.final_layernorm.weight"]
    if not model.share_embeddings_and_output_weights:
        head.append("output_layer.weight")
    units.append(_Unit("head", last, head))
    return units, shapes


def _buckets(
    units: list[_Unit],
    shapes: list[dict[str, torch.Size]],
    tp_size: int,
    element_size: int,
    bucket_bytes: int,
) -> list[list[_Unit]]:
    """Consecutive units, as many as fit ``bucket_bytes`` of full (all TP ranks') tensors; a
    unit larger than that makes a bucket of its own."""
    buckets: list[list[_Unit]] = []
    filled = 0
    for unit in units:
        size = tp_size * element_size * sum(shapes[unit.stage][name].numel() for name in unit.names)
        if not buckets or filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(unit)
        filled += size
    return buckets


def hf_weight_buckets(
    module: torch.nn.Module, model: ModelConfig, bucket_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """The policy's full HF-named weights, bucket by bucket, on global rank 0 (the first rank of
    the first data-parallel replica); every rank of the job calls it and iterates it to the end.

    Only the TP/PP ranks of data-parallel replica 0 take part; the others return at once. Each
    bucket holds whole units (the embeddings, a decoder layer, the final norm with the LM head)
    whose full tensors fit ``bucket_bytes`` (a unit larger than that alone): every rank owning part of it sends its
    shards as one flat tensor to rank 0 (point to point, no pickling), which assembles the HF
    tensors. A bucket is not kept once the next is asked for, so the refit's extra memory is
    one bucket and its received shards on rank 0 and one flat send elsewhere. In one process
    the tensors are cut from the parameters themselves.
    """
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_rank() != 0:
        return
    layout = rank_layout()
    local = parameter_state(module)
    group = ps.get_model_parallel_group()
    members = dist.get_process_group_ranks(group)
    device = next(iter(local.values())).device
    # (global rank, stage, TP rank) of each rank of this replica: who sends what to whom
    mine = torch.tensor([dist.get_rank(), layout.pp_rank, layout.tp_rank], device=device)
    coordinates = [torch.empty_like(mine) for _ in members]
    dist.all_gather(coordinates, mine, group=group)
    owner = {(int(stage), int(tp_rank)): int(rank) for rank, stage, tp_rank in coordinates}
    receiver = owner[(0, 0)]
    dtype = next(iter(local.values())).dtype
    units, shapes = _refit_plan(model, layout.tp_size, layout.pp_size)
    for bucket in _buckets(units, shapes, layout.tp_size, dtype.itemsize, bucket_bytes):
        names = {
            stage: [name for unit in bucket if unit.stage == stage for name in unit.names]
            for stage in range(layout.pp_size)
        }
        if dist.get_rank() != receiver:
            if names[layout.pp_rank]:
                dist.send(
                    torch.cat(
                        [local[name].reshape(-1).to(dtype) for name in names[layout.pp_rank]]
                    ),
                    receiver,
                )
            continue
        # states[stage][tp_rank]: the bucket's parameters of that rank
        states: list[list[dict[str, torch.Tensor]]] = [
            [{} for _ in range(layout.tp_size)] for _ in range(layout.pp_size)
        ]
        for stage, stage_names in names.items():
            if not stage_names:
                continue
            sizes = [shapes[stage][name].numel() for name in stage_names]
            for tp_rank in range(layout.tp_size):
                if owner[(stage, tp_rank)] == receiver:
                    states[stage][tp_rank] = {name: local[name] for name in stage_names}
                    continue
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
                dist.recv(flat, owner[(stage, tp_rank)])
                states[stage][tp_rank] = {
                    name: part.view(shapes[stage][name])
                    for name, part in zip(stage_names, flat.split(sizes))
                }
        hf: dict[str, torch.Tensor] = {}
        for unit in bucket:
            hf |= unit.to_hf(states[unit.stage], model)
        del states
        yield hf


def gather_hf_weights(
    module: torch.nn.Module, model: ModelConfig, bucket_mb: int
) -> dict[str, torch.Tensor] | None:
    """Full HF-named weights on global rank 0 (None elsewhere), from one data-parallel replica,
    moved in buckets of ``bucket_mb`` MiB (:func:`hf_weight_buckets`); on CPU."""
    hf: dict[str, torch.Tensor] = {}
    for bucket in hf_weight_buckets(module, model, bucket_mb << 20):
        hf |= {name: tensor.cpu() for name, tensor in bucket.items()}
    return hf if dist.get_rank() == 0 else None
