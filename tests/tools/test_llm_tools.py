"""The ``llm`` expert tool and the composite tools, against the project's own OpenAI-compatible
server on 127.0.0.1 (a tiny Qwen3 for the plain path; a scripted engine where the reply must be
a specific query, program or answer)."""

from __future__ import annotations

import asyncio
import json

import pytest

from nemo_orch.config import ModelConfig
from nemo_orch.rollout.engines.hf import HFEngine
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.serve.openai_server import start_server
from nemo_orch.tools import retriever, sandbox
from nemo_orch.tools.base import ToolContext, ToolError, ToolSpec
from nemo_orch.tools.composite import ExpertAnswer, ExpertCode, ExpertSearch, fit_observations
from nemo_orch.tools.llm import LLMTool
from nemo_orch.tools.pricing import model_pricing

EXPERT_SPEC = ToolSpec(
    "call_expert",
    "Ask an expert model.",
    {
        "type": "object",
        "required": ["model", "question"],
        "properties": {"model": {"type": "string"}, "question": {"type": "string"}},
    },
)


def composite_spec(name: str) -> ToolSpec:
    return ToolSpec(name, f"{name} through an expert.", EXPERT_SPEC.parameters)


@pytest.fixture(scope="module")
def tiny_server(tiny_tokenizer):
    model = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        vocab_size=1024,
        max_position_embeddings=512,
    )
    with start_server(
        HFEngine(model, tokenizer=tiny_tokenizer),
        tiny_tokenizer,
        "Qwen3-32B",
        api_key="local-secret",
    ) as handle:
        yield handle


def scripted_reply(prompt: str) -> str:
    question = prompt.rsplit("Question: ", 1)[-1].split("<|im_end|>")[0]
    if "search query" in prompt:
        return f'"capital of {question.split()[-1].rstrip("?")}"\nextra line'
    if "Python program" in prompt:
        return "Here it is:\n```python\nprint(6 * 7)\n```"
    if "Context:\n" in prompt:  # answers from the first observation handed to it
        first_observation = prompt.split("Context:\n")[1].splitlines()[0]
        return f"<answer>{first_observation}</answer>"
    return f"Thinking... <answer>{question.upper()}</answer>"


@pytest.fixture(scope="module")
def scripted_server(tiny_tokenizer):
    with start_server(
        ScriptedEngine(tiny_tokenizer, scripted_reply), tiny_tokenizer, "gpt-5"
    ) as handle:
        yield handle


def test_llm_tool_prices_server_usage(tiny_server, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("EXPERT_KEY", "local-secret")
    tool = LLMTool(
        EXPERT_SPEC,
        {
            "generalist": {
                "base_url": tiny_server.url,
                "model": "Qwen3-32B",
                "api_key_env": "EXPERT_KEY",
                "max_tokens": 8,
                "temperature": 0.0,
            }
        },
        system_prompt="You are an expert.",
    )

    async def calls():
        capped = await tool.call({"model": "generalist", "question": "What is 2+2?"}, ToolContext())
        unknown = await tool.call({"model": "gpt-9", "question": "q"}, ToolContext())
        await tool.close()
        return capped, unknown

    capped, unknown = asyncio.run(calls())
    # The random model writes to its cap of 8 tokens: billed as the server counted, and
    # truncated with what came back, never a success.
    assert capped.kind == "truncated" and capped.usage.output_tokens == 8 and capped.output
    assert capped.error == (
        "expert 'generalist' hit its output cap (8 output tokens, 0 of them "
        "reasoning; max_tokens=8)"
    )
    prompt = tiny_tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "You are an expert."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert capped.usage.input_tokens == len(tiny_tokenizer.encode(prompt, add_special_tokens=False))
    assert capped.cost_usd == pytest.approx(model_pricing("Qwen3-32B").cost(capped.usage, 0.0))
    assert capped.latency_s > 0
    assert "unknown model 'gpt-9'" in unknown.error and unknown.kind == "tool_error"


def test_llm_tool_key_errors_never_leak(tiny_server, monkeypatch):
    monkeypatch.setenv("WRONG_KEY", "not-the-secret-123")
    tool = LLMTool(
        EXPERT_SPEC,
        {
            "wrong": {
                "base_url": tiny_server.url,
                "model": "Qwen3-32B",
                "api_key_env": "WRONG_KEY",
            },
            "unset": {
                "base_url": tiny_server.url,
                "model": "Qwen3-32B",
                "api_key_env": "UNSET_KEY",
            },
            "down": {"base_url": "http://127.0.0.1:9/v1", "model": "x", "usd_per_million": [1, 1]},
        },
        max_retries=1,
        timeout_s=2,
    )

    async def calls():
        return await asyncio.gather(
            *(
                tool.call({"model": alias, "question": "q"}, ToolContext())
                for alias in ("wrong", "unset", "down")
            )
        )

    wrong, unset, down = asyncio.run(calls())
    assert "401" in wrong.error and "not-the-secret-123" not in json.dumps(wrong.to_json())
    assert "UNSET_KEY" in unset.error and "is not set" in unset.error
    assert "after 2 attempts" in down.error
    # None of them is the call's doing: a key refused or missing, an endpoint down.
    assert [r.kind for r in (wrong, unset, down)] == ["infra_error"] * 3


def test_composites_bill_expert_and_executor(scripted_server, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps(doc) + "\n"
            for doc in [
                {"id": "d1", "text": "The capital of Vardenia is Ostrel."},
                {"id": "d2", "text": "Mount Kelu is 4200 meters high."},
            ]
        )
    )
    built = {
        "expert": LLMTool(
            EXPERT_SPEC, {"strong": {"base_url": scripted_server.url, "model": "gpt-5"}}
        ),
        "retriever": retriever.Retriever(retriever.default_spec(), corpus=corpus, top_k=1),
        "python_sandbox": sandbox.PythonSandbox(sandbox.default_spec(), pool_size=1),
    }
    search = ExpertSearch(composite_spec("search"), built.__getitem__, "expert", "retriever")
    code = ExpertCode(
        composite_spec("enhance_reasoning"), built.__getitem__, "expert", "python_sandbox"
    )
    answer = ExpertAnswer(composite_spec("answer"), built.__getitem__, "expert")

    async def calls():
        await built["python_sandbox"].start()
        try:
            context = ToolContext()
            return await asyncio.gather(
                search.call(
                    {"model": "strong", "question": "What is the capital of Vardenia?"}, context
                ),
                code.call({"model": "strong", "question": "What is six times seven?"}, context),
                answer.call({"model": "strong", "question": "shout this"}, context),
                answer.call(
                    {"model": "strong", "question": "Which city?"},
                    ToolContext(observations=("Ostrel", "a later observation")),
                ),
            )
        finally:
            await built["python_sandbox"].close()
            await built["expert"].close()

    found, computed, answered, from_context = asyncio.run(calls())
    gpt5 = model_pricing("gpt-5")
    assert found.error is None
    assert found.output.startswith(
        "Query:\ncapital of Vardenia\nResult:\n[d1] The capital of Vardenia"
    )
    assert found.cost_usd == pytest.approx(gpt5.cost(found.usage, 0.0))  # retrieval is free
    assert computed.error is None and computed.output.endswith("Result:\n42\n")
    assert computed.cost_usd > gpt5.cost(computed.usage, 0.0)  # + sandbox seconds
    assert answered.answer == "SHOUT THIS" and answered.usage.output_tokens > 0
    assert from_context.answer == "Ostrel"  # the episode's observations reach the expert


def test_each_alias_gets_the_context_its_budget_fits(tiny_tokenizer):
    prompts: list[str] = []

    def recording_reply(prompt: str) -> str:
        prompts.append(prompt)
        return "<answer>noted</answer>"

    old, middle, new = (
        "The capital of Vardenia is Ostrel.",
        "Mount Kelu is 4200 meters high.",
        "Ostrel lies on the Vard river.",
    )
    question = "Where is Ostrel, and how high is Mount Kelu? " * 4  # longer than any budget
    with start_server(
        ScriptedEngine(tiny_tokenizer, recording_reply), tiny_tokenizer, "gpt-5"
    ) as server:
        expert = LLMTool(
            EXPERT_SPEC,
            {
                "small": {"base_url": server.url, "model": "gpt-5", "max_context_tokens": 12},
                "large": {"base_url": server.url, "model": "gpt-5"},
            },
        )
        answer = ExpertAnswer(composite_spec("answer"), {"expert": expert}.__getitem__, "expert")
        assert (
            expert.context_budget("small"),
            expert.context_budget("large"),
            expert.context_budget("unknown"),
        ) == (12, None, None)

        async def calls():
            context = ToolContext(observations=(old, middle, new))
            try:
                return [
                    await answer.call({"model": alias, "question": question}, context)
                    for alias in ("small", "large")
                ]
            finally:
                await expert.close()

        small, large = asyncio.run(calls())
    assert small.error is None and large.error is None and small.answer == "noted"
    small_prompt, large_prompt = prompts
    # 12 tokens ~ 48 characters: the newest observation whole, then the end of the one before.
    kept = middle[len(middle) - (48 - len(new)) :]
    assert kept == " 4200 meters high."
    assert f"Context:\n{kept}\n\n{new}\n\nQuestion: {question}" in small_prompt
    assert old not in small_prompt and "Mount Kelu is" not in small_prompt.split("Question:")[0]
    assert f"Context:\n{old}\n\n{middle}\n\n{new}\n\nQuestion: {question}" in large_prompt
    assert small.usage.input_tokens < large.usage.input_tokens  # the server read less


@pytest.mark.parametrize("budget", [0, -5, 2.5, "4096", True])
def test_invalid_context_budgets_are_tool_errors(budget):
    with pytest.raises(
        ToolError,
        match=r"call_expert: model 'x': max_context_tokens must be "
        r"null or an integer >= 1",
    ):
        LLMTool(
            EXPERT_SPEC,
            {
                "x": {
                    "base_url": "http://127.0.0.1:9/v1",
                    "model": "gpt-5",
                    "max_context_tokens": budget,
                }
            },
        )


def test_fit_observations_keeps_the_newest_characters():
    observations = ("aaaa", "bbbbbbbb", "cccc")  # 16 characters: 4 tokens at 4 characters each
    assert fit_observations(observations, None) is observations
    assert fit_observations(observations, 4) == observations
    assert fit_observations(observations, 3) == ("bbbbbbbb", "cccc")  # full: nothing older
    assert fit_observations(observations, 2) == ("bbbb", "cccc")  # the oldest kept loses its start
    assert fit_observations(("x" * 10,), 1) == ("xxxx",)  # the newest alone may be cut
    assert fit_observations((), 1) == ()
