"""HF encoders' pooling and prefixes, on a tiny Qwen3 built locally (nothing downloaded): what
reaches the model, and which hidden state becomes the vector, is computed here by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from nemo_orch.config import EncoderConfig
from nemo_orch.tools.encoders import (
    ENCODER_PRESETS,
    EncoderSettings,
    HFEncoder,
    RetrievalError,
    encoder_settings,
    make_encoder,
)
from nemo_orch.tools.retrieval_index import build_index, load_index

QUERY_PREFIX = ENCODER_PRESETS["qwen3-embedding"].query_prefix
TEXTS = ["volcanic eruptions of magma", "a much longer text about tides and the moon " * 3]


@pytest.fixture(scope="module")
def qwen3(random_policy_dir):
    """The tiny Qwen3's trunk and tokenizer, as the encoder loads them."""
    model = AutoModel.from_pretrained(random_policy_dir, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(random_policy_dir, local_files_only=True)
    return model, tokenizer


def by_hand(qwen3, text: str, position: int) -> np.ndarray:
    """The hidden state at ``position`` of ``text`` run alone (no padding), normalised."""
    model, tokenizer = qwen3
    with torch.inference_mode():
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        hidden = model(input_ids=ids).last_hidden_state[0, position].numpy()
    return hidden / np.linalg.norm(hidden)


def test_qwen3_embedding_pools_the_last_token_and_prefixes_queries_only(qwen3, random_policy_dir):
    encoder = make_encoder({"model_dir": str(random_policy_dir), "preset": "qwen3-embedding"})
    assert encoder.settings == EncoderSettings(
        "last_token", "Instruct: Given a search query, retrieve relevant passages\nQuery:"
    )
    # The two texts differ in length, so the batch is padded: the last real token is pooled.
    queries = encoder.encode(TEXTS, query=True)
    documents = encoder.encode(TEXTS)
    for row, text in enumerate(TEXTS):
        np.testing.assert_allclose(queries[row], by_hand(qwen3, QUERY_PREFIX + text, -1), atol=1e-5)
        np.testing.assert_allclose(documents[row], by_hand(qwen3, text, -1), atol=1e-5)
    assert not np.allclose(queries, documents, atol=1e-3)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_other_poolings_and_a_document_prefix(qwen3, random_policy_dir, pooling):
    encoder = HFEncoder(random_policy_dir, EncoderSettings(pooling, "q: ", "passage: "))
    (vector,) = encoder.encode(TEXTS[:1])
    model, tokenizer = qwen3
    with torch.inference_mode():
        ids = tokenizer("passage: " + TEXTS[0], return_tensors="pt")["input_ids"]
        hidden = model(input_ids=ids).last_hidden_state[0]
    expected = (hidden[0] if pooling == "cls" else hidden.mean(0)).numpy()
    np.testing.assert_allclose(vector, expected / np.linalg.norm(expected), atol=1e-5)


def test_an_index_answers_only_the_pooling_and_prefixes_it_was_built_with(
    tmp_path, random_policy_dir
):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": str(i), "text": text}) + "\n" for i, text in enumerate(TEXTS))
    )
    qwen3_embedding = {"model_dir": str(random_policy_dir), "preset": "qwen3-embedding"}
    out = build_index(corpus, tmp_path / "idx", qwen3_embedding)
    described = json.loads((out / "manifest.json").read_text())["encoder"]
    assert (described["pooling"], described["query_prefix"]) == ("last_token", QUERY_PREFIX)
    assert "document_prefix" not in described  # empty: as manifests written before prefixes
    assert len(load_index(out, qwen3_embedding).search(TEXTS[0], 1, mode="dense")) == 1
    for other in (str(random_policy_dir), {**qwen3_embedding, "query_prefix": "Query: "}):
        with pytest.raises(RetrievalError, match="built with encoder"):
            load_index(out, other)


def test_encoder_settings_and_options_are_checked(random_policy_dir):
    assert encoder_settings("e5", pooling="cls") == EncoderSettings("cls", "query: ", "passage: ")
    assert encoder_settings(None) == EncoderSettings()
    with pytest.raises(RetrievalError, match="unknown encoder preset 'gte'"):
        encoder_settings("gte")
    with pytest.raises(RetrievalError, match="pooling must be one of mean, last_token, cls"):
        EncoderSettings("max")
    with pytest.raises(RetrievalError, match="need model_dir"):
        make_encoder({"preset": "bge"})
    assert EncoderConfig().options() == "hashing"
    assert EncoderConfig(model=str(random_policy_dir), preset="bge").options() == {
        "model_dir": str(random_policy_dir),
        "preset": "bge",
        "pooling": None,
        "query_prefix": None,
        "document_prefix": None,
        "max_length": 512,
    }
