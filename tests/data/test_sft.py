from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from nemo_orch.data.conversations import DataError
from nemo_orch.data.sft import (
    PAD_MULTIPLE,
    SFTDataset,
    collate,
    global_batch,
    padded_length,
    tokenize_conversation,
)
from nemo_orch.models.tokenizer import render_conversation

_ASSISTANT_TURN_RE = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)


def _lengths(tokenizer: PreTrainedTokenizerBase, conversations: list[dict[str, Any]]) -> list[int]:
    return [len(tokenize_conversation(tokenizer, c)[0]) for c in conversations]


def test_mask_is_on_assistant_tokens_only(
    tiny_tokenizer: PreTrainedTokenizerBase, offline_conversations: list[dict[str, Any]]
) -> None:
    for conversation in offline_conversations[:40]:
        ids, mask = tokenize_conversation(tiny_tokenizer, conversation)
        text = render_conversation(conversation["messages"], conversation["tools"])
        assert ids == tiny_tokenizer.encode(text, add_special_tokens=False)
        learned = tiny_tokenizer.decode([i for i, m in zip(ids, mask) if m])
        assert learned == "".join(_ASSISTANT_TURN_RE.findall(text))
        assistant_turns = sum(m["role"] == "assistant" for m in conversation["messages"])
        ends = [m for i, m in zip(ids, mask) if i == tiny_tokenizer.eos_token_id]
        assert ends.count(1) == assistant_turns


def test_samples_are_shifted_and_batches_padded_to_their_longest(
    tiny_tokenizer: PreTrainedTokenizerBase, offline_conversations: list[dict[str, Any]]
) -> None:
    conversations = offline_conversations[:20]
    seq_length = max(_lengths(tiny_tokenizer, conversations)) + 5
    dataset = SFTDataset(tiny_tokenizer, conversations, seq_length)
    assert len(dataset) == 20 and dataset.num_dropped == 0
    for index, conversation in enumerate(conversations):
        ids, mask = tokenize_conversation(tiny_tokenizer, conversation)
        sample = dataset[index]
        assert sample["tokens"].tolist() == ids[:-1]
        assert sample["labels"].tolist() == ids[1:]
        assert sample["loss_mask"].tolist() == mask[1:]
    indices = [3, 7, 11]
    longest = max(len(dataset[i]["tokens"]) for i in indices)
    length = padded_length([len(dataset[i]["tokens"]) for i in indices])
    assert length % PAD_MULTIPLE == 0 and longest <= length < longest + PAD_MULTIPLE
    assert padded_length([longest], cap=longest) == longest
    batch = collate([dataset[i] for i in indices], length, dataset.pad_id)
    for row, index in enumerate(indices):
        sample, padding = dataset[index], length - len(dataset[index]["tokens"])
        pad = [tiny_tokenizer.pad_token_id] * padding
        assert batch["tokens"][row].tolist() == sample["tokens"].tolist() + pad
        assert batch["labels"][row].tolist() == sample["labels"].tolist() + pad
        assert batch["loss_mask"][row].tolist() == sample["loss_mask"].tolist() + [0] * padding


def test_long_conversations_are_dropped_and_counted(
    tiny_tokenizer: PreTrainedTokenizerBase, offline_conversations: list[dict[str, Any]]
) -> None:
    conversations = offline_conversations[:60]
    lengths = _lengths(tiny_tokenizer, conversations)
    seq_length = sorted(lengths)[len(lengths) // 2]
    dataset = SFTDataset(tiny_tokenizer, conversations, seq_length)
    dropped = sum(length > seq_length + 1 for length in lengths)
    assert 0 < dropped < len(conversations)
    assert dataset.num_dropped == dropped
    assert len(dataset) == len(conversations) - dropped
    # A conversation of exactly seq_length + 1 tokens fills the sample without padding.
    ids, _ = tokenize_conversation(tiny_tokenizer, conversations[0])
    exact = SFTDataset(tiny_tokenizer, conversations[:1], len(ids) - 1)
    assert exact.num_dropped == 0 and exact[0]["labels"].tolist() == ids[1:]
    with pytest.raises(DataError, match="all 60 conversations are longer"):
        SFTDataset(tiny_tokenizer, conversations, seq_length=min(lengths) - 2)


def test_tokenizer_template_without_generation_markers_is_an_error(
    tiny_tokenizer: PreTrainedTokenizerBase, offline_conversations: list[dict[str, Any]]
) -> None:
    template = tiny_tokenizer.chat_template
    tiny_tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    try:
        with pytest.raises(DataError, match="generation"):
            tokenize_conversation(tiny_tokenizer, offline_conversations[0])
    finally:
        tiny_tokenizer.chat_template = template


def test_global_batch_is_deterministic_and_resumable() -> None:
    dataset = range(10)
    uninterrupted = [global_batch(dataset, step, 4, seed=1) for step in range(8)]
    # A resumed run only knows the step it restarts at.
    resumed = uninterrupted[:3] + [global_batch(dataset, step, 4, seed=1) for step in range(3, 8)]
    assert resumed == uninterrupted
    assert uninterrupted != [global_batch(dataset, step, 4, seed=2) for step in range(8)]


def test_global_batch_epochs_visit_every_sample_once() -> None:
    size, batch_size = 10, 4  # batches straddle epoch boundaries
    stream = [i for step in range(10) for i in global_batch(range(size), step, batch_size, seed=0)]
    epochs = [stream[start : start + size] for start in range(0, len(stream), size)]
    assert len(epochs) == 4
    assert all(sorted(epoch) == list(range(size)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 4  # each epoch is reshuffled


def test_collate(
    tiny_tokenizer: PreTrainedTokenizerBase, offline_conversations: list[dict[str, Any]]
) -> None:
    dataset = SFTDataset(tiny_tokenizer, offline_conversations[:8], seq_length=512)
    batch = collate([dataset[i] for i in global_batch(dataset, 0, 3, seed=0)], 512, dataset.pad_id)
    assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == {
        "tokens": ((3, 512), torch.long),
        "labels": ((3, 512), torch.long),
        "loss_mask": ((3, 512), torch.float),
        "position_ids": ((3, 512), torch.long),
    }
    assert torch.equal(batch["position_ids"][2], torch.arange(512))
