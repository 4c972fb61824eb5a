"""``POST /v1/orchestrate`` when an expert fails: an episode an outage decided without an answer
is a 503 naming the endpoint and why, an expert that refuses how it is asked a 502, and a
reasoning expert's tokens reach the ledger by kind. The experts are OpenAI-shaped servers on
127.0.0.1 (a SIMULATED gpt-5-mini that refuses what OpenAI's reasoning models refuse)."""

from __future__ import annotations

import re

import httpx
import pytest
from support.simulated_openai import REASONING_TOKENS, SimulatedOpenAI

from nemo_orch.call_kinds import OBSERVATION_PREFIX
from nemo_orch.config import RolloutConfig, ServeConfig
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.rollout.format import call_text
from nemo_orch.serve.orchestrator import serve_orchestrator
from nemo_orch.tools.base import ToolSpec
from nemo_orch.tools.llm import LLMTool
from nemo_orch.tools.registry import Toolbox

SPEC = ToolSpec(
    "ask",
    "Ask the expert.",
    {
        "type": "object",
        "required": ["model", "question"],
        "properties": {
            "model": {"type": "string", "enum": ["mini"]},
            "question": {"type": "string"},
        },
    },
)
SETTINGS = RolloutConfig(max_context_tokens=2048, max_turns=2, temperature=0.0)
_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


def _policy(prompt: str) -> str:
    """Ask the expert until it answers, then answer with what it said."""
    answered = [
        text
        for text in _RESPONSE.findall(prompt)
        if not text.startswith(tuple(OBSERVATION_PREFIX.values()))
    ]
    if answered:
        return f"<answer>{answered[-1]}</answer>"
    return call_text(("ask", {"model": "mini", "question": "What is 2 + 2?"}))


def _orchestrate(tokenizer, url: str, dialect: str) -> httpx.Response:
    tool = LLMTool(
        SPEC,
        {"mini": {"base_url": url, "model": "gpt-5-mini", "dialect": dialect}},
        max_retries=0,
        timeout_s=5,
    )
    with serve_orchestrator(
        ScriptedEngine(tokenizer, _policy),
        tokenizer,
        Toolbox([tool]),
        SETTINGS,
        ServeConfig(http_port=0, metrics_port=None),
        "orchestrator",
    ) as server:
        return httpx.post(
            f"{server.url}/orchestrate", json={"question": "2 + 2?", "seed": 1}, timeout=60
        )


def test_an_expert_outage_is_a_503_naming_it(tiny_tokenizer):
    reply = _orchestrate(tiny_tokenizer, "http://127.0.0.1:9/v1", "openai-reasoning")
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["type"] == "upstream_unavailable"
    assert error["message"].startswith(
        "no answer: the episode was decided by a failure outside "
        "the policy, infra_error at ask(model=mini): expert "
        "'mini' failed: POST http://127.0.0.1:9/v1/chat/"
        "completions failed after 1 attempt; last error: "
    )


def test_an_expert_refusing_how_it_is_asked_is_a_502_naming_it(tiny_tokenizer):
    with SimulatedOpenAI("gpt-5-mini", reasoning=True, key=None) as expert:
        reply = _orchestrate(tiny_tokenizer, expert.url, "vllm")  # sends max_tokens
    assert reply.status_code == 502
    error = reply.json()["error"]
    assert error["type"] == "upstream_error"
    assert error["message"].startswith(
        "an endpoint refuses what it is asked: tool ask, model 'mini': the endpoint "
    )
    assert "refuses the request parameter 'max_tokens'" in error["message"]


def test_a_reasoning_experts_tokens_reach_the_ledger_by_kind(tiny_tokenizer):
    with SimulatedOpenAI("gpt-5-mini", reasoning=True, key=None) as expert:
        reply = _orchestrate(tiny_tokenizer, expert.url, "openai-reasoning")
    assert reply.status_code == 200
    body = reply.json()
    assert (body["answer"], body["finish_reason"]) == ("4", "answer")
    (call,) = body["ledger"]["calls"]
    assert (call["kind"], call["reasoning_tokens"]) == ("ok", REASONING_TOKENS)
    assert call["output_tokens"] > call["reasoning_tokens"] and call["cost_usd"] > 0
    assert body["ledger"]["call_kinds"] == {"ask": {"ok": 1}}


@pytest.mark.parametrize(
    "content, finish, kind", [("", "length", "truncated"), ("   ", "stop", "empty")]
)
def test_no_expert_answer_is_an_empty_success(tiny_tokenizer, content, finish, kind):
    from support.local_http import JSONServer

    def answer(path, headers, body):
        return (
            200,
            {
                "model": "gpt-5-mini",
                "choices": [{"index": 0, "finish_reason": finish, "message": {"content": content}}],
                "usage": {
                    "prompt_tokens": 9,
                    "completion_tokens": 64,
                    "completion_tokens_details": {"reasoning_tokens": 64},
                },
            },
            {},
        )

    with JSONServer(answer, url_path="/v1") as expert:
        reply = _orchestrate(tiny_tokenizer, expert.url, "openai-reasoning")
    body = reply.json()
    # The policy was told, and kept asking: no answer came, and the bill shows what was spent.
    assert reply.status_code == 200 and body["answer"] is None
    assert [call["kind"] for call in body["ledger"]["calls"]] == [kind, kind]
    assert all(
        call["reasoning_tokens"] == 64 and call["cost_usd"] > 0 for call in body["ledger"]["calls"]
    )
