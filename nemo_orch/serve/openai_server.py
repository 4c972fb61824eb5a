"""An OpenAI-compatible HTTP endpoint for any :class:`Engine` (the trained orchestrator, an
expert or a judge).

Served by :func:`nemo_orch.serve.http_server.serve_json`; one lock serialises the engine.
Routes: ``POST /v1/chat/completions`` (messages and optional tools rendered with the tokenizer's
chat template), ``POST /v1/completions`` (text or token-id prompts, one or a batch),
``GET /v1/models`` and ``GET /health``. Besides the OpenAI fields it accepts vLLM's sampling
extensions (``top_k``, ``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``,
``return_tokens_as_token_ids``), so :class:`~nemo_orch.rollout.engines.openai.OpenAIEngine`
gets exact token ids back. A request's fields, tools, messages and stream options are read and
checked by :mod:`nemo_orch.serve.openai_requests`.

Function calling works like vLLM's hermes tool parser: with ``tools`` (and ``tool_choice``
``auto``, the default), ``<tool_call>`` markup in the reply, read by the rollouts' own parser
(:func:`~nemo_orch.rollout.format.parse_turn`), comes back as ``message.tool_calls`` with the
rest of the text as ``content`` and ``finish_reason: "tool_calls"``; markup the parser cannot
read, and every reply under ``tool_choice: "none"``, is returned as generated. Conversations
may carry assistant ``tool_calls`` (arguments as a JSON string or object) and ``tool``
messages; they are rendered the way the policy writes and reads them.

Both generation routes stream with ``stream: true`` (server-sent events of OpenAI's chunks, then
``data: [DONE]``; with ``stream_options: {"include_usage": true}`` a last chunk with no choices
carries the usage). The engine generates a whole turn at once, so the stream is cut from the
finished response: each text in pieces (a word each), each tool call as vLLM's hermes parser
streams it (its ``id``, ``type`` and ``name`` first, then its ``arguments`` in pieces), the
``finish_reason`` in an empty closing piece. Accumulated, a stream is the response the same
request gets without ``stream``, and every refusal comes before it starts (a JSON error).

:mod:`nemo_orch.serve.orchestrator` serves these routes plus the orchestration loop.

Only the sampled tokens' logprobs exist (see :mod:`nemo_orch.rollout.engines.hf`), so requests
for alternatives (``logprobs > 0``, ``top_logprobs > 0``) are refused, as are logprobs in a
stream (its pieces are not tokens), ``stream_options`` other than ``include_usage``, ``n > 1``,
``tool_choice`` other than ``auto``/``none`` and other features that would silently change the
meaning of a request.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_orch.models.tokenizer import escape_markup
from nemo_orch.rollout.engines.base import Engine, EngineError, Generation, SamplingParams
from nemo_orch.rollout.format import TurnFormat, parse_turn, without_calls
from nemo_orch.serve.http_server import EventStream, RequestError, ServerHandle, serve_json
from nemo_orch.serve.openai_requests import (
    chat_messages,
    request_field,
    request_tools,
    stream_options,
)

log = logging.getLogger(__name__)

DEFAULT_CHAT_MAX_TOKENS = 512
DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
TOOL_CHOICES = ("auto", "none")
# Markup the parser cannot read as a call: the whole reply is content (as with vLLM).
_UNREADABLE_CALLS = ("malformed_json", "bad_call_shape", "unclosed_tag")
STREAMED_LOGPROBS = (
    "logprobs are not streamed by this server: a stream's pieces are cut from "
    "the finished text, not tokens"
)


def _is_token_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


class _SerialEngine:
    """The engine behind one lock, so chat, completion and episode requests take turns on it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.lock = threading.Lock()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[Generation]:
        with self.lock:
            return self.engine.generate(prompts, params, seeds)


# ---------------------------------------------------------------------- function calling
def outgoing_calls(text: str, turn: int, parallel: bool) -> list[dict]:
    """The ``<tool_call>`` markup of a reply as OpenAI ``tool_calls``; none when it has no call
    or markup the parser cannot read. Calls are read, not checked against the tools (no
    schemas: each is "unknown" but keeps its name and arguments): as with vLLM, that is the
    client's job. Ids are ``call_<turn>_<index>``, ``turn`` counting the request's assistant
    messages: unique within the conversation, and the same for the same request."""
    fmt = TurnFormat({}, multiple_calls="parallel" if parallel else "first")
    calls = parse_turn(text, fmt).calls
    if any(call.error_kind in _UNREADABLE_CALLS for call in calls):
        return []
    return [
        {
            "id": f"call_{turn}_{index}",
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for index, call in enumerate(calls)
    ]


def chat_completion(
    model: str,
    text: str,
    finish_reason: str,
    usage: tuple[int, int],
    *,
    calls_turn: int | None = None,
    parallel: bool = True,
    token_logprobs: list[tuple[str, float]] | None = None,
) -> dict:
    """A generated ``text`` as a ``chat.completion``: its ``<tool_call>`` markup as
    ``tool_calls`` (ids numbered by ``calls_turn``, the conversation's assistant messages so far;
    None: no tools offered, the text as it is) with ``finish_reason: "tool_calls"``; each sampled
    token's logprob where ``token_logprobs`` are given; ``usage``: (prompt, completion) tokens."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [] if calls_turn is None else outgoing_calls(text, calls_turn, parallel)
    if calls:
        message = {"role": "assistant", "content": without_calls(text) or None, "tool_calls": calls}
        finish_reason = "tool_calls"
    logprobs = None
    if token_logprobs is not None:
        logprobs = {
            "content": [
                {
                    "token": token,
                    "logprob": value,
                    "bytes": list(token.encode()),
                    "top_logprobs": [],
                }
                for token, value in token_logprobs
            ]
        }
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs, "message": message}
        ],
        "usage": _usage(*usage),
    }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_stream(response: dict, include_usage: bool) -> EventStream:
    """A finished chat completion as its stream of ``chat.completion.chunk`` events."""
    return EventStream(_chunks(response, "chat.completion.chunk", _chat_pieces, include_usage))


# ---------------------------------------------------------------------- streaming
def _pieces(text: str) -> list[str]:
    """``text`` cut before each word that follows whitespace, the way a token stream delivers
    it; an empty text is one empty piece, so that it is still sent."""
    return re.split(r"(?<=\s)(?=\S)", text)


def _message_deltas(message: dict) -> list[dict]:
    """The deltas that build a chat ``message``: the role, the content in pieces (none when it
    is null), then each tool call as vLLM's hermes parser streams it: its index, id, type and
    name first, then its arguments in pieces."""
    deltas = [{"role": "assistant"}]
    if message["content"] is not None:
        deltas += ({"content": piece} for piece in _pieces(message["content"]))
    for index, call in enumerate(message.get("tool_calls", ())):
        function = call["function"]
        deltas.append(
            {
                "tool_calls": [
                    {
                        "index": index,
                        "id": call["id"],
                        "type": call["type"],
                        "function": {"name": function["name"]},
                    }
                ]
            }
        )
        deltas += (
            {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
            for piece in _pieces(function["arguments"])
        )
    return deltas


def _chat_pieces(choice: dict) -> list[dict]:
    """A chat choice's part of each chunk: its message's deltas, then an empty one (OpenAI's
    closing delta, which carries the ``finish_reason``)."""
    return [*({"delta": delta} for delta in _message_deltas(choice["message"])), {"delta": {}}]


def _completion_pieces(choice: dict) -> list[dict]:
    """A completion choice's part of each chunk: its text in pieces, then an empty closing
    piece."""
    return [*({"text": piece} for piece in _pieces(choice["text"])), {"text": ""}]


def _chunks(
    response: dict, kind: str, pieces: Callable[[dict], list[dict]], include_usage: bool
) -> Iterator[dict]:
    """A finished ``response`` as the chunks of its stream (``object: kind``, the response's id,
    created and model): a chunk per piece of each choice (``pieces(choice)``), the last one with
    the choice's ``finish_reason``. With ``include_usage``, a final chunk of no choices carries
    the usage and the others ``usage: null``, as OpenAI streams them."""
    head = {
        "id": response["id"],
        "object": kind,
        "created": response["created"],
        "model": response["model"],
    }
    usage = {"usage": None} if include_usage else {}
    for choice in response["choices"]:
        parts = pieces(choice)
        for number, part in enumerate(parts, 1):
            finish_reason = choice["finish_reason"] if number == len(parts) else None
            yield {
                **head,
                "choices": [
                    {
                        "index": choice["index"],
                        **part,
                        "logprobs": None,
                        "finish_reason": finish_reason,
                    }
                ],
                **usage,
            }
    if include_usage:
        yield {**head, "choices": [], "usage": response["usage"]}


class OpenAIService:
    """Request -> engine call -> response body, independent of HTTP; ``routes`` for
    :func:`~nemo_orch.serve.http_server.serve_json`. ``engine`` is the served engine behind the
    lock every request takes."""

    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase, model_name: str) -> None:
        self.engine = _SerialEngine(engine)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.created = int(time.time())

    def routes(self) -> dict:
        return {
            ("GET", "/v1/models"): lambda _: self.models(),
            ("POST", "/v1/chat/completions"): self.chat,
            ("POST", "/v1/completions"): self.completions,
        }

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "nemo-orch",
                }
            ],
        }

    def check_model(self, body: dict) -> None:
        """A request naming another model is a 404 (as with OpenAI); naming none is fine."""
        model = request_field(body, "model", str)
        if model is not None and model != self.model_name:
            raise RequestError(
                f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                404,
                "not_found_error",
            )

    def _check_common(self, body: dict) -> None:
        self.check_model(body)
        number = (int, float)
        refused = {
            "n > 1": request_field(body, "n", int, 1) != 1,
            "best_of > 1": request_field(body, "best_of", int, 1) != 1,
            "echo": bool(body.get("echo")),
            "logit_bias": bool(body.get("logit_bias")),
            "presence_penalty": bool(request_field(body, "presence_penalty", number, 0)),
            "frequency_penalty": bool(request_field(body, "frequency_penalty", number, 0)),
        }
        unsupported = [name for name, used in refused.items() if used]
        if unsupported:
            raise RequestError(f"not supported by this server: {', '.join(unsupported)}")

    def _sampling(self, body: dict, default_max_tokens: int) -> tuple[SamplingParams, bool]:
        """Sampling parameters of a request and whether stop strings stay in the text."""
        max_tokens = request_field(body, "max_completion_tokens", int) or request_field(
            body, "max_tokens", int, default_max_tokens
        )
        stop = request_field(body, "stop", (str, list), [])
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) and s for s in stop):
            raise RequestError("'stop' must be a non-empty string or a list of them")
        stop_ids = request_field(body, "stop_token_ids", list, [])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise RequestError("'stop_token_ids' must be a list of integers")
        eos = self.tokenizer.eos_token_id
        if not request_field(body, "ignore_eos", bool, False) and eos is not None:
            stop_ids = [*stop_ids, eos]
        top_k = request_field(body, "top_k", int, 0)
        try:
            params = SamplingParams(
                max_new_tokens=max_tokens,
                temperature=float(request_field(body, "temperature", (int, float), 1.0)),
                top_p=float(request_field(body, "top_p", (int, float), 1.0)),
                top_k=0 if top_k == -1 else top_k,  # vLLM spells "disabled" -1
                stop_token_ids=tuple(dict.fromkeys(stop_ids)),
                stop_strings=tuple(stop),
                seed=request_field(body, "seed", int),
            )
        except EngineError as error:
            raise RequestError(str(error)) from None
        return params, request_field(body, "include_stop_str_in_output", bool, False)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        try:
            return self.engine.generate(prompts, params)
        except EngineError as error:
            raise RequestError(str(error)) from None

    @staticmethod
    def _text(generation: Generation, keep_stop: bool) -> str:
        stop = generation.extra.get("stop")
        if isinstance(stop, str) and not keep_stop and stop in generation.text:
            return generation.text[: generation.text.index(stop)]
        return generation.text

    def _token_strings(self, generation: Generation, as_ids: bool) -> list[str]:
        if as_ids:
            return [f"token_id:{t}" for t in generation.token_ids]
        return [self.tokenizer.decode([t]) for t in generation.token_ids]

    def chat(self, body: dict) -> dict | EventStream:
        self._check_common(body)
        stream, include_usage = stream_options(body)
        messages = chat_messages(body.get("messages"))
        tools = request_tools(body)
        tool_choice = request_field(body, "tool_choice", (str, dict), "auto")
        if tool_choice not in TOOL_CHOICES:
            raise RequestError(
                f'tool_choice {json.dumps(tool_choice)} is not supported: use "auto" or "none"'
            )
        parallel = request_field(body, "parallel_tool_calls", bool, True)
        if request_field(body, "top_logprobs", int, 0):
            raise RequestError(
                "top_logprobs is not supported: only the sampled tokens' logprobs are available"
            )
        want_logprobs = request_field(body, "logprobs", bool, False)
        if stream and want_logprobs:
            raise RequestError(STREAMED_LOGPROBS)
        # What the client's system, user and tool messages hold is text, never a turn marker
        # of the chat template (as the episode runner treats observations).
        messages = [
            message
            if message["role"] == "assistant" or not message["content"]
            else {**message, "content": escape_markup(message["content"], self.tokenizer)}
            for message in messages
        ]
        prompt = self.tokenizer.encode(self._render(messages, tools), add_special_tokens=False)
        params, keep_stop = self._sampling(body, DEFAULT_CHAT_MAX_TOKENS)
        generation = self._generate([prompt], params)[0]
        offered = tools and tool_choice == "auto"
        response = chat_completion(
            self.model_name,
            self._text(generation, keep_stop),
            generation.finish_reason,
            (len(prompt), len(generation.token_ids)),
            calls_turn=sum(m["role"] == "assistant" for m in messages) if offered else None,
            parallel=parallel,
            token_logprobs=list(zip(self._token_strings(generation, False), generation.logprobs))
            if want_logprobs
            else None,
        )
        return chat_stream(response, include_usage) if stream else response

    def _render(self, messages: list[dict], tools: list[dict] | None) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as error:  # jinja errors: unknown role, malformed tool call, ...
            raise RequestError(f"cannot render the conversation: {error}") from None

    def completions(self, body: dict) -> dict | EventStream:
        self._check_common(body)
        stream, include_usage = stream_options(body)
        logprobs_n = request_field(body, "logprobs", int)
        if logprobs_n:
            raise RequestError(
                "logprobs > 0 is not supported: only the sampled tokens' "
                "logprobs are available (logprobs=0)"
            )
        if stream and logprobs_n is not None:
            raise RequestError(STREAMED_LOGPROBS)
        prompts = self._prompts(body.get("prompt"))
        params, keep_stop = self._sampling(body, DEFAULT_COMPLETION_MAX_TOKENS)
        as_ids = request_field(body, "return_tokens_as_token_ids", bool, False)
        generations = self._generate(prompts, params)
        choices = []
        for index, generation in enumerate(generations):
            logprobs = None
            if logprobs_n is not None:
                tokens = self._token_strings(generation, as_ids)
                pieces = self._token_strings(generation, False)
                offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
                logprobs = {
                    "tokens": tokens,
                    "token_logprobs": generation.logprobs,
                    "top_logprobs": None,
                    "text_offset": offsets,
                }
            choices.append(
                {
                    "index": index,
                    "text": self._text(generation, keep_stop),
                    "logprobs": logprobs,
                    "finish_reason": generation.finish_reason,
                }
            )
        response = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(sum(map(len, prompts)), sum(len(g.token_ids) for g in generations)),
        }
        if stream:
            return EventStream(
                _chunks(response, "text_completion", _completion_pieces, include_usage)
            )
        return response

    def _prompts(self, prompt: Any) -> list[list[int]]:
        """A prompt (text or token ids) or a batch of them, as token ids."""
        if isinstance(prompt, str) or _is_token_list(prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("'prompt' must be a string, a list of token ids or a list of them")
        out = []
        for item in prompt:
            if isinstance(item, str) and item:
                out.append(self.tokenizer.encode(item, add_special_tokens=False))
            elif _is_token_list(item):
                out.append(item)
            else:
                raise RequestError(
                    "'prompt' must be a non-empty string, a list of token ids or a list of them"
                )
        return out


def start_server(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    api_key: str | None = None,
) -> ServerHandle:
    """Serve ``engine`` in background threads (``port=0``: a free port); with ``api_key``, every
    route but ``/health`` requires ``Authorization: Bearer <api_key>``."""
    service = OpenAIService(engine, tokenizer, model_name)
    return serve_json(
        service.routes(), host, port, api_key=api_key, url_path="/v1", name="openai-server"
    )
