from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from typing import Any

import pytest
from support.simulated_tavily import SimulatedTavily

from nemo_orch.tools.base import Tool, ToolContext, ToolError, ToolResult
from nemo_orch.tools.web_search import USD_PER_CREDIT, WebSearch, default_spec

KEY = "tvly-SECRET-0123456789abcdef"
RESULTS = [
    {
        "title": "Mount Everest - Wikipedia",
        "url": "https://en.wikipedia.org/wiki/Mount_Everest",
        "content": "Mount Everest is Earth's highest mountain above sea level, 8,849 m.",
        "score": 0.98,
        "raw_content": None,
    },
    {
        "title": "Everest facts",
        "url": "https://example.org/everest",
        "content": "First climbed in 1953 by Edmund Hillary and Tenzing Norgay. " * 20,
        "score": 0.91,
        "raw_content": None,
    },
    {
        "title": "K2",
        "url": "https://example.org/k2",
        "content": "The second highest.",
        "score": 0.5,
        "raw_content": None,
    },
]


def tavily_response(query: str, answer: str | None = None) -> dict[str, Any]:
    return {
        "query": query,
        "answer": answer,
        "results": RESULTS,
        "response_time": 0.42,
        "images": [],
        "follow_up_questions": None,
    }


@pytest.fixture
def tavily():
    server = SimulatedTavily(KEY, tavily_response)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def api_key(monkeypatch, caplog):
    monkeypatch.setenv("TAVILY_API_KEY", KEY)
    caplog.set_level(logging.DEBUG)  # every logger, httpx and httpcore included
    yield
    assert KEY not in caplog.text


def search(tool: WebSearch, arguments: dict[str, Any]) -> ToolResult:
    async def run() -> ToolResult:
        try:
            return await tool.call(arguments, ToolContext(task_id="t"))
        finally:
            await tool.close()

    result = asyncio.run(run())
    assert KEY not in json.dumps(result.to_json())
    return result


def fast_tool(url: str, **options: Any) -> WebSearch:
    options = {"backoff_base_s": 0.01, "backoff_max_s": 0.05, "seed": 0, **options}
    return WebSearch(base_url=url, **options)


def test_success_sends_tavily_request_and_formats_results(tavily):
    tool = fast_tool(tavily.url, max_chars_per_result=60)
    assert isinstance(tool, Tool)
    result = search(tool, {"query": "  highest mountain ", "max_results": 2})
    assert result.error is None
    assert tavily.requests == [
        {
            "path": "/search",
            "auth": f"Bearer {KEY}",
            "body": {"query": "highest mountain", "max_results": 2, "search_depth": "basic"},
        }
    ]
    lines = result.output.splitlines()
    assert lines[0] == "[1] Mount Everest - Wikipedia (https://en.wikipedia.org/wiki/Mount_Everest)"
    assert lines[1].startswith("Mount Everest is Earth's highest")
    assert lines[2] == "[2] Everest facts (https://example.org/everest)"
    assert lines[3].endswith("...") and len(lines[3]) <= 63
    assert "K2" not in result.output  # the server sent 3, the call asked for 2
    assert result.cost_usd == pytest.approx(USD_PER_CREDIT) and result.latency_s > 0


def test_answer_is_shown_first_and_defaults_apply(tavily):
    tavily.script.append((200, tavily_response("q", answer="8,849 m"), {}))
    result = search(fast_tool(tavily.url, search_depth="advanced"), {"query": "q"})
    assert result.output.startswith("Answer: 8,849 m\n[1] Mount Everest")
    assert tavily.requests[0]["body"] == {
        "query": "q",
        "max_results": 5,
        "search_depth": "advanced",
    }
    assert result.cost_usd == pytest.approx(2 * USD_PER_CREDIT)


def test_server_errors_are_retried_with_backoff(tavily, caplog):
    tavily.script += [(500, {"detail": "boom"}, {}), (503, "unavailable", {})]
    result = search(fast_tool(tavily.url), {"query": "q"})
    assert result.error is None and result.output.startswith("[1] Mount Everest")
    assert len(tavily.requests) == 3
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert [r.levelno for r in retries] == [logging.WARNING] * 2
    assert "HTTP 500" in retries[0].getMessage() and "HTTP 503" in retries[1].getMessage()


def test_rate_limit_honours_retry_after_then_gives_up(tavily):
    tavily.script.append((429, {"detail": "slow down"}, {"Retry-After": "0"}))
    result = search(fast_tool(tavily.url), {"query": "q"})
    assert result.error is None and len(tavily.requests) == 2

    tavily.requests.clear()
    tavily.script += [(429, {"detail": "slow down"}, {})] * 3
    result = search(fast_tool(tavily.url, max_retries=2), {"query": "q"})
    assert result.error.startswith("web search failed: ")
    assert "failed after 3 attempts; last error: HTTP 429" in result.error
    assert len(tavily.requests) == 3 and result.cost_usd == 0.0


def test_bad_key_fails_at_once_with_a_clear_error(tavily, monkeypatch):
    monkeypatch.setenv("TAVILY_API_KEY", "tvly-wrong-key")
    result = search(fast_tool(tavily.url), {"query": "q"})
    assert result.error == "Tavily rejected the API key in $TAVILY_API_KEY (HTTP 401)"
    assert len(tavily.requests) == 1


def test_client_errors_are_not_retried_and_echoed_keys_are_redacted(tavily):
    tavily.script.append((400, {"detail": {"error": f"Invalid request for key {KEY}"}}, {}))
    result = search(fast_tool(tavily.url), {"query": "q"})
    assert len(tavily.requests) == 1
    assert result.error.startswith("Tavily refused the request (HTTP 400): ")
    assert "Invalid request for key [redacted]" in result.error


def test_a_hanging_server_times_out_after_bounded_retries(tavily):
    tavily.hang = True
    start = time.perf_counter()
    result = search(fast_tool(tavily.url, request_timeout_s=0.3, max_retries=1), {"query": "q"})
    elapsed = time.perf_counter() - start
    assert result.error.endswith("failed after 2 attempts; last error: timed out after 0.3 s")
    assert len(tavily.requests) == 2 and elapsed < 3.0


def test_an_unreachable_server_fails_after_bounded_retries():
    with socket.socket() as probe:  # a port nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = search(fast_tool(f"http://127.0.0.1:{port}", max_retries=2), {"query": "q"})
    assert result.error.startswith(
        f"web search failed: POST http://127.0.0.1:{port}/search "
        "failed after 3 attempts; last error: ConnectError"
    )


def test_malformed_responses_are_error_results(tavily):
    tavily.script += [(200, "<html>not json</html>", {}), (200, {"results": "none"}, {})]
    tool = fast_tool(tavily.url)
    assert search(tool, {"query": "q"}).error == "Tavily sent a response that is not JSON"
    assert search(tool, {"query": "q"}).error == "Tavily sent a response without a 'results' list"


def test_missing_key_names_the_variable_and_sends_nothing(tavily, monkeypatch):
    monkeypatch.delenv("TAVILY_API_KEY")
    result = search(fast_tool(tavily.url), {"query": "q"})
    assert "TAVILY_API_KEY" in result.error and tavily.requests == []
    monkeypatch.setenv("MY_SEARCH_KEY", KEY)
    result = search(fast_tool(tavily.url, api_key_env="MY_SEARCH_KEY"), {"query": "q"})
    assert result.error is None and tavily.requests[0]["auth"] == f"Bearer {KEY}"


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({}, "missing argument 'query'"),
        ({"query": " "}, "non-empty"),
        ({"query": ["a"]}, "type string"),
        ({"query": "q", "max_results": 0}, ">= 1"),
        ({"query": "q", "max_results": 50}, "<= 20"),
        ({"query": "q", "api_key": "x"}, "undeclared argument 'api_key'"),
    ],
)
def test_bad_arguments_are_error_results(tavily, arguments, message):
    result = search(fast_tool(tavily.url), arguments)
    assert message in result.error and tavily.requests == []


def test_the_tool_survives_successive_event_loops(tavily):
    tool = fast_tool(tavily.url)
    for _ in range(2):  # no close in between: the second loop must not reuse the first's pool
        result = asyncio.run(tool.call({"query": "q"}, ToolContext()))
        assert result.error is None
    asyncio.run(tool.close())


def test_spec_and_options():
    spec = default_spec()
    assert spec.name == "web_search" and not spec.deterministic
    assert spec.pricing.per_call == pytest.approx(0.008)
    assert default_spec("advanced").pricing.per_call == pytest.approx(0.016)
    with pytest.raises(ToolError, match="search_depth"):
        WebSearch(search_depth="deep")
    with pytest.raises(ToolError, match="max_retries"):
        WebSearch(max_retries=-1)
