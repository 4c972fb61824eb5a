"""Supervised fine-tuning samples: one conversation per fixed-length sample, loss on the assistant.

A sample holds ``tokens`` (the model input), ``labels`` (the next token at each position) and
``loss_mask`` (1.0 where the label is an assistant token, including the ``<|im_end|>`` that ends
each assistant turn). Conversations are padded, never packed together, so attention needs no
per-document masking; those that do not fit are dropped and counted rather than truncated, since a
truncated demonstration teaches the model to stop mid-answer.

Batches are a pure function of (step, seed): :func:`global_batch` reads a chain of seeded
per-epoch permutations, so a run resumed at step k sees exactly the samples of an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from nemo_orch.data.conversations import DataError


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
    """Fixed-length SFT samples, one per conversation that fits in ``seq_length + 1`` tokens."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        conversations: Sequence[dict[str, Any]],
        seq_length: int,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise DataError("the tokenizer has no pad token")
        self.seq_length = seq_length
        self.num_dropped = 0
        tokens, labels, loss_mask = [], [], []
        for conversation in conversations:
            ids, mask = tokenize_conversation(tokenizer, conversation)
            # seq_length inputs predict seq_length labels: one token more than the sample holds.
            if len(ids) > seq_length + 1:
                self.num_dropped += 1
                continue
            padding = seq_length + 1 - len(ids)
            ids = ids + [tokenizer.pad_token_id] * padding
            mask = mask + [0] * padding
            tokens.append(ids[:-1])
            labels.append(ids[1:])
            loss_mask.append(mask[1:])
        if not tokens:
            raise DataError(
                f"all {len(conversations)} conversations are longer than seq_length + 1 = "
                f"{seq_length + 1} tokens"
            )
        self.tokens = torch.tensor(tokens, dtype=torch.long)
        self.labels = torch.tensor(labels, dtype=torch.long)
        self.loss_mask = torch.tensor(loss_mask, dtype=torch.float)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "tokens": self.tokens[index],
            "labels": self.labels[index],
            "loss_mask": self.loss_mask[index],
        }


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


def collate(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples into ``[batch, seq]`` tensors and add ``position_ids``."""
    batch = {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}
    batch_size, seq_length = batch["tokens"].shape
    batch["position_ids"] = torch.arange(seq_length).repeat(batch_size, 1)
    return batch
