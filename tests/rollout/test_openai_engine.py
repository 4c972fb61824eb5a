"""The OpenAI-compatible engine and server, and the client against them: the project's own server
(a tiny HFEngine on 127.0.0.1). The client's retry and key rules: tests/clients/test_openai.py."""

import asyncio

import httpx
import pytest
import torch

from nemo_orch.clients.openai import OpenAIClient
from nemo_orch.config import ModelConfig
from nemo_orch.rollout.engines.base import Engine, EngineError, SamplingParams
from nemo_orch.rollout.engines.hf import HFEngine
from nemo_orch.rollout.engines.openai import OpenAIEngine
from nemo_orch.serve.openai_server import start_server

MODEL = "tiny-orchestrator"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    model = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        vocab_size=len(tiny_tokenizer),
        max_position_embeddings=512,
        init_method_std=0.1,
    )
    return HFEngine(model, seed=5, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="module")
def server(engine, tiny_tokenizer):
    with start_server(engine, tiny_tokenizer, MODEL) as handle:
        yield handle


@pytest.fixture
def client(server):
    return OpenAIClient(server.url, MODEL, timeout_s=30, max_retries=1, backoff_s=0.01)


def test_chat_text_and_usage_match_the_tokenizer(client, engine, tiny_tokenizer):
    result = asyncio.run(client.chat(MESSAGES, max_tokens=6, temperature=0, tools=TOOLS))
    prompt = tiny_tokenizer.encode(
        tiny_tokenizer.apply_chat_template(
            MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False
        ),
        add_special_tokens=False,
    )
    expected = engine.generate(
        [prompt],
        SamplingParams(
            max_new_tokens=6, temperature=0, stop_token_ids=(tiny_tokenizer.eos_token_id,)
        ),
    )[0]
    assert result.input_tokens == len(prompt)
    assert result.output_tokens == len(expected.token_ids)
    assert result.text == expected.text and result.finish_reason == expected.finish_reason
    assert result.model == MODEL and result.latency_s > 0


def test_openai_engine_equals_hf_engine(server, engine, tiny_tokenizer):
    remote = OpenAIEngine(OpenAIClient(server.url, MODEL), tiny_tokenizer)
    assert isinstance(remote, Engine)
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(9, len(tiny_tokenizer), (n,), generator=generator).tolist() for n in (4, 9)
    ]
    local = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0))
    stop = local[1].text[2:5]
    assert len(stop) == 3
    for params in (
        SamplingParams(max_new_tokens=10, temperature=0),
        SamplingParams(
            max_new_tokens=10,
            temperature=0,
            stop_strings=(stop,),
            stop_token_ids=(local[0].token_ids[3],),
        ),
    ):
        expected = engine.generate(prompts, params)
        for ours, theirs in zip(remote.generate(prompts, params), expected):
            assert ours.token_ids == theirs.token_ids
            assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
            assert (ours.finish_reason, ours.text, ours.prompt_tokens) == (
                theirs.finish_reason,
                theirs.text,
                theirs.prompt_tokens,
            )
    assert expected[1].finish_reason == "stop"

    async def inside_a_loop():  # the rollout runner's path, and the sync one under a loop
        return await remote.agenerate(prompts, params), remote.generate(prompts, params)

    via_async, via_sync = asyncio.run(inside_a_loop())
    assert (
        [g.token_ids for g in via_async]
        == [g.token_ids for g in via_sync]
        == [g.token_ids for g in expected]
    )
    with pytest.raises(EngineError, match="refit"):
        remote.update_weights({})


def test_plain_openai_mode_reencodes_text(server, engine, tiny_tokenizer):
    remote = OpenAIEngine(OpenAIClient(server.url, MODEL), tiny_tokenizer, extensions=False)
    prompt = tiny_tokenizer.encode("What is the capital of France?", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    ours, theirs = remote.generate([prompt], params)[0], engine.generate([prompt], params)[0]
    assert ours.text == theirs.text
    assert ours.token_ids == tiny_tokenizer.encode(theirs.text, add_special_tokens=False)


def test_server_routes_and_validation(server, client):
    assert asyncio.run(client.models()) == [MODEL]
    base = server.url.removesuffix("/v1")
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    for path, body, status in [
        ("chat/completions", {"messages": []}, 400),
        ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400),
        ("chat/completions", {"messages": MESSAGES, "stream": "yes"}, 400),
        ("chat/completions", {"messages": MESSAGES, "temperature": -1}, 400),
        ("chat/completions", {"model": "gpt-9", "messages": MESSAGES}, 404),
        ("completions", {"prompt": [1, "a"]}, 400),
        ("completions", {"prompt": [10] * 600}, 400),  # longer than the context
        ("completions", {"prompt": "hi", "logprobs": 3}, 400),
        ("nowhere", {}, 404),
    ]:
        response = httpx.post(f"{server.url}/{path}", json=body)
        assert response.status_code == status, (path, body)
        assert response.json()["error"]["message"]
    response = httpx.post(f"{server.url}/completions", content=b"{not json")
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_completions_batch_logprobs_and_chat_logprobs(server, engine, tiny_tokenizer):
    texts = ["The answer is", "Paris is"]
    body = httpx.post(
        f"{server.url}/completions",
        json={
            "model": MODEL,
            "prompt": texts,
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": 0,
            "ignore_eos": True,
        },
    ).json()
    prompts = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    expected = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0))
    assert [c["text"] for c in body["choices"]] == [g.text for g in expected]
    assert body["choices"][1]["logprobs"]["token_logprobs"] == pytest.approx(
        expected[1].logprobs, abs=1e-5
    )
    assert body["usage"] == {
        "prompt_tokens": sum(map(len, prompts)),
        "completion_tokens": 10,
        "total_tokens": sum(map(len, prompts)) + 10,
    }
    chat = httpx.post(
        f"{server.url}/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "logprobs": True},
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    assert all(entry["logprob"] <= 0 for entry in content)


def test_server_api_key(engine, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("NEMO_ORCH_TEST_KEY", "sk-local")
    with start_server(engine, tiny_tokenizer, MODEL, api_key="sk-local") as handle:
        assert httpx.get(f"{handle.url}/models").status_code == 401
        client = OpenAIClient(handle.url, MODEL, api_key_env="NEMO_ORCH_TEST_KEY")
        assert asyncio.run(client.models()) == [MODEL]
