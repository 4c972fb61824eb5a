"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` for the local
layer spec on CPU.

Megatron's local ``DotProductAttention`` materializes the scores (``baddbmm``), masks and
softmaxes them and multiplies by the values, each a separate kernel with its own saved tensors
for the backward pass. PyTorch's fused CPU kernel does the same causal attention in one pass
(flash-attention style, in blocks), forward and backward. Same inputs, same outputs (up to float
rounding), no parameters: checkpoints do not change. An explicit boolean mask (Megatron's
convention: True where a query may not look; a prefix-shared micro-batch's token tree,
:mod:`nemo_orch.train.prefix_sharing`) is handed to the fused kernel as what may be looked at.
What the fused path does not cover (another mask type, query-key layer scaling, a softmax
offset, dropout) goes to Megatron's own implementation.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """:class:`DotProductAttention` with causal attention fused, maskless or under a boolean
    mask (see the module docstring); query ``[sq, b, np, hn]``, key and value ``[sk, b, ng, hn]``, output
    ``[sq, b, np * hn]``."""

    def _fused(
        self, attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType]
    ) -> bool:
        return (
            (attention_mask is None or attention_mask.dtype == torch.bool)
            and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            and not self.config.apply_query_key_layer_scaling
            and self.softmax_offset is None
            and self.attention_dropout.p == 0.0
            and self.scale_mask_softmax.window_size is None
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if (
            attention_bias is not None
            or packed_seq_params is not None
            or not self._fused(attention_mask, attn_mask_type)
        ):
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        # [s, b, heads, hn] -> [b, heads, s, hn]; a given mask [b, 1, sq, sk] holds causality
        context = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3),
            key.permute(1, 2, 0, 3),
            value.permute(1, 2, 0, 3),
            attn_mask=None if attention_mask is None else ~attention_mask,
            is_causal=attention_mask is None,
            scale=self.softmax_scale,
            enable_gqa=groups > 1,
        )
        sequence, batch = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(sequence, batch, self.hidden_size_per_partition)
