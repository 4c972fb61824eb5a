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
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from nemo_orch.http import JSONClient
from nemo_orch.rollout.engines.base import (EngineError, Generation, SamplingParams,
                                            prompt_seeds)

log = logging.getLogger(__name__)

_TOKEN_ID_PREFIX = "token_id:"


class OpenAIError(EngineError):
    """A request that failed for good; ``status`` is the HTTP status (None: no response).
    An :class:`EngineError`, so engine users handle it like any other engine failure."""

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


class OpenAIClient(JSONClient):
    """Async client of one OpenAI-compatible server (``base_url`` ends in ``/v1``); the timeout,
    retry and key rules are :class:`~nemo_orch.http.JSONClient`'s."""

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

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: Sequence[int] | None = None) -> list[Generation]:
        return run_sync(self.agenerate(prompts, params, seeds))

    def update_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        raise EngineError("a served model cannot be refit through the OpenAI API; reload the "
                          "server with the new checkpoint instead")

    async def agenerate(self, prompts: list[list[int]], params: SamplingParams,
                        seeds: Sequence[int] | None = None) -> list[Generation]:
        """One request per prompt, ``concurrency`` at a time; results in prompt order. Each
        request carries its prompt's seed (:func:`prompt_seeds`), so the samples of a repeated
        prompt differ; with neither ``seeds`` nor ``params.seed`` the server picks."""
        semaphore = asyncio.Semaphore(self.concurrency)
        unseeded = seeds is None and params.seed is None
        request_seeds = [None] * len(prompts) if unseeded else prompt_seeds(params, len(prompts),
                                                                             seeds)

        async def one(prompt: list[int], seed: int | None) -> Generation:
            async with semaphore:
                return await self._generate_one(prompt, params, seed)

        return list(await asyncio.gather(*(one(p, s) for p, s in zip(prompts, request_seeds))))

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
