"""The OpenAI-compatible client's rules for external calls, against small stdlib stubs on
127.0.0.1 that inject faults: clear errors, bounded retries, the API key never shown."""

import asyncio
import socket

import pytest
from support.local_http import JSONServer

from nemo_orch.clients.openai import OpenAIClient, OpenAIError

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


class Stub(JSONServer):
    """Answers from a script of (status, body), the last one for good, recording each request's
    headers and body."""

    def __init__(self, script):
        self.script, self.requests = list(script), []

        def answer(path, headers, body):
            self.requests.append((dict(headers), body))
            status, reply = self.script.pop(0) if len(self.script) > 1 else self.script[0]
            return status, reply, {}

        super().__init__(answer, url_path="/v1")


CHAT_OK = {
    "model": "m",
    "choices": [{"message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 7, "completion_tokens": 1},
}


def test_client_error_is_clear_and_not_retried():
    with Stub([(400, {"error": {"message": "messages must not be empty"}})]) as stub:
        client = OpenAIClient(stub.url, "m", max_retries=3, backoff_s=0.01)
        with pytest.raises(OpenAIError, match="HTTP 400: messages must not be empty") as error:
            asyncio.run(client.chat([]))
    assert error.value.status == 400 and len(stub.requests) == 1


def test_retries_server_errors_then_succeeds():
    with Stub([(503, {"error": {"message": "overloaded"}}), (429, {}), (200, CHAT_OK)]) as stub:
        client = OpenAIClient(stub.url, "m", max_retries=3, backoff_s=0.01)
        result = asyncio.run(client.chat(MESSAGES, max_tokens=4))
    assert (result.text, result.input_tokens, result.output_tokens) == ("4", 7, 1)
    assert len(stub.requests) == 3
    assert stub.requests[0][1]["max_tokens"] == 4 and stub.requests[0][1]["model"] == "m"


def test_unreachable_server_fails_after_bounded_retries():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = OpenAIClient(f"http://127.0.0.1:{port}/v1", "m", max_retries=2, backoff_s=0.01)
    with pytest.raises(OpenAIError, match="after 3 attempts.*Connect") as error:
        asyncio.run(client.chat(MESSAGES))
    assert error.value.status is None


def test_api_key_is_sent_but_never_shown(monkeypatch):
    secret = "sk-test-0123456789"
    monkeypatch.setenv("NEMO_ORCH_TEST_KEY", secret)
    with Stub([(401, {"error": {"message": f"bad key {secret}"}})]) as stub:
        client = OpenAIClient(stub.url, "m", api_key_env="NEMO_ORCH_TEST_KEY")
        with pytest.raises(OpenAIError) as error:
            asyncio.run(client.chat(MESSAGES))
    assert stub.requests[0][0]["Authorization"] == f"Bearer {secret}"
    assert secret not in str(error.value) and secret not in repr(client)
    monkeypatch.delenv("NEMO_ORCH_TEST_KEY")
    unset = OpenAIClient(stub.url, "m", api_key_env="NEMO_ORCH_TEST_KEY")  # read when used
    with pytest.raises(OpenAIError, match="NEMO_ORCH_TEST_KEY.*not set"):
        asyncio.run(unset.chat(MESSAGES))
