"""Supervised fine-tuning samples: one conversation per sample, loss on the assistant.

A sample holds ``tokens`` (the model input), ``labels`` (the next token at each position) and
``loss_mask`` (1.0 where the label is an assistant token, including the ``<|im_end|>`` that ends
each assistant turn). Conversations are padded per batch (to its longest, rounded up to
:data:`PAD_MULTIPLE`), never packed together, so attention needs no per-document masking; those
longer than ``seq_length`` are dropped and counted rather than truncated, since a truncated
demonstration teaches the model to stop mid-answer.

Batches are a pure function of (step, seed): :func:`global_batch` reads a chain of seeded
per-epoch permutations, so a run resumed at step k sees exactly the samples of an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from nemo_orch.data.conversations import DataError

# Batches are padded to a multiple of this: few distinct shapes, divisible by any TP size used
# with sequence parallelism.
PAD_MULTIPLE = 16


def padded_length(lengths: Iterable[int], cap: int | None = None) -> int:
    """The longest of ``lengths`` rounded up to :data:`PAD_MULTIPLE` (at most ``cap``)."""
    length = -(-max(lengths) // PAD_MULTIPLE) * PAD_MULTIPLE
    return length if cap is None else min(length, cap)


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, conversation: dict[str, Any]
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a mask that is 1 on assistant tokens."""
    encoded = tokenizer.apply_chat_template(
        conversation["messages"],
        tools=conversation.get("tools") or None,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, mask = list(encoded["input_ids"]), list(encoded["assistant_masks"])
    if not any(mask):
        raise DataError(
            "no assistant tokens in a conversation: the tokenizer's chat template lacks "
            "{% generation %} markers (load it with nemo_orch.models.tokenizer.load_tokenizer)"
        )
    return ids, mask


class SFTDataset(Dataset[dict[str, torch.Tensor]]):
    """Unpadded SFT samples, one per conversation that fits in ``seq_length + 1`` tokens (see
    :func:`collate` for batches)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        conversations: Sequence[dict[str, Any]],
        seq_length: int,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise DataError("the tokenizer has no pad token")
        self.seq_length = seq_length
        self.pad_id = tokenizer.pad_token_id
        self.num_dropped = 0
        self.samples: list[dict[str, torch.Tensor]] = []
        for conversation in conversations:
            ids, mask = tokenize_conversation(tokenizer, conversation)
            # seq_length inputs predict seq_length labels: one token more than the sample holds.
            if len(ids) > seq_length + 1:
                self.num_dropped += 1
                continue
            self.samples.append(
                {
                    "tokens": torch.tensor(ids[:-1], dtype=torch.long),
                    "labels": torch.tensor(ids[1:], dtype=torch.long),
                    "loss_mask": torch.tensor(mask[1:], dtype=torch.float),
                }
            )
        if not self.samples:
            raise DataError(
                f"all {len(conversations)} conversations are longer than seq_length + 1 = "
                f"{seq_length + 1} tokens"
            )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.samples[index]


def global_batch(dataset: Sized, step: int, global_batch_size: int, seed: int) -> list[int]:
    """The sample indices of training step ``step`` (0-based).

    Samples are read in order from the chain of per-epoch permutations (epoch e shuffled by
    ``(seed, e)``), so every epoch visits each sample once and a batch may straddle two epochs.
    """
    size = len(dataset)
    start = step * global_batch_size
    epochs = range(start // size, (start + global_batch_size - 1) // size + 1)
    order = np.concatenate([np.random.default_rng((seed, e)).permutation(size) for e in epochs])
    offset = start - epochs[0] * size
    return order[offset : offset + global_batch_size].tolist()


def collate(
    samples: Sequence[dict[str, torch.Tensor]], length: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """Pad samples to ``length`` (tokens and labels with ``pad_id``, the loss mask with 0),
    stack them into ``[batch, length]`` tensors and add ``position_ids``."""
    fills = {"tokens": pad_id, "labels": pad_id, "loss_mask": 0}
    batch = {
        key: torch.stack(
            [
                torch.nn.functional.pad(sample[key], (0, length - len(sample[key])), value=fill)
                for sample in samples
            ]
        )
        for key, fill in fills.items()
    }
    batch["position_ids"] = torch.arange(length).repeat(len(samples), 1)
    return batch
