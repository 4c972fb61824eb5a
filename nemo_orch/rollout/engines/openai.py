"""OpenAI-compatible HTTP: a reusable async client and an :class:`Engine` over ``/v1/completions``.

:class:`OpenAIClient` talks to any OpenAI-compatible server (vLLM, trtllm-serve, NIM, OpenAI, the
project's own :mod:`nemo_orch.serve.openai_server`) with a timeout on every request and a bounded
retry with exponential backoff on connection errors, timeouts, 429 and 5xx; other 4xx fail at once.
The API key is read from an environment variable and never appears in logs, reprs or errors.

:class:`OpenAIEngine` evaluates a served model through the token-level :class:`Engine` seam. With
``extensions=True`` (vLLM and our server) it sends token ids as the prompt and vLLM's sampling
extensions (``top_k``, ``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``,
``return_tokens_as_token_ids``), so the returned token ids and logprobs are exact. Against a plain
OpenAI server it sends text and re-encodes the returned text; logprobs are then kept only when
they line up one-to-one with the re-encoded tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
from transformers import PreTrainedTokenizerBase

from nemo_orch.rollout.engines.base import EngineError, Generation, SamplingParams

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_TOKEN_ID_PREFIX = "token_id:"


class OpenAIError(EngineError):
    """A request that failed for good; ``status`` is the HTTP status (None: no response)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


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


class OpenAIClient:
    """Async client of one OpenAI-compatible server (``base_url`` ends in ``/v1``).

    ``api_key_env`` names the environment variable holding the key (sent as
    ``Authorization: Bearer``); a named variable that is unset is an error. Usable from several
    event loops in turn (each loop gets its own connection pool), so sync callers may wrap calls
    in ``asyncio.run``.
    """

    def __init__(self, base_url: str, model: str | None = None, *, api_key_env: str | None = None,
                 timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 0.5,
                 max_backoff_s: float = 8.0) -> None:
        if max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError("need max_retries >= 0, timeout_s > 0 and backoff_s >= 0")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._api_key: str | None = None
        if api_key_env:
            self._api_key = os.environ.get(api_key_env)
            if not self._api_key:
                raise OpenAIError(f"environment variable {api_key_env} (the API key of "
                                  f"{self.base_url}) is not set")
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}

    def __repr__(self) -> str:
        return f"OpenAIClient({self.base_url!r}, model={self.model!r})"

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        for other in [old for old in self._clients if old.is_closed()]:
            del self._clients[other]  # its connections died with their loop
        if loop not in self._clients:
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            self._clients[loop] = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                                    timeout=self.timeout_s)
        return self._clients[loop]

    async def aclose(self) -> None:
        """Close this loop's connection pool."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _scrub(self, text: str) -> str:
        return text.replace(self._api_key, "***") if self._api_key else text

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        retry_after = response.headers.get("retry-after") if response is not None else None
        if retry_after is not None:
            try:
                return min(float(retry_after), self.max_backoff_s)
            except ValueError:
                pass
        return min(self.backoff_s * 2**attempt, self.max_backoff_s) * (0.5 + random.random() / 2)

    async def request(self, method: str, path: str, payload: Mapping[str, Any] | None = None
                      ) -> dict[str, Any]:
        """One JSON request with the retry policy; the decoded JSON body on success."""
        url = f"{self.base_url}/{path.lstrip('/')}"
        for attempt in range(self.max_retries + 1):
            response = None
            try:
                response = await self._client().request(method, path.lstrip("/"), json=payload)
            except httpx.TransportError as error:  # connect errors, timeouts, dropped connections
                problem = f"{type(error).__name__}: {error}"
            else:
                if response.status_code < 400:
                    try:
                        return response.json()
                    except ValueError:
                        raise OpenAIError(f"{method} {url}: response is not JSON",
                                          response.status_code) from None
                problem = f"HTTP {response.status_code}: {_error_message(response)}"
                if response.status_code not in RETRY_STATUSES:
                    raise OpenAIError(self._scrub(f"{method} {url} failed with {problem}"),
                                      response.status_code)
            if attempt == self.max_retries:
                raise OpenAIError(self._scrub(
                    f"{method} {url} failed after {attempt + 1} attempts; last error: {problem}"),
                    response.status_code if response is not None else None)
            delay = self._delay(attempt, response)
            log.warning("%s %s: %s; retry %d/%d in %.2f s", method, url, self._scrub(problem),
                        attempt + 1, self.max_retries, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

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


def _error_message(response: httpx.Response) -> str:
    """The server's error message (OpenAI ``{"error": {"message"}}`` or raw text, shortened)."""
    try:
        body = response.json()
        error = body.get("error", body) if isinstance(body, dict) else body
        message = error.get("message", error) if isinstance(error, dict) else error
        text = str(message)
    except ValueError:
        text = response.text
    return text[:500]


def run_sync(coroutine: Any) -> Any:
    """Run a coroutine to completion from sync code, even when an event loop is running here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


class OpenAIEngine:
    """The :class:`Engine` seam over a served model's ``/v1/completions`` (for evaluation).

    ``extensions``: the server accepts token-id prompts and vLLM's sampling extensions (see the
    module docstring). ``concurrency`` bounds the requests in flight.
    """

    def __init__(self, client: OpenAIClient, tokenizer: PreTrainedTokenizerBase, *,
                 model: str | None = None, extensions: bool = True, concurrency: int = 8) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model = model
        self.extensions = extensions
        self.concurrency = concurrency

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        return run_sync(self.agenerate(prompts, params))

    def update_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        raise EngineError("a served model cannot be refit through the OpenAI API; reload the "
                          "server with the new checkpoint instead")

    async def agenerate(self, prompts: list[list[int]], params: SamplingParams
                        ) -> list[Generation]:
        """One request per prompt, ``concurrency`` at a time; results in prompt order. Prompt
        ``i`` is sampled with seed ``params.seed + i`` so the samples of a repeated prompt differ."""
        semaphore = asyncio.Semaphore(self.concurrency)

        async def one(index: int, prompt: list[int]) -> Generation:
            async with semaphore:
                return await self._generate_one(prompt, params, seed=None if params.seed is None
                                                else params.seed + index)

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    def _request_fields(self, params: SamplingParams, seed: int | None) -> dict[str, Any]:
        fields: dict[str, Any] = {"max_tokens": params.max_new_tokens,
                                  "temperature": params.temperature, "top_p": params.top_p,
                                  "logprobs": 0}
        if seed is not None:
            fields["seed"] = seed
        stop = list(params.stop_strings)
        if self.extensions:
            fields.update(stop_token_ids=list(params.stop_token_ids), ignore_eos=True,
                          include_stop_str_in_output=True, return_tokens_as_token_ids=True)
            if params.top_k:
                fields["top_k"] = params.top_k
        else:
            if params.top_k:
                raise EngineError("top_k needs a server with extensions (vLLM-compatible)")
            stop += [self.tokenizer.decode([t]) for t in params.stop_token_ids]
        if stop:
            fields["stop"] = stop
        return fields

    async def _generate_one(self, prompt: list[int], params: SamplingParams,
                            seed: int | None) -> Generation:
        sent: str | list[int] = prompt if self.extensions else self.tokenizer.decode(prompt)
        body = await self.client.completions(sent, model=self.model,
                                             **self._request_fields(params, seed))
        try:
            choice = body["choices"][0]
            text = choice.get("text") or ""
            logprobs = choice.get("logprobs") or {}
            tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
            finish_reason = choice.get("finish_reason") or "length"
        except (KeyError, IndexError, TypeError, AttributeError) as error:
            raise OpenAIError(f"{self.client.base_url}/completions: malformed response "
                              f"({error!r})") from None
        if tokens and all(str(t).startswith(_TOKEN_ID_PREFIX) for t in tokens):
            token_ids = [int(str(t)[len(_TOKEN_ID_PREFIX):]) for t in tokens]
        else:
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        values = [float(v) for v in values or []]
        extra: dict[str, Any] = {}
        if len(values) != len(token_ids):
            extra["server_logprobs"], values = values, []
        usage = body.get("usage") or {}
        return Generation(token_ids=token_ids, logprobs=values,
                          finish_reason=finish_reason,
                          text=self.tokenizer.decode(token_ids, skip_special_tokens=True)
                          if self.extensions else text,
                          prompt_tokens=int(usage.get("prompt_tokens", len(prompt))), extra=extra)
