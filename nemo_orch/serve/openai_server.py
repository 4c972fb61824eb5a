"""An OpenAI-compatible HTTP endpoint for any :class:`Engine` (the trained orchestrator, on CPU).

Served by :func:`nemo_orch.serve.http_server.serve_json`; one lock serialises the engine.
Routes: ``POST /v1/chat/completions`` (messages and optional tools rendered with the tokenizer's
chat template), ``POST /v1/completions`` (text or token-id prompts, one or a batch),
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

import logging
import threading
import time
import uuid
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_orch.rollout.engines.base import Engine, EngineError, Generation, SamplingParams
from nemo_orch.serve.http_server import RequestError, ServerHandle, serve_json

log = logging.getLogger(__name__)

DEFAULT_CHAT_MAX_TOKENS = 512
DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions


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


def start_server(engine: Engine, tokenizer: PreTrainedTokenizerBase, model_name: str,
                 host: str = "127.0.0.1", port: int = 0, *,
                 api_key: str | None = None) -> ServerHandle:
    """Serve ``engine`` in background threads (``port=0``: a free port); with ``api_key``, every
    route but ``/health`` requires ``Authorization: Bearer <api_key>``."""
    service = _Service(engine, tokenizer, model_name)
    routes = {
        ("GET", "/v1/models"): lambda _: service.models(),
        ("POST", "/v1/chat/completions"): service.chat,
        ("POST", "/v1/completions"): service.completions,
    }
    return serve_json(routes, host, port, api_key=api_key, url_path="/v1", name="openai-server")
