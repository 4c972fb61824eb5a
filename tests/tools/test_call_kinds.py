"""Every way an expert call ends has its kind (``nemo_orch/call_kinds.py``), against an OpenAI-
shaped expert on 127.0.0.1 that answers as real endpoints do when things go wrong: a reasoning
model that spends its cap thinking (``finish_reason: length``, no content), a cut answer, a
content filter, an empty reply, 429 and 500 after the retries, a hang, a refused context. None
is an empty success; each is billed as the endpoint counted it and kept in the ledger with its
tokens by kind. Then each endpoint's circuit breaker and retry budget."""

from __future__ import annotations

import asyncio
import time

import pytest
from support.local_http import JSONServer

from nemo_orch.call_kinds import CallKind
from nemo_orch.rollout.trajectory import CallRecord
from nemo_orch.tools.base import ToolContext, ToolSpec
from nemo_orch.tools.llm import LLMTool
from nemo_orch.tools.registry import Toolbox

SPEC = ToolSpec(
    "ask",
    "Ask an expert model.",
    {
        "type": "object",
        "required": ["model", "question"],
        "properties": {"model": {"type": "string"}, "question": {"type": "string"}},
    },
    timeout_s=30,
)


def _completion(content, finish, completion_tokens=12, reasoning_tokens=0):
    return {
        "id": "c",
        "object": "chat.completion",
        "model": "gpt-5-mini",
        "choices": [
            {
                "index": 0,
                "finish_reason": finish,
                "message": {"role": "assistant", "content": content},
            }
        ],
        "usage": {
            "prompt_tokens": 20,
            "completion_tokens": completion_tokens,
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
        },
    }


# What the expert answers, by the first word of the question.
ANSWERS = {
    # A reasoning model whose whole cap went to thinking, as OpenAI answers it.
    "think": (200, _completion("", "length", 256, 256)),
    "partial": (200, _completion("The capital of France is", "length", 256, 200)),
    "filtered": (200, _completion(None, "content_filter", 3)),
    "blank": (200, _completion("  ", "stop", 1)),
    "busy": (429, {"error": {"message": "Rate limit reached", "type": "requests"}}),
    "down": (500, {"error": {"message": "upstream exploded", "type": "server_error"}}),
    "long": (
        400,
        {
            "error": {
                "message": "This model's maximum context length is 128000 tokens",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        },
    ),
    "fine": (200, _completion("Paris.", "stop", 40, 30)),
}


class Expert(JSONServer):
    """Answers from :data:`ANSWERS` (``hang``: no answer within the client's timeout); with
    ``healthy`` set, every question is ``fine``. Counts the requests that reached it."""

    def __init__(self) -> None:
        self.requests, self.healthy = 0, False

        def answer(path, headers, body):
            self.requests += 1
            word = body["messages"][-1]["content"].split()[0]
            if self.healthy:
                word = "fine"
            if word == "hang":
                time.sleep(1.5)
                word = "fine"
            status, reply = ANSWERS[word]
            return status, reply, {"Retry-After": "0"} if status == 429 else {}

        super().__init__(answer, url_path="/v1")


@pytest.fixture()
def expert():
    with Expert() as server:
        yield server


def _tool(url: str, **options) -> LLMTool:
    return LLMTool(
        SPEC,
        {
            "m": {
                "base_url": url,
                "model": "gpt-5-mini",
                "max_tokens": 256,
                "dialect": "openai-reasoning",
            }
        },
        **options,
    )


def _ask(tool: LLMTool, *questions: str) -> list:
    async def calls():
        try:
            return [
                await tool.call({"model": "m", "question": question}, ToolContext())
                for question in questions
            ]
        finally:
            await tool.close()

    return asyncio.run(calls())


def test_every_ending_of_an_expert_call_has_its_kind(expert):
    results = _ask(
        _tool(expert.url, timeout_s=0.5, max_retries=1),
        "think hard",
        "partial answer",
        "filtered words",
        "blank reply",
        "busy now",
        "down now",
        "hang on",
        "long context",
        "fine question",
    )
    kinds = [result.kind for result in results]
    assert kinds == [
        "truncated",
        "truncated",
        "truncated",
        "empty",
        "infra_error",
        "infra_error",
        "infra_error",
        "refused",
        "ok",
    ]
    think, partial, filtered, blank, busy, down, hang, long, fine = results
    assert think.error == (
        "expert 'm' hit its output cap (256 output tokens, 256 of them "
        "reasoning; max_tokens=256) before writing any answer"
    )
    # Billed as the endpoint counted it, reasoning included: spent, though no answer came.
    assert think.usage.reasoning_tokens == 256 and think.cost_usd > 0
    assert partial.output == "The capital of France is"
    assert partial.observation.endswith("What came back before the cut:\nThe capital of France is")
    assert filtered.error == "expert 'm' was stopped by a content filter before writing any answer"
    assert blank.observation.startswith("Empty result: expert 'm' replied with no text")
    assert "HTTP 429: Rate limit reached" in busy.error and "after 2 attempts" in busy.error
    assert "HTTP 500: upstream exploded" in down.error
    assert "timed out after 0.5 s" in hang.error
    assert long.observation.startswith("Refused: expert 'm' failed: POST ")
    assert (fine.output, fine.error, fine.usage.reasoning_tokens) == ("Paris.", None, 30)
    assert all(
        result.observation.startswith(
            "Unavailable (infrastructure failure, not the call's fault): "
        )
        for result in (busy, down, hang)
    )


def test_the_ledger_keeps_each_calls_kind_and_reasoning_tokens(expert):
    toolbox = Toolbox([_tool(expert.url)])

    async def calls():
        try:
            return [
                await toolbox.call("ask", {"model": "m", "question": question})
                for question in ("think hard", "fine question")
            ]
        finally:
            await toolbox.close()

    think, fine = (CallRecord.of("ask", {"model": "m"}, result) for result in asyncio.run(calls()))
    assert (think.kind, think.output_tokens, think.reasoning_tokens) == ("truncated", 256, 256)
    assert (fine.kind, fine.output_tokens, fine.reasoning_tokens) == ("ok", 40, 30)
    assert think.endpoint == "ask(model=m)" and think.cost_usd > 0


def test_an_endpoint_failing_in_a_row_is_left_alone_then_used_again_once_back(expert):
    tool = _tool(expert.url, max_retries=0, guard={"failures": 2, "cooldown_s": 0.6})

    async def run():
        async def ask(question):
            return await tool.call({"model": "m", "question": question}, ToolContext())

        try:
            failed = [await ask("down now") for _ in range(2)]  # the circuit opens
            reached = expert.requests
            fast = [await ask("fine question") for _ in range(3)]
            untouched = expert.requests == reached
            expert.healthy = True
            await asyncio.sleep(0.7)  # the cool-down
            back = [await ask("down now") for _ in range(2)]  # a probe, then the circuit closed
            return failed, fast, untouched, back
        finally:
            await tool.close()

    failed, fast, untouched, back = asyncio.run(run())
    assert [result.kind for result in failed + fast] == ["infra_error"] * 5
    assert untouched  # calls fail at once while it is open: nothing is sent
    assert all("circuit open after 2 failed requests in a row" in result.error for result in fast)
    assert [result.kind for result in back] == ["ok", "ok"]


def test_the_retry_budget_stops_retries_past_its_share(expert):
    tool = _tool(
        expert.url, max_retries=3, guard={"retry_ratio": 0.0, "retry_reserve": 1, "failures": 0}
    )
    first, second = _ask(tool, "busy now", "busy now")
    # One retry in reserve: the first call retries once, the second not at all.
    assert (
        "failed after 2 attempts, not retried: the endpoint's retry budget is spent" in first.error
    )
    assert "failed after 1 attempt, not retried" in second.error
    assert expert.requests == 3 and first.kind == second.kind == CallKind.INFRA_ERROR
