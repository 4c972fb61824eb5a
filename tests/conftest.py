"""Shared fixtures: a small offline data set and a tokenizer trained on it (once per session)."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from nemo_orch.data.offline import generate_conversations
from nemo_orch.models.tokenizer import load_tokenizer, render_conversation, train_tokenizer


@pytest.fixture(scope="session")
def offline_conversations() -> list[dict[str, Any]]:
    return generate_conversations(300, seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(
    offline_conversations: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> PreTrainedTokenizerBase:
    """Trained, saved and loaded back the way a run does it."""
    out_dir = tmp_path_factory.mktemp("tokenizer")
    texts = (render_conversation(c["messages"], c["tools"]) for c in offline_conversations)
    train_tokenizer(texts, vocab_size=1000, min_frequency=2, out_dir=out_dir)
    return load_tokenizer(out_dir)
