"""The replies of OpenAI-compatible servers: what a chat completion and a text completion come to
(:class:`ChatResult`, :class:`Completion`) and how a reply's decoded body is read into one
(:func:`parse_chat`, :func:`parse_completion`), apart from the client's HTTP, retries and
refusals (:mod:`nemo_orch.clients.openai`).

Replies are read as the OpenAI API defines them, whatever a server sends: a shape the API allows
is parsed (content as a list of content parts, a null content beside tool calls, no usage, tool
call arguments sent as an object, as some vLLM versions do); any other is a :class:`Departure`
saying what was wrong, which the client raises as a
:class:`~nemo_orch.clients.openai.MalformedReply` naming the endpoint, an error of that call
only. A reply streamed as server-sent events is gathered chunk by chunk into the reply it stands
for: content and tool-call deltas joined, the last finish reason, the usage of the final chunk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from nemo_orch.call_kinds import CallKind
from nemo_orch.clients.sse import EventStream


@dataclass(frozen=True)
class ChatResult:
    """One chat completion (the first choice): the assistant text, token usage as the server
    counted it (0 where it sent none), why it ended and the wall-clock seconds of the request
    (retries included). ``text`` is the content's text (its text parts joined), or the model's
    refusal (``message.refusal`` or refusal parts) when it wrote none: a refusal is what the
    model answered. ``tool_calls`` are normalized: each is ``{"id": str | None, "type":
    "function", "function": {"name": str, "arguments": str}}`` (arguments sent as a JSON value
    other than a string are serialized, so a model's non-object arguments stay that call's
    error for the caller's own argument check; none sent is ``"{}"``)."""

    text: str
    input_tokens: int
    output_tokens: int
    finish_reason: str
    latency_s: float
    model: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    # Of output_tokens, those spent reasoning (``usage.completion_tokens_details``), which
    # OpenAI counts among the completion tokens and bills at the output price.
    reasoning_tokens: int = 0
    # Answered from the call store (nemo_orch.clients.call_store): recorded, not paid again.
    replayed: bool = False

    def unusable(self, max_tokens: int | None) -> tuple[CallKind, str] | None:
        """Why this reply is no usable answer, and its kind (None: it is one): cut by the
        endpoint (``finish_reason`` ``length``, as a reasoning model's that spent its cap
        thinking, or ``content_filter``: ``truncated``), or without text (``empty``); the
        reason is a phrase of which the endpoint is the subject. ``max_tokens``: the cap it
        was asked with, for the message."""
        spent = (
            f" ({self.output_tokens} output tokens, {self.reasoning_tokens} of them "
            f"reasoning; max_tokens={max_tokens})"
        )
        if self.finish_reason == "length":
            return CallKind.TRUNCATED, (
                f"hit its output cap{spent}" + ("" if self.text else " before writing any answer")
            )
        if self.finish_reason == "content_filter":
            return CallKind.TRUNCATED, (
                "was stopped by a content filter"
                + ("" if self.text else " before writing any answer")
            )
        if not self.text.strip() and not self.tool_calls:
            return CallKind.EMPTY, f"replied with no text{spent}"
        return None


@dataclass(frozen=True)
class Completion:
    """One text completion (the first choice): the text, why it ended, the sampled tokens and
    their logprobs as the server names them (empty when it sent none) and the prompt's tokens
    as the server counted them (None: it sent no usage)."""

    text: str
    finish_reason: str
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None


class Departure(Exception):
    """Where a reply departs from the OpenAI API's shapes (the client raises it as a
    :class:`~nemo_orch.clients.openai.MalformedReply` naming the endpoint)."""


def _kind(value: Any) -> str:
    """What a decoded JSON value is, as an error names it."""
    kinds = {
        type(None): "null",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }
    return kinds.get(type(value), type(value).__name__)


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Departure(f"{path} is {_kind(value)}, not an object")
    return value


def _member(parent: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    """``parent[key]``, an object."""
    if key not in parent:
        raise Departure(f"{_at(path, key)} is missing")
    return _object(parent[key], _at(path, key))


def _string(parent: dict[str, Any], key: str, path: str) -> str:
    """``parent[key]``, a string; "" when absent or null."""
    value = parent.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise Departure(f"{_at(path, key)} is {_kind(value)}, not a string")
    return value


def _count(parent: dict[str, Any], key: str, path: str) -> int:
    """``parent[key]``, a token count; 0 when absent or null."""
    value = parent.get(key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 7.0: a count all the same
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise Departure(f"{_at(path, key)} is {_kind(value)}, not a token count")
    return value


def _list_of(
    parent: dict[str, Any], key: str, path: str, kinds: tuple[type, ...], what: str
) -> list[Any]:
    """``parent[key]``, a list of ``kinds`` (booleans are no numbers); [] when absent or
    null."""
    values = parent.get(key)
    if values is None:
        return []
    if not isinstance(values, list) or not all(
        isinstance(value, kinds) and not isinstance(value, bool) for value in values
    ):
        raise Departure(f"{_at(path, key)} is not a list of {what}")
    return values


def _first_choice(body: Any) -> dict[str, Any]:
    body = _object(body, "the body")
    choices = body.get("choices")
    if isinstance(choices, list) and choices:
        return _object(choices[0], "choices[0]")
    problem = (
        "the body has no choices"
        if choices is None
        else "choices is empty"
        if choices == []
        else f"choices is {_kind(choices)}, not a list"
    )
    error = body.get("error")  # some proxies answer a failure with HTTP 200
    if error is not None:
        message = error.get("message", error) if isinstance(error, dict) else error
        problem += f" (it carries an error: {str(message)[:200]})"
    raise Departure(problem)


def _content(content: Any, path: str) -> tuple[str, str]:
    """The text and the refusal of a message's content: a string, null, or a list of content
    parts (text and refusal parts; other kinds, such as audio or a server's reasoning, are no
    text and skipped)."""
    if content is None or isinstance(content, str):
        return content or "", ""
    if not isinstance(content, list):
        raise Departure(f"{path} is {_kind(content)}, not a string, a list of parts or null")
    texts, refusals = [], []
    for index, part in enumerate(content):
        where = f"{path}[{index}]"
        part = _object(part, where)
        kind = part.get("type")
        if kind == "text":
            texts.append(_string(part, "text", where))
        elif kind == "refusal":
            refusals.append(_string(part, "refusal", where))
        elif not isinstance(kind, str):
            raise Departure(f"{where}.type is {_kind(kind)}, not a string")
    return "".join(texts), "".join(refusals)


def _tool_calls(calls: Any, path: str) -> list[dict[str, Any]]:
    """A message's tool calls, normalized (see :class:`ChatResult`)."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise Departure(f"{path} is {_kind(calls)}, not a list")
    normalized = []
    for index, call in enumerate(calls):
        where = f"{path}[{index}]"
        call = _object(call, where)
        if call.get("type") not in (None, "function"):
            raise Departure(f'{where}.type is not "function" (only function tools are sent)')
        function = _member(call, "function", where)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise Departure(f"{where}.function has no name")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = "{}"
        elif not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        normalized.append(
            {
                "id": _string(call, "id", where) or None,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return normalized


def parse_chat(body: Any, model: str, latency_s: float) -> ChatResult:
    """The :class:`ChatResult` of a ``/chat/completions`` reply's decoded ``body`` (``model``:
    the one asked for, where the reply names none; a streamed reply's
    :class:`~nemo_orch.clients.sse.EventStream`, gathered) that took ``latency_s``; a
    :class:`Departure` where the body departs from the shapes the OpenAI API allows."""
    if isinstance(body, EventStream):
        body = _gathered_chat(_chunks(body))
    choice = _first_choice(body)
    message = _member(choice, "message", "choices[0]")
    text, refused = _content(message.get("content"), "choices[0].message.content")
    refused += _string(message, "refusal", "choices[0].message")
    usage = body.get("usage")
    usage = {} if usage is None else _object(usage, "usage")
    details = usage.get("completion_tokens_details")
    details = {} if details is None else _object(details, "usage.completion_tokens_details")
    return ChatResult(
        text=text or refused,
        input_tokens=_count(usage, "prompt_tokens", "usage"),
        output_tokens=_count(usage, "completion_tokens", "usage"),
        finish_reason=_string(choice, "finish_reason", "choices[0]"),
        latency_s=latency_s,
        model=_string(body, "model", "") or model,
        tool_calls=_tool_calls(message.get("tool_calls"), "choices[0].message.tool_calls"),
        reasoning_tokens=_count(details, "reasoning_tokens", "usage.completion_tokens_details"),
    )


def parse_completion(body: Any) -> Completion:
    """The :class:`Completion` of a ``/completions`` reply's decoded ``body`` (a streamed
    reply's events, gathered); a :class:`Departure` where it departs from the shapes the OpenAI
    API allows."""
    if isinstance(body, EventStream):
        body = _gathered_completion(_chunks(body))
    choice = _first_choice(body)
    logprobs = choice.get("logprobs")
    logprobs = {} if logprobs is None else _object(logprobs, "choices[0].logprobs")
    tokens = _list_of(logprobs, "tokens", "choices[0].logprobs", (str,), "strings")
    values = _list_of(logprobs, "token_logprobs", "choices[0].logprobs", (int, float), "numbers")
    usage = body.get("usage")
    usage = {} if usage is None else _object(usage, "usage")
    return Completion(
        text=_string(choice, "text", "choices[0]"),
        finish_reason=_string(choice, "finish_reason", "choices[0]"),
        tokens=tokens,
        token_logprobs=[float(value) for value in values],
        prompt_tokens=None
        if usage.get("prompt_tokens") is None
        else _count(usage, "prompt_tokens", "usage"),
    )


def _chunks(events: EventStream) -> list[dict[str, Any]]:
    """A stream's chunks: each event's data a JSON object; one carrying an ``error`` (how
    OpenAI-compatible servers report a failure mid-stream) is the reply's departure."""
    if not events:
        raise Departure("the event stream carries no chunk")
    chunks = []
    for index, data in enumerate(events):
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError):
            raise Departure(f"event {index} of the stream is not JSON: {data[:100]!r}") from None
        chunk = _object(chunk, f"event {index} of the stream")
        if chunk.get("error") is not None:
            error = chunk["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            raise Departure(f"the stream carries an error at event {index}: {str(message)[:200]}")
        chunks.append(chunk)
    return chunks


def _streamed_choice(chunk: dict[str, Any], where: str) -> dict[str, Any] | None:
    """A chunk's first choice (None: a chunk of no choices, as the usage's last one)."""
    choices = chunk.get("choices")
    if choices is None or choices == []:
        return None
    if not isinstance(choices, list):
        raise Departure(f"{where}.choices is {_kind(choices)}, not a list")
    return _object(choices[0], f"{where}.choices[0]")


def _joined(parent: dict[str, Any], key: str, where: str, into: list[str]) -> None:
    """Add ``parent[key]`` (a string, or null) to ``into``."""
    into.append(_string(parent, key, where))


def _gathered_chat(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``/chat/completions`` reply a stream of chunks stands for (its first choice)."""
    content: list[str] = []
    refusal: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish, usage, model = None, None, None
    for index, chunk in enumerate(chunks):
        where = f"chunk {index}"
        model = model or chunk.get("model")
        usage = chunk.get("usage") or usage
        choice = _streamed_choice(chunk, where)
        if choice is None:
            continue
        finish = choice.get("finish_reason") or finish
        # A proxy that wraps a whole reply in one event sends its message, not a delta.
        delta = choice.get("delta", choice.get("message"))
        delta = {} if delta is None else _object(delta, f"{where}.choices[0].delta")
        part, refused = _content(delta.get("content"), f"{where}.choices[0].delta.content")
        content.append(part)
        refusal.append(refused)
        _joined(delta, "refusal", f"{where}.choices[0].delta", refusal)
        streamed = delta.get("tool_calls")
        if streamed is None:
            continue
        if not isinstance(streamed, list):
            raise Departure(f"{where}.choices[0].delta.tool_calls is {_kind(streamed)}, not a list")
        for position, piece in enumerate(streamed):
            piece_at = f"{where}.choices[0].delta.tool_calls[{position}]"
            piece = _object(piece, piece_at)
            slot = piece.get("index", position)
            if not isinstance(slot, int) or isinstance(slot, bool):
                raise Departure(f"{piece_at}.index is {_kind(slot)}, not an integer")
            call = calls.setdefault(
                slot, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] = piece.get("id") or call["id"]
            call["type"] = piece.get("type") or call["type"]
            function = piece.get("function")
            function = {} if function is None else _object(function, f"{piece_at}.function")
            name = _string(function, "name", f"{piece_at}.function")
            arguments = function.get("arguments")
            if arguments is not None and not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)  # an object, at once
            call["function"]["name"] += name
            call["function"]["arguments"] += arguments or ""
    message = {
        "role": "assistant",
        "content": "".join(content) or None,
        "refusal": "".join(refusal) or None,
        "tool_calls": [calls[slot] for slot in sorted(calls)] or None,
    }
    return {
        "model": model,
        "usage": usage,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
    }


def _gathered_completion(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``/completions`` reply a stream of chunks stands for (its first choice)."""
    text: list[str] = []
    tokens: list[Any] = []
    values: list[Any] = []
    finish, usage = None, None
    for index, chunk in enumerate(chunks):
        where = f"chunk {index}"
        usage = chunk.get("usage") or usage
        choice = _streamed_choice(chunk, where)
        if choice is None:
            continue
        finish = choice.get("finish_reason") or finish
        _joined(choice, "text", f"{where}.choices[0]", text)
        logprobs = choice.get("logprobs")
        logprobs = {} if logprobs is None else _object(logprobs, f"{where}.choices[0].logprobs")
        tokens += _list_of(logprobs, "tokens", f"{where}.choices[0].logprobs", (str,), "strings")
        values += _list_of(
            logprobs, "token_logprobs", f"{where}.choices[0].logprobs", (int, float), "numbers"
        )
    return {
        "usage": usage,
        "choices": [
            {
                "index": 0,
                "text": "".join(text),
                "finish_reason": finish,
                "logprobs": {"tokens": tokens, "token_logprobs": values},
            }
        ],
    }
