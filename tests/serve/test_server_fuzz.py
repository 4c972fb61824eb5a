"""The OpenAI-compatible server on 127.0.0.1 against hostile requests: any JSON body of any
shape, bodies that are not JSON, not UTF-8, nested past any parser's stack, or lying about their
length get an answer below 500 (a 4xx unless the request is valid), and the server stays up."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.strategies import json_values

from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.serve.openai_server import start_server

MODEL = "orchestrator"
FIELDS = [
    "model",
    "messages",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "stop_token_ids",
    "seed",
    "logprobs",
    "n",
    "stream",
    "parallel_tool_calls",
    "prompt",
    "ignore_eos",
    "role",
    "content",
    "tool_calls",
    "function",
    "name",
    "arguments",
    "type",
    "parameters",
    "id",
]
field_values = json_values(
    FIELDS,
    [
        "user",
        "assistant",
        "tool",
        "system",
        "function",
        MODEL,
        "auto",
        "none",
        '{"a": 1}',
        "{oops",
        "[1]",
    ],
    allow_nan=False,
)
bodies = st.dictionaries(st.sampled_from(FIELDS), field_values, max_size=6)


@pytest.fixture(scope="module")
def server(tiny_tokenizer):
    with start_server(
        ScriptedEngine(tiny_tokenizer, lambda prompt: "fine"), tiny_tokenizer, MODEL
    ) as handle:
        yield handle


def _raw(url: str, head: bytes, body: bytes) -> int:
    """A hand-written request (headers the clients would refuse to send); its status."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(head + b"\r\n\r\n" + body)
        connection.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := connection.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1])


@settings(
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(body=bodies, path=st.sampled_from(["/chat/completions", "/completions"]))
def test_any_json_body_is_answered_below_500(server, body, path):
    response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert response.json()["error"]["message"]


def test_bodies_that_are_not_json_objects_are_refused(server):
    path = "/v1/chat/completions"
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for body in (b"\xff\xfe\x00{", b"[1, 2]", b"{oops", deep, b'"\xed\xa0\x80"'):
        response = httpx.post(f"{server.url}/chat/completions", content=body, timeout=30)
        assert 400 <= response.status_code < 500, (body[:20], response.text)
    deep_arguments = {
        "model": MODEL,
        "messages": [
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100_000}}],
            }
        ],
    }
    assert (
        httpx.post(f"{server.url}/chat/completions", json=deep_arguments, timeout=30).status_code
        == 400
    )
    for length in (b"-5", b"abc", str(1 << 40).encode()):
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
        ).encode() + length
        assert 400 <= _raw(server.url, head, b"{}") < 500
    assert httpx.get(f"{server.url}/models", timeout=30).json()["data"][0]["id"] == MODEL
    assert json.loads(
        httpx.post(
            f"{server.url}/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        ).text
    )["choices"]
