"""A SIMULATED OpenAI chat endpoint for tests: a real HTTP server on 127.0.0.1 answering
``POST /v1/chat/completions`` as OpenAI's API answers (OpenAI itself cannot be reached offline).

For a reasoning model (gpt-5, gpt-5-mini, o3, o4-mini) it refuses what OpenAI refuses, with
OpenAI's error bodies: ``max_tokens`` ("Use 'max_completion_tokens' instead"), a temperature
or top_p other than 1, ``stop``, an unknown ``reasoning_effort``; its usage reports the reasoning
tokens inside the completion tokens (``completion_tokens_details.reasoning_tokens``), as OpenAI
bills them. A chat model (gpt-4.1) takes both caps and sampling parameters. Every request is
kept (body and Authorization header); with a key, an Authorization other than its gets 401 (an
open model's server takes none).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from support.local_http import Answer, JSONServer

REASONING_EFFORTS = ("minimal", "low", "medium", "high")
REASONING_TOKENS = 320  # what every reply of a reasoning model spent thinking
ANSWER_TOKENS = 12


def _error(status: int, message: str, param: str | None, code: str | None) -> tuple[int, dict]:
    return status, {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }


def reasoning_refusal(body: dict[str, Any]) -> tuple[int, dict] | None:
    """OpenAI's answer to a request its reasoning models refuse; None for one they take."""
    if "max_tokens" in body:
        return _error(
            400,
            "Unsupported parameter: 'max_tokens' is not supported with this "
            "model. Use 'max_completion_tokens' instead.",
            "max_tokens",
            "unsupported_parameter",
        )
    for name in ("temperature", "top_p"):
        if name in body and body[name] != 1:
            return _error(
                400,
                f"Unsupported value: '{name}' does not support {body[name]} with "
                "this model. Only the default (1) value is supported.",
                name,
                "unsupported_value",
            )
    if "stop" in body:
        return _error(
            400,
            "Unsupported parameter: 'stop' is not supported with this model.",
            "stop",
            "unsupported_parameter",
        )
    effort = body.get("reasoning_effort", "medium")
    if effort not in REASONING_EFFORTS:
        return _error(
            400,
            f"Invalid value: '{effort}'. Supported values are: 'minimal', 'low', "
            "'medium', and 'high'.",
            "reasoning_effort",
            "invalid_value",
        )
    return None


class SimulatedOpenAI:
    """Serves ``model`` (a reasoning model when ``reasoning``), replying ``reply(body)``; the
    key ``key``, if any, is required. ``url`` ends in ``/v1``."""

    def __init__(
        self,
        model: str,
        *,
        reasoning: bool,
        key: str | None,
        reply: Callable[[dict[str, Any]], str] = lambda body: "4",
    ) -> None:
        self.model, self.reasoning = model, reasoning
        self.requests: list[dict[str, Any]] = []

        def answer(path: str, headers: Mapping[str, str], body: Any) -> Answer:
            auth = headers.get("Authorization")
            self.requests.append({"path": path, "body": body, "auth": auth})
            if key is not None and auth != f"Bearer {key}":
                status, payload = _error(
                    401, "Incorrect API key provided.", None, "invalid_api_key"
                )
            elif path != "/v1/chat/completions":
                status, payload = _error(404, f"Invalid URL (POST {path})", None, None)
            else:
                status, payload = (reasoning and reasoning_refusal(body)) or (
                    200,
                    self.completion(body, reply(body)),
                )
            return status, payload, {}

        self._server = JSONServer(answer, url_path="/v1")
        self.url = self._server.url

    def completion(self, body: dict[str, Any], text: str) -> dict[str, Any]:
        prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
        thinking = REASONING_TOKENS if self.reasoning else 0
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": thinking + ANSWER_TOKENS,
            "total_tokens": prompt_tokens + thinking + ANSWER_TOKENS,
            "completion_tokens_details": {"reasoning_tokens": thinking},
        }
        return {
            "id": "chatcmpl-simulated",
            "object": "chat.completion",
            "created": 0,
            "model": self.model,
            "usage": usage,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": text},
                }
            ],
        }

    def __enter__(self) -> SimulatedOpenAI:
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()
