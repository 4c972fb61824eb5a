"""The client of OpenAI-compatible servers (vLLM, trtllm-serve, NIM, OpenAI, the project's own
:mod:`nemo_orch.serve.openai_server`): chat and completions under the project's rules for
external calls (:class:`~nemo_orch.clients.http.JSONClient`: a timeout on every request, a bounded
retry with exponential backoff on connection errors, timeouts, 429 and 5xx, other 4xx failing at
once, the API key read from an environment variable and never shown in logs, reprs or errors).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_orch.clients.http import HTTPError, JSONClient


class OpenAIError(HTTPError):
    """A request that failed for good; ``status`` is the HTTP status (None: no response)."""


@dataclass(frozen=True)
class ChatResult:
    """One chat completion: the assistant text, token usage as the server counted it, why it
    ended and the wall-clock seconds of the request (retries included)."""

    text: str
    input_tokens: int
    output_tokens: int
    finish_reason: str
    latency_s: float
    model: str = ""
    tool_calls: list[dict] = field(default_factory=list)


class OpenAIClient(JSONClient):
    """Async client of one OpenAI-compatible server (``base_url`` ends in ``/v1``); the timeout,
    retry and key rules are :class:`~nemo_orch.clients.http.JSONClient`'s."""

    error_type = OpenAIError

    def __init__(self, base_url: str, model: str | None = None, **options: Any) -> None:
        super().__init__(base_url, **options)
        self.model = model

    def __repr__(self) -> str:
        return f"OpenAIClient({self.base_url!r}, model={self.model!r})"

    async def models(self) -> list[str]:
        """Ids of the served models."""
        return [entry["id"] for entry in (await self.request("GET", "models"))["data"]]

    async def chat(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = None,
                   max_tokens: int | None = None, temperature: float | None = None,
                   top_p: float | None = None, stop: Sequence[str] | None = None,
                   tools: Sequence[Mapping[str, Any]] | None = None, seed: int | None = None,
                   extra: Mapping[str, Any] | None = None) -> ChatResult:
        """``POST /chat/completions``; ``extra`` adds server-specific fields to the request."""
        payload: dict[str, Any] = {"model": self._model(model), "messages": list(messages)}
        for key, value in (("max_tokens", max_tokens), ("temperature", temperature),
                           ("top_p", top_p), ("stop", list(stop) if stop else None),
                           ("tools", list(tools) if tools else None), ("seed", seed)):
            if value is not None:
                payload[key] = value
        payload.update(extra or {})
        start = time.monotonic()
        body = await self.request("POST", "chat/completions", payload)
        latency = time.monotonic() - start
        try:
            choice = body["choices"][0]
            message = choice["message"]
            usage = body.get("usage") or {}
            return ChatResult(text=message.get("content") or "",
                              input_tokens=int(usage.get("prompt_tokens", 0)),
                              output_tokens=int(usage.get("completion_tokens", 0)),
                              finish_reason=choice.get("finish_reason") or "",
                              latency_s=latency, model=body.get("model", payload["model"]),
                              tool_calls=list(message.get("tool_calls") or []))
        except (KeyError, IndexError, TypeError) as error:
            raise OpenAIError(f"{self.base_url}/chat/completions: malformed response "
                              f"(missing {error})") from None

    async def completions(self, prompt: str | list[int], *, model: str | None = None,
                          **fields: Any) -> dict[str, Any]:
        """``POST /completions`` with the given request fields; the raw response."""
        return await self.request("POST", "completions",
                                  {"model": self._model(model), "prompt": prompt, **fields})

    def _model(self, model: str | None) -> str:
        chosen = model or self.model
        if not chosen:
            raise OpenAIError("no model name: pass model= or build the client with one")
        return chosen


def run_sync(coroutine: Any) -> Any:
    """Run a coroutine to completion from sync code, even when an event loop is running here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
