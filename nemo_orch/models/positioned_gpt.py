"""Megatron's ``GPTModel`` with its rotary embedding taken at ``position_ids``.

``GPTModel`` rotates the token at index ``i`` of a sequence by position ``i`` and reads
``position_ids`` only for learned absolute embeddings. A prefix-shared micro-batch
(:mod:`nemo_orch.train.prefix_sharing`) packs the sequences that share a prefix into one row as a
token tree, where a token's position is its depth in the tree, not its index: its rotation must
follow ``position_ids``. For the positions ``0..s-1`` of an ordinary batch the embedding taken
is Megatron's own, value for value, so every other caller computes what it did before.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel


class PositionedGPTModel(GPTModel):
    """:class:`GPTModel` whose rotary embedding follows ``position_ids`` (module docstring)."""

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):  # noqa: ANN001, ANN002
        output = super()._preprocess(input_ids, position_ids, *args, **kwargs)
        rotary = output[1]
        if rotary is None or position_ids is None:
            return output
        return (output[0], rotary_at(rotary, position_ids), *output[2:])


def rotary_at(rotary: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Megatron's rotary embedding of positions ``0..s-1`` (``[s, 1, 1, d]``) taken at
    ``position_ids`` (``[b, s]``): ``[s, 1, 1, d]`` when every row has the same positions (the
    shape the fused kernels take), ``[s, b, 1, d]`` otherwise (broadcast over the heads)."""
    if position_ids.numel() and int(position_ids.max()) >= rotary.shape[0]:
        raise ValueError(
            f"position {int(position_ids.max())} is past the sequence's {rotary.shape[0]} "
            "rotary positions: a packed row's positions are depths, below its length"
        )
    if bool((position_ids == position_ids[:1]).all()):
        return rotary[position_ids[0]]
    return rotary[position_ids.transpose(0, 1)].squeeze(2)
