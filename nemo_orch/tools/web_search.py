"""The ``web_search`` tool: Tavily search (ToolOrchestra's web search backend) over HTTP.

One ``POST {base_url}/search`` per call with ``Authorization: Bearer <key>``; the answer is Tavily's
``{"query", "answer", "results": [{"title", "url", "content", "score", "raw_content"}],
"response_time"}``, rendered as a compact numbered list for the policy.

Failures follow the project's rule for external calls: a per-attempt timeout, bounded retries with
exponential backoff and jitter on what may pass (connection errors, timeouts, 429, 5xx), an
immediate error on what will not (401, 400, ...), and always an error *result*, never an exception.
The API key is read from the environment at call time and redacted from every message this module
produces, so it reaches neither the policy nor the logs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from typing import Any

import httpx

from nemo_orch.tools.base import BaseTool, Pricing, ToolContext, ToolError, ToolResult, ToolSpec
from nemo_orch.tools.base import Usage
from nemo_orch.tools.schema import argument_errors

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.tavily.com"
DEFAULT_KEY_ENV = "TAVILY_API_KEY"
# Tavily's pay-as-you-go price: $0.008 per API credit; a basic search costs 1 credit, an advanced
# one 2 (tavily.com/pricing, 2025).
USD_PER_CREDIT = 0.008
CREDITS_PER_SEARCH = {"basic": 1, "advanced": 2}
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
_MAX_DETAIL_CHARS = 200


def default_spec(search_depth: str = "basic") -> ToolSpec:
    """The tool as the policy sees it, priced per Tavily credit for ``search_depth``."""
    if search_depth not in CREDITS_PER_SEARCH:
        raise ToolError(f"web_search: search_depth must be one of {sorted(CREDITS_PER_SEARCH)}")
    return ToolSpec(
        name="web_search",
        description=("Search the web. Returns the top results, each with its title, URL and a "
                     "relevant excerpt."),
        parameters={
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "The search query."},
                "max_results": {"type": "integer", "minimum": 1, "maximum": 20,
                                "description": "How many results to return (default 5)."},
            },
            "required": ["query"],
        },
        pricing=Pricing(per_call=USD_PER_CREDIT * CREDITS_PER_SEARCH[search_depth]),
        latency_hint_s=1.5,
        max_concurrency=4,
        timeout_s=60.0,
    )


class _Retryable(Exception):
    """An attempt that failed in a way a later attempt may not (message is key-free)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class WebSearch(BaseTool):
    """Tavily web search with timeouts, bounded retries and a key that never leaks."""

    def __init__(self, spec: ToolSpec | None = None, *, api_key_env: str = DEFAULT_KEY_ENV,
                 base_url: str = DEFAULT_BASE_URL, search_depth: str = "basic",
                 max_results: int = 5, max_chars_per_result: int = 500,
                 request_timeout_s: float = 15.0, max_retries: int = 2,
                 backoff_base_s: float = 0.5, backoff_max_s: float = 8.0,
                 seed: int | None = None) -> None:
        super().__init__(spec or default_spec(search_depth))
        if search_depth not in CREDITS_PER_SEARCH:
            raise ToolError(f"web_search: search_depth must be one of {sorted(CREDITS_PER_SEARCH)}")
        if (max_results < 1 or max_chars_per_result < 1 or request_timeout_s <= 0
                or max_retries < 0 or backoff_base_s < 0 or backoff_max_s < backoff_base_s):
            raise ToolError("web_search: need max_results, max_chars_per_result >= 1, "
                            "request_timeout_s > 0, max_retries >= 0 and "
                            "0 <= backoff_base_s <= backoff_max_s")
        self.api_key_env = api_key_env
        self.url = base_url.rstrip("/") + "/search"
        self.search_depth = search_depth
        self.max_results = max_results
        self.max_chars_per_result = max_chars_per_result
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.backoff_base_s, self.backoff_max_s = backoff_base_s, backoff_max_s
        self._rng = random.Random(seed)
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._http()

    async def close(self) -> None:
        if self._client is not None:
            client, self._client, self._client_loop = self._client, None, None
            await client.aclose()

    def _http(self) -> httpx.AsyncClient:
        # A pooled client belongs to the event loop it was made on; a tool reused under a new
        # loop (e.g. successive asyncio.run calls) gets a fresh one.
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout_s))
            self._client_loop = loop
        return self._client

    def _backoff(self, attempt: int, retry_after_s: float | None) -> float:
        """Exponential backoff with equal jitter; a server's Retry-After is honoured up to the
        cap."""
        if retry_after_s is not None:
            return min(retry_after_s, self.backoff_max_s)
        delay = min(self.backoff_max_s, self.backoff_base_s * 2 ** attempt)
        return delay / 2 + self._rng.uniform(0, delay / 2)

    async def _attempt(self, body: dict[str, Any], key: str) -> dict[str, Any]:
        """One request: the parsed response, or _Retryable, or ToolError (final)."""
        try:
            async with asyncio.timeout(self.request_timeout_s):
                response = await self._http().post(
                    self.url, json=body, headers={"Authorization": f"Bearer {key}"})
        except (TimeoutError, httpx.TimeoutException):
            raise _Retryable(f"timed out after {self.request_timeout_s:g} s") from None
        except httpx.TransportError as error:
            raise _Retryable(f"cannot reach {self.url} ({type(error).__name__})") from None
        status = response.status_code
        if status in _RETRY_STATUSES:
            raise _Retryable(f"HTTP {status}", _retry_after(response) if status == 429 else None)
        if status in (401, 403):
            raise ToolError(f"Tavily rejected the API key in ${self.api_key_env} (HTTP {status})")
        if status != 200:
            raise ToolError(f"Tavily refused the request (HTTP {status}): "
                            f"{response.text[:_MAX_DETAIL_CHARS]}")
        try:
            payload = response.json()
        except ValueError:
            raise ToolError("Tavily sent a response that is not JSON") from None
        if not isinstance(payload, dict) or not isinstance(payload.get("results"), list):
            raise ToolError("Tavily sent a response without a 'results' list")
        return payload

    async def _search(self, body: dict[str, Any], key: str) -> dict[str, Any]:
        attempts = self.max_retries + 1
        attempt = 0
        while True:
            try:
                return await self._attempt(body, key)
            except _Retryable as failure:
                attempt += 1
                if attempt == attempts:
                    raise ToolError(f"web search failed after {attempts} attempts: "
                                    f"{failure}") from None
                delay = self._backoff(attempt - 1, failure.retry_after_s)
                logger.warning("web_search attempt %d/%d failed (%s); retrying in %.2f s",
                               attempt, attempts, failure, delay)
                await asyncio.sleep(delay)

    def _format(self, payload: dict[str, Any], max_results: int) -> str:
        lines = []
        if isinstance(payload.get("answer"), str) and payload["answer"].strip():
            lines.append(f"Answer: {payload['answer'].strip()}")
        for number, result in enumerate(payload["results"][:max_results], start=1):
            if not isinstance(result, dict):
                continue
            title = " ".join(str(result.get("title") or "(untitled)").split())
            content = " ".join(str(result.get("content") or "").split())
            if len(content) > self.max_chars_per_result:
                content = content[:self.max_chars_per_result].rstrip() + "..."
            lines.append(f"[{number}] {title} ({result.get('url') or 'no url'})\n{content}")
        return "\n".join(lines) if lines else "No results found."

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        start = time.perf_counter()
        errors = argument_errors(self.spec.parameters, arguments)
        query = arguments.get("query")
        max_results = arguments.get("max_results", self.max_results)
        if not errors and (not isinstance(query, str) or not query.strip()):
            errors.append("argument 'query' must be a non-empty string")
        if not errors and (isinstance(max_results, bool) or not isinstance(max_results, int)
                           or max_results < 1):
            errors.append("argument 'max_results' must be a positive integer")
        if errors:
            return ToolResult(error="; ".join(errors), latency_s=time.perf_counter() - start)
        key = os.environ.get(self.api_key_env, "").strip()
        if not key:
            return ToolResult(error=f"web search is not configured: set the environment "
                                    f"variable {self.api_key_env} to a Tavily API key",
                              latency_s=time.perf_counter() - start)
        body = {"query": query.strip(), "max_results": max_results,
                "search_depth": self.search_depth}
        try:
            payload = await self._search(body, key)
        except ToolError as error:
            message = _redact(str(error), key)
            logger.warning("web_search failed: %s", message)
            return ToolResult(error=message, latency_s=time.perf_counter() - start)
        latency = time.perf_counter() - start
        return ToolResult(output=_redact(self._format(payload, max_results), key),
                          latency_s=latency, cost_usd=self.spec.pricing.cost(Usage(), latency))


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers.get("retry-after", "")))
    except ValueError:
        return None


def _redact(text: str, key: str) -> str:
    """Remove the key from text that may echo it (e.g. a server's error body)."""
    return text.replace(key, "[redacted]")
