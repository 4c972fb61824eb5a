"""The client of OpenAI-compatible servers (vLLM, trtllm-serve, NIM, OpenAI, the project's own
:mod:`nemo_orch.serve.openai_server`): chat and completions under the project's rules for
external calls (:class:`~nemo_orch.clients.http.JSONClient`: a timeout on every request, a bounded
retry with exponential backoff on connection errors, timeouts, 429 and 5xx, other 4xx failing at
once, the API key read from an environment variable and never shown in logs, reprs or errors).

Replies are read as the OpenAI API defines them, whatever a server sends
(:mod:`nemo_orch.clients.openai_replies`): a shape the API allows is parsed; any other is a
:class:`MalformedReply` naming the endpoint and what was wrong, an error of that call only.
A reply streamed as server-sent events (asked for with the dialect's ``stream``, or sent so by
a server or proxy that only streams) is gathered into the reply it stands for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from nemo_orch.clients import call_store
from nemo_orch.clients.http import HTTPError, JSONClient, error_message
from nemo_orch.clients.openai_replies import (
    ChatResult,
    Completion,
    Departure,
    parse_chat,
    parse_completion,
)
from nemo_orch.config.base import ConfigError
from nemo_orch.config.dialect import DEFAULT_DIALECT, DIALECT_PRESETS, Dialect, parse_dialect

# How servers name a parameter they refuse: OpenAI's error ``code``s, and its message
# ("Unsupported parameter: 'max_tokens' is not supported with this model. ...").
_REFUSAL_CODES = frozenset({"unsupported_parameter", "unsupported_value", "invalid_value"})
# What differs from call to call: a refusal of it is that call's, not the configuration's.
_PER_CALL_FIELDS = frozenset({"messages", "prompt"})
_REFUSED_NAME = re.compile(r"Unsupported (?:parameter|value): '([\w.]+)'")


class OpenAIError(HTTPError):
    """A request that failed for good; ``status`` is the HTTP status (None: no response)."""


class MalformedReply(OpenAIError):
    """A reply (HTTP status below 400) that is not what the OpenAI API answers: a body that is
    no JSON object, no choice, a null message, a tool call that is no function call, ... That
    call failed, as one does after its retries are spent, and callers count it so. It is not
    retried: the server did answer (and may have billed) the request, and the same request at
    the same seed would most likely come back the same. ``status``: the HTTP status of a body
    that is not JSON; None for one that is (its reader sees the decoded body only)."""


class EndpointRefusal(ConfigError):
    """An endpoint refused a parameter of the request as declared: the same request would fail
    on every call, so this is a configuration error that stops the run, never an observation
    (catch-all handlers of tool, user, judge and engine failures let it through)."""


class OpenAIClient(JSONClient):
    """Async client of one OpenAI-compatible server (``base_url`` ends in ``/v1``) asked in its
    declared ``dialect`` (:func:`~nemo_orch.config.dialect.parse_dialect`: a preset's name, a
    mapping or a :class:`Dialect`); ``name`` is what the configuration calls the endpoint (e.g.
    ``env.user``), for errors. The timeout, retry and key rules are
    :class:`~nemo_orch.clients.http.JSONClient`'s."""

    error_type = OpenAIError

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        dialect: Dialect | str | Mapping[str, Any] = DEFAULT_DIALECT,
        name: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(base_url, **options)
        self.model, self.name = model, name
        self.dialect = parse_dialect(dialect, f"{name or base_url}: dialect")

    def __repr__(self) -> str:
        return f"OpenAIClient({self.base_url!r}, model={self.model!r})"

    async def models(self) -> list[str]:
        """Ids of the served models."""
        return [entry["id"] for entry in (await self.request("GET", "models"))["data"]]

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        model: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: Sequence[str] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        seed: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> ChatResult:
        """``POST /chat/completions`` as the dialect asks it: ``max_tokens`` sent as its output
        cap, sampling parameters only where it takes them, its ``reasoning_effort`` and
        ``extra_body``; ``extra`` adds request-specific fields last."""
        dialect = self.dialect
        sampling = {
            "temperature": temperature,
            "top_p": top_p,
            "stop": list(stop) if stop else None,
        }
        payload: dict[str, Any] = {
            "model": self._model(model),
            "messages": list(messages),
            dialect.output_cap: max_tokens,
            "tools": list(tools) if tools else None,
            "seed": seed,
            "reasoning_effort": dialect.reasoning_effort,
            **(sampling if dialect.sampling else {}),
        }
        payload = {key: value for key, value in payload.items() if value is not None}
        payload.update(dialect.extra_body)
        payload.update(self._streaming())
        payload.update(extra or {})
        start = time.monotonic()
        with call_store.noting_calls() as noted:
            body = await self.request("POST", "chat/completions", payload)
        # Through the call store, the seconds it measured (a replay's: when recorded).
        latency_s = sum(c.seconds for c in noted) if noted else time.monotonic() - start
        reply = self.read_chat(body, model=payload["model"], latency_s=latency_s)
        return dataclasses.replace(reply, replayed=any(c.replayed for c in noted))

    async def completions(
        self, prompt: str | list[int], *, model: str | None = None, **fields: Any
    ) -> Completion:
        """``POST /completions`` with the given request fields and the dialect's
        ``extra_body`` (and ``stream``). (The completions API caps replies with ``max_tokens``
        whatever the dialect.)"""
        return self.read_completion(
            await self.request(
                "POST",
                "completions",
                {
                    "model": self._model(model),
                    "prompt": prompt,
                    **fields,
                    **self.dialect.extra_body,
                    **self._streaming(),
                },
            )
        )

    def _streaming(self) -> dict[str, Any]:
        """The request fields of a dialect that streams: the reply as server-sent events, the
        usage in its last chunk."""
        return (
            {"stream": True, "stream_options": {"include_usage": True}}
            if self.dialect.stream
            else {}
        )

    async def request(
        self, method: str, path: str, payload: Mapping[str, Any] | None = None
    ) -> Any:
        """:meth:`JSONClient.request`; a success whose body is not JSON is a
        :class:`MalformedReply`."""
        try:
            return await super().request(method, path, payload)
        except OpenAIError as error:
            # JSONClient fails with a status below 400 only on a success it cannot decode.
            if error.status is None or error.status >= 400:
                raise
            raise self._malformed(
                path, f"the body (HTTP {error.status}) is not JSON", error.status
            ) from None

    def read_chat(self, body: Any, *, model: str, latency_s: float) -> ChatResult:
        """The :class:`ChatResult` of a ``/chat/completions`` reply's decoded ``body``
        (``model``: the one asked for, where the reply names none; a streamed reply's
        :class:`~nemo_orch.clients.sse.EventStream`, gathered); a :class:`MalformedReply`
        where the body departs from the shapes the OpenAI API allows."""
        try:
            return parse_chat(body, model, latency_s)
        except Departure as departure:
            raise self._malformed("chat/completions", str(departure)) from None

    def read_completion(self, body: Any) -> Completion:
        """The :class:`Completion` of a ``/completions`` reply's decoded ``body`` (a streamed
        reply's events, gathered); a :class:`MalformedReply` where it departs from the shapes
        the OpenAI API allows."""
        try:
            return parse_completion(body)
        except Departure as departure:
            raise self._malformed("completions", str(departure)) from None

    def refusal(
        self, response: httpx.Response, payload: Mapping[str, Any] | None
    ) -> EndpointRefusal | None:
        """A 400 naming a parameter this request sent as configured (not the conversation):
        the endpoint refuses how it is asked."""
        parameter = _refused_parameter(response)
        # A model that only streams refuses ``stream`` unsent (or false) on every call alike.
        if (
            response.status_code != 400
            or parameter in _PER_CALL_FIELDS
            or (parameter not in (payload or {}) and parameter != "stream")
        ):
            return None
        where = f"{self.name}: " if self.name else ""
        return EndpointRefusal(
            self.scrub(
                f"{where}the endpoint {self.base_url} (model {self.model}) refuses the request "
                f"parameter {parameter!r} ({error_message(response)}); declare how it is asked "
                f"with its dialect (presets: {', '.join(DIALECT_PRESETS)}; OpenAI's reasoning "
                "models take dialect: openai-reasoning; a model that only streams, "
                "dialect: {stream: true})"
            )
        )

    def _malformed(self, path: str, problem: str, status: int | None = None) -> MalformedReply:
        where = f"{self.name}: " if self.name else ""
        return MalformedReply(
            self.scrub(f"{where}malformed reply from {self.base_url}/{path}: {problem}"), status
        )

    def _model(self, model: str | None) -> str:
        chosen = model or self.model
        if not chosen:
            raise OpenAIError("no model name: pass model= or build the client with one")
        return chosen


def _refused_parameter(response: httpx.Response) -> str | None:
    """The request parameter a server's error response names as refused (OpenAI's
    ``error.param`` with one of :data:`_REFUSAL_CODES`, or its message), if any."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, dict):
        return None
    param, code = error.get("param"), error.get("code")
    # Any JSON may come back: a code that is a list or an object is no refusal code.
    if isinstance(param, str) and isinstance(code, str) and code in _REFUSAL_CODES:
        return param
    named = _REFUSED_NAME.search(str(error.get("message", "")))
    return named.group(1) if named else None


def run_sync(coroutine: Any) -> Any:
    """Run a coroutine to completion from sync code, even when an event loop is running here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
