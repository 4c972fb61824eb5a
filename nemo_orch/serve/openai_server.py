"""An OpenAI-compatible HTTP endpoint for any :class:`Engine` (the trained orchestrator, on CPU).

Standard-library ``ThreadingHTTPServer`` (no web framework dependency); one lock serialises the
engine. Routes: ``POST /v1/chat/completions`` (messages and optional tools rendered with the
tokenizer's chat template), ``POST /v1/completions`` (text or token-id prompts, one or a batch),
``GET /v1/models`` and ``GET /health``. Besides the OpenAI fields it accepts vLLM's sampling
extensions (``top_k``, ``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``,
``return_tokens_as_token_ids``), so :class:`~nemo_orch.rollout.engines.openai.OpenAIEngine`
gets exact token ids back. Assistant content is returned as generated: tool calls stay as
``<tool_call>`` markup in ``content``.

Only the sampled tokens' logprobs exist (see :mod:`nemo_orch.rollout.engines.hf`), so requests
for alternatives (``logprobs > 0``, ``top_logprobs > 0``) are refused, as are streaming, ``n > 1``
and other features that would silently change the meaning of a request.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_orch.rollout.engines.base import Engine, EngineError, Generation, SamplingParams

log = logging.getLogger(__name__)

DEFAULT_CHAT_MAX_TOKENS = 512
DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
_MAX_BODY_BYTES = 16 * 2**20


class RequestError(Exception):
    """A request the server refuses: answered with ``status`` and an OpenAI error body."""

    def __init__(self, message: str, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def _field(body: dict, name: str, types: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise RequestError(f"'{name}' has the wrong type")
    if not isinstance(value, types):
        raise RequestError(f"'{name}' has the wrong type")
    return value


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


class _Service:
    """Request -> engine call -> response body, independent of HTTP."""

    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase,
                 model_name: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.lock = threading.Lock()
        self.created = int(time.time())

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": self.created, "owned_by": "nemo-orch"}]}

    def _check_common(self, body: dict) -> None:
        model = _field(body, "model", str)
        if model is not None and model != self.model_name:
            raise RequestError(f"the model '{model}' does not exist; this server serves "
                               f"'{self.model_name}'", 404, "not_found_error")
        refused = {"stream": bool(body.get("stream")), "n > 1": _field(body, "n", int, 1) != 1,
                   "best_of > 1": _field(body, "best_of", int, 1) != 1,
                   "echo": bool(body.get("echo")), "logit_bias": bool(body.get("logit_bias")),
                   "presence_penalty": bool(_field(body, "presence_penalty", (int, float), 0)),
                   "frequency_penalty": bool(_field(body, "frequency_penalty", (int, float), 0))}
        unsupported = [name for name, used in refused.items() if used]
        if unsupported:
            raise RequestError(f"not supported by this server: {', '.join(unsupported)}")

    def _sampling(self, body: dict, default_max_tokens: int) -> tuple[SamplingParams, bool]:
        """Sampling parameters of a request and whether stop strings stay in the text."""
        max_tokens = _field(body, "max_completion_tokens", int) or _field(
            body, "max_tokens", int, default_max_tokens)
        stop = _field(body, "stop", (str, list), [])
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) and s for s in stop):
            raise RequestError("'stop' must be a non-empty string or a list of them")
        stop_ids = _field(body, "stop_token_ids", list, [])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise RequestError("'stop_token_ids' must be a list of integers")
        if not _field(body, "ignore_eos", bool, False) and self.tokenizer.eos_token_id is not None:
            stop_ids = [*stop_ids, self.tokenizer.eos_token_id]
        top_k = _field(body, "top_k", int, 0)
        try:
            params = SamplingParams(
                max_new_tokens=max_tokens,
                temperature=float(_field(body, "temperature", (int, float), 1.0)),
                top_p=float(_field(body, "top_p", (int, float), 1.0)),
                top_k=0 if top_k == -1 else top_k,  # vLLM spells "disabled" -1
                stop_token_ids=tuple(dict.fromkeys(stop_ids)), stop_strings=tuple(stop),
                seed=_field(body, "seed", int))
        except EngineError as error:
            raise RequestError(str(error)) from None
        return params, _field(body, "include_stop_str_in_output", bool, False)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        try:
            with self.lock:
                return self.engine.generate(prompts, params)
        except EngineError as error:
            raise RequestError(str(error)) from None

    @staticmethod
    def _text(generation: Generation, keep_stop: bool) -> str:
        stop = generation.extra.get("stop")
        if isinstance(stop, str) and not keep_stop and stop in generation.text:
            return generation.text[:generation.text.index(stop)]
        return generation.text

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _token_strings(self, generation: Generation, as_ids: bool) -> list[str]:
        if as_ids:
            return [f"token_id:{t}" for t in generation.token_ids]
        return [self.tokenizer.decode([t]) for t in generation.token_ids]

    def chat(self, body: dict) -> dict:
        self._check_common(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list")
        tools = _field(body, "tools", list)
        if _field(body, "top_logprobs", int, 0):
            raise RequestError("top_logprobs is not supported: only the sampled tokens' "
                               "logprobs are available")
        prompt = self.tokenizer.encode(self._render(messages, tools), add_special_tokens=False)
        params, keep_stop = self._sampling(body, DEFAULT_CHAT_MAX_TOKENS)
        generation = self._generate([prompt], params)[0]
        logprobs = None
        if _field(body, "logprobs", bool, False):
            logprobs = {"content": [
                {"token": token, "logprob": value, "bytes": list(token.encode()),
                 "top_logprobs": []}
                for token, value in zip(self._token_strings(generation, False),
                                        generation.logprobs)]}
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "finish_reason": generation.finish_reason,
                             "logprobs": logprobs,
                             "message": {"role": "assistant",
                                         "content": self._text(generation, keep_stop)}}],
                "usage": self._usage(len(prompt), len(generation.token_ids))}

    def _render(self, messages: list, tools: list | None) -> str:
        clean = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RequestError(f"messages[{index}] must be an object with a 'role'")
            content = message.get("content")
            if isinstance(content, list):  # OpenAI content parts: only text is understood
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise RequestError(f"messages[{index}]: only text content parts are "
                                       f"supported")
                content = "".join(str(p.get("text", "")) for p in content)
            elif content is not None and not isinstance(content, str):
                raise RequestError(f"messages[{index}].content must be a string")
            clean.append({**message, "content": content})
        try:
            return self.tokenizer.apply_chat_template(clean, tools=tools or None,
                                                      add_generation_prompt=True, tokenize=False)
        except Exception as error:  # jinja errors: unknown role, malformed tool call, ...
            raise RequestError(f"cannot render the conversation: {error}") from None

    def completions(self, body: dict) -> dict:
        self._check_common(body)
        logprobs_n = _field(body, "logprobs", int)
        if logprobs_n:
            raise RequestError("logprobs > 0 is not supported: only the sampled tokens' "
                               "logprobs are available (logprobs=0)")
        prompts = self._prompts(body.get("prompt"))
        params, keep_stop = self._sampling(body, DEFAULT_COMPLETION_MAX_TOKENS)
        as_ids = _field(body, "return_tokens_as_token_ids", bool, False)
        generations = self._generate(prompts, params)
        choices = []
        for index, generation in enumerate(generations):
            logprobs = None
            if logprobs_n is not None:
                tokens = self._token_strings(generation, as_ids)
                pieces = self._token_strings(generation, False)
                offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
                logprobs = {"tokens": tokens, "token_logprobs": generation.logprobs,
                            "top_logprobs": None, "text_offset": offsets}
            choices.append({"index": index, "text": self._text(generation, keep_stop),
                            "logprobs": logprobs, "finish_reason": generation.finish_reason})
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": self._usage(sum(map(len, prompts)),
                                     sum(len(g.token_ids) for g in generations))}

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
                raise RequestError("'prompt' must be a non-empty string, a list of token ids or "
                                   "a list of them")
        return out


def _handler(service: _Service, api_key: str | None) -> type[BaseHTTPRequestHandler]:
    routes: dict[tuple[str, str], Callable[..., dict]] = {
        ("GET", "/v1/models"): lambda _: service.models(),
        ("GET", "/health"): lambda _: {"status": "ok"},
        ("POST", "/v1/chat/completions"): service.chat,
        ("POST", "/v1/completions"): service.completions,
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: clients reuse their connections

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def _serve(self, method: str) -> None:
            try:
                body = self._read_body() if method == "POST" else {}
                route = routes.get((method, self.path.split("?")[0].rstrip("/") or "/"))
                if route is None:
                    raise RequestError(f"no route {method} {self.path}", 404, "not_found_error")
                if api_key is not None and route is not routes[("GET", "/health")]:
                    given = self.headers.get("Authorization", "")
                    if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                        raise RequestError("missing or wrong API key", 401,
                                           "authentication_error")
                self._reply(200, route(body))
            except RequestError as error:
                self._reply(error.status, {"error": {"message": str(error), "type": error.kind,
                                                     "code": error.status}})
            except Exception:
                log.exception("%s %s failed", method, self.path)
                self._reply(500, {"error": {"message": "internal server error",
                                            "type": "server_error", "code": 500}})

        def _read_body(self) -> dict:
            try:
                length = int(self.headers.get("Content-Length", 0))
            except ValueError:
                raise RequestError("bad Content-Length") from None
            if length > _MAX_BODY_BYTES:
                raise RequestError(f"request body over {_MAX_BODY_BYTES} bytes", 413)
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except ValueError as error:
                raise RequestError(f"the body is not valid JSON: {error}") from None
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object")
            return body

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    return Handler


class ServerHandle:
    """A running server: ``url`` is the OpenAI base URL (``http://host:port/v1``)."""

    def __init__(self, server: ThreadingHTTPServer) -> None:
        self._server = server
        self.host, self.port = server.server_address[:2]
        self.url = f"http://{self.host}:{self.port}/v1"
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                         name=f"openai-server-{self.port}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the server is closed (e.g. by Ctrl-C in ``nemo-orch serve``)."""
        while self._thread.is_alive():
            self._thread.join(timeout=0.5)

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_server(engine: Engine, tokenizer: PreTrainedTokenizerBase, model_name: str,
                 host: str = "127.0.0.1", port: int = 0, *,
                 api_key: str | None = None) -> ServerHandle:
    """Serve ``engine`` in background threads (``port=0``: a free port); with ``api_key``, every
    route but ``/health`` requires ``Authorization: Bearer <api_key>``."""
    server = ThreadingHTTPServer((host, port), _handler(_Service(engine, tokenizer, model_name),
                                                        api_key))
    server.daemon_threads = True
    return ServerHandle(server)
