"""The ``web_search`` tool: Tavily search (ToolOrchestra's web search backend) over HTTP.

One ``POST {base_url}/search`` per call with ``Authorization: Bearer <key>``; the answer is Tavily's
``{"query", "answer", "results": [{"title", "url", "content", "score", "raw_content"}],
"response_time"}``, rendered as a compact numbered list for the policy.

Failures follow the project's rule for external calls: a per-attempt timeout, bounded retries with
exponential backoff and jitter on what may pass (connection errors, timeouts, 429, 5xx), an
immediate error on what will not (401, 400, ...), and always an error *result* of its kind
(:mod:`nemo_orch.call_kinds`: a refused query is ``refused``, a key missing or rejected, an
outage or a malformed answer ``infra_error``), never an exception.
The transport is :class:`nemo_orch.clients.http.JSONClient`; the API key is read from the
environment and redacted from every message, so it reaches neither the policy nor the logs.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from nemo_orch.call_kinds import CallKind
from nemo_orch.clients.http import HTTPError, JSONClient
from nemo_orch.tools.base import (
    BaseTool,
    Pricing,
    ToolContext,
    ToolError,
    ToolResult,
    ToolSpec,
    billed_result,
    seconds_since,
)
from nemo_orch.tools.schema import argument_errors

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.tavily.com"
DEFAULT_KEY_ENV = "TAVILY_API_KEY"
# Tavily's pay-as-you-go price: $0.008 per API credit; a basic search costs 1 credit, an advanced
# one 2 (tavily.com/pricing, 2025).
USD_PER_CREDIT = 0.008
CREDITS_PER_SEARCH = {"basic": 1, "advanced": 2}


class _SearchFailed(Exception):
    """Why a search failed, key-free, and its kind."""

    def __init__(self, message: str, kind: CallKind) -> None:
        super().__init__(message)
        self.kind = kind


def default_spec(search_depth: str = "basic") -> ToolSpec:
    """The tool as the policy sees it, priced per Tavily credit for ``search_depth``."""
    if search_depth not in CREDITS_PER_SEARCH:
        raise ToolError(f"web_search: search_depth must be one of {sorted(CREDITS_PER_SEARCH)}")
    return ToolSpec(
        name="web_search",
        description=(
            "Search the web. Returns the top results, each with its title, URL and a "
            "relevant excerpt."
        ),
        parameters={
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "The search query."},
                "max_results": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 20,
                    "description": "How many results to return (default 5).",
                },
            },
            "required": ["query"],
        },
        pricing=Pricing(per_call=USD_PER_CREDIT * CREDITS_PER_SEARCH[search_depth]),
        latency_hint_s=1.5,
        max_concurrency=4,
        timeout_s=60.0,
    )


class WebSearch(BaseTool):
    """Tavily web search with timeouts, bounded retries and a key that never leaks."""

    def __init__(
        self,
        spec: ToolSpec | None = None,
        *,
        api_key_env: str = DEFAULT_KEY_ENV,
        base_url: str = DEFAULT_BASE_URL,
        search_depth: str = "basic",
        max_results: int = 5,
        max_chars_per_result: int = 500,
        request_timeout_s: float = 15.0,
        max_retries: int = 2,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 8.0,
        seed: int | None = None,
    ) -> None:
        super().__init__(spec or default_spec(search_depth))
        if search_depth not in CREDITS_PER_SEARCH:
            raise ToolError(f"web_search: search_depth must be one of {sorted(CREDITS_PER_SEARCH)}")
        if (
            max_results < 1
            or max_chars_per_result < 1
            or request_timeout_s <= 0
            or max_retries < 0
            or backoff_base_s < 0
            or backoff_max_s < backoff_base_s
        ):
            raise ToolError(
                "web_search: need max_results, max_chars_per_result >= 1, "
                "request_timeout_s > 0, max_retries >= 0 and "
                "0 <= backoff_base_s <= backoff_max_s"
            )
        self.api_key_env = api_key_env
        self.search_depth = search_depth
        self.max_results = max_results
        self.max_chars_per_result = max_chars_per_result
        self.client = JSONClient(
            base_url,
            api_key_env=api_key_env,
            timeout_s=request_timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_base_s,
            max_backoff_s=backoff_max_s,
            seed=seed,
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def _search(self, body: dict[str, Any]) -> dict[str, Any]:
        """Tavily's response, or :class:`_SearchFailed` with a key-free message."""
        try:
            payload = await self.client.request("POST", "search", body)
        except HTTPError as error:
            if error.status in (401, 403):
                raise _SearchFailed(
                    f"Tavily rejected the API key in ${self.api_key_env} (HTTP {error.status})",
                    error.kind,
                ) from None
            if error.status is not None and error.status < 400:
                raise _SearchFailed("Tavily sent a response that is not JSON", error.kind) from None
            if error.kind == CallKind.REFUSED:
                raise _SearchFailed(
                    f"Tavily refused the request (HTTP {error.status}): {error}", error.kind
                ) from None
            raise _SearchFailed(f"web search failed: {error}", error.kind) from None
        if not isinstance(payload, dict) or not isinstance(payload.get("results"), list):
            raise _SearchFailed(
                "Tavily sent a response without a 'results' list", CallKind.INFRA_ERROR
            )
        return payload

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
                content = content[: self.max_chars_per_result].rstrip() + "..."
            lines.append(f"[{number}] {title} ({result.get('url') or 'no url'})\n{content}")
        return "\n".join(lines) if lines else "No results found."

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        start = time.perf_counter()
        errors = argument_errors(self.spec.parameters, arguments)
        query = arguments.get("query")
        max_results = arguments.get("max_results", self.max_results)
        if not errors and (not isinstance(query, str) or not query.strip()):
            errors.append("argument 'query' must be a non-empty string")
        if not errors and (
            isinstance(max_results, bool) or not isinstance(max_results, int) or max_results < 1
        ):
            errors.append("argument 'max_results' must be a positive integer")
        if errors:
            return ToolResult(
                error="; ".join(errors), latency_s=seconds_since(self.spec, start, context)
            )
        if not os.environ.get(self.api_key_env, "").strip():
            return ToolResult(
                error=f"web search is not configured: set the environment "
                f"variable {self.api_key_env} to a Tavily API key",
                latency_s=seconds_since(self.spec, start, context),
                kind=CallKind.INFRA_ERROR,
            )
        body = {
            "query": query.strip(),
            "max_results": max_results,
            "search_depth": self.search_depth,
        }
        try:
            payload = await self._search(body)
        except _SearchFailed as error:
            logger.warning("web_search failed: %s", error)
            return ToolResult(
                error=str(error),
                kind=error.kind,
                latency_s=seconds_since(self.spec, start, context),
            )
        return billed_result(
            self.spec, start, context, self.client.scrub(self._format(payload, max_results))
        )
