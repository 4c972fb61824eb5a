"""Replies streamed as server-sent events: the client asks for them (``dialect: {stream:
true}``) or meets them unasked (a stream-only model, a proxy that always streams), and reads
each whole: against the project's own server, differentially with the ``openai`` SDK's own
accumulation of the same stream; against stubs on 127.0.0.1 that stream as vLLM and OpenAI do
(usage in the last chunk, tool calls in pieces, an error mid-stream); and on arbitrary text."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.local_http import JSONServer

from nemo_orch.clients.openai import EndpointRefusal, MalformedReply, OpenAIClient
from nemo_orch.clients.sse import EventStream, event_data
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.serve.openai_server import start_server

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _reply(prompt: str) -> str:
    if "weather" in prompt.lower():
        return (
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>'
        )
    return "It is sunny, 21 degrees, in Paris today."


@pytest.fixture(scope="module")
def server(tiny_tokenizer):
    with start_server(ScriptedEngine(tiny_tokenizer, _reply), tiny_tokenizer, "m") as handle:
        yield handle


@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["text", "tool_call"])
def test_a_streamed_reply_reads_as_the_openai_sdk_gathers_it(server, tools):
    from openai import OpenAI
    from openai.lib.streaming.chat import ChatCompletionStreamState

    messages = MESSAGES if tools else [{"role": "user", "content": "And tomorrow?"}]
    streaming = OpenAIClient(server.url, "m", dialect={"stream": True})
    ours = asyncio.run(streaming.chat(messages, tools=tools, max_tokens=64))
    plain = asyncio.run(OpenAIClient(server.url, "m").chat(messages, tools=tools, max_tokens=64))
    sdk = OpenAI(base_url=server.url, api_key="unused")
    state = ChatCompletionStreamState()
    for chunk in sdk.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
        **({"tools": tools} if tools else {}),
    ):
        state.handle_chunk(chunk)
    gathered = state.get_final_completion()
    choice = gathered.choices[0]
    assert ours.text == (choice.message.content or "") == plain.text
    assert ours.finish_reason == choice.finish_reason == plain.finish_reason
    assert (
        (ours.input_tokens, ours.output_tokens)
        == (gathered.usage.prompt_tokens, gathered.usage.completion_tokens)
        == (plain.input_tokens, plain.output_tokens)
    )
    sdk_calls = [
        {"name": call.function.name, "arguments": call.function.arguments}
        for call in choice.message.tool_calls or []
    ]
    assert (
        [call["function"] for call in ours.tool_calls]
        == sdk_calls
        == [call["function"] for call in plain.tool_calls]
    )
    assert bool(sdk_calls) == bool(tools)


def _sse(chunks: list) -> str:
    return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"


# A reasoning model's stream as OpenAI sends it: the content in pieces, the finish reason in
# the last choice, then a chunk of no choices with the usage (reasoning tokens among them).
REASONING_STREAM = [
    {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": "gpt-5-mini",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        "usage": None,
    },
    {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": "gpt-5-mini",
        "choices": [{"index": 0, "delta": {"content": "Four"}}],
        "usage": None,
    },
    {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": "gpt-5-mini",
        "choices": [{"index": 0, "delta": {"content": "."}, "finish_reason": "stop"}],
        "usage": None,
    },
    {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": "gpt-5-mini",
        "choices": [],
        "usage": {
            "prompt_tokens": 11,
            "completion_tokens": 90,
            "completion_tokens_details": {"reasoning_tokens": 88},
        },
    },
]


class StreamOnly(JSONServer):
    """A model (or a proxy in front of one) that answers every request as an event stream,
    asked or not, keeping each request's body."""

    def __init__(self, stream: str) -> None:
        self.bodies: list[dict] = []

        def answer(path, headers, body):
            self.bodies.append(body)
            return 200, stream, {"Content-Type": "text/event-stream"}

        super().__init__(answer, url_path="/v1")


@pytest.mark.parametrize("asked", [False, True], ids=["unasked", "asked"])
def test_a_stream_only_endpoint_is_read_whole_with_its_usage(asked):
    with StreamOnly(_sse(REASONING_STREAM)) as stub:
        client = OpenAIClient(
            stub.url, "gpt-5-mini", dialect={"preset": "openai-reasoning", "stream": asked}
        )
        reply = asyncio.run(client.chat(MESSAGES, max_tokens=100))
    assert (reply.text, reply.finish_reason) == ("Four.", "stop")
    assert (reply.input_tokens, reply.output_tokens, reply.reasoning_tokens) == (11, 90, 88)
    sent = stub.bodies[0]
    assert sent.get("stream") is (True if asked else None)
    assert sent.get("stream_options") == ({"include_usage": True} if asked else None)


def test_a_streamed_completion_keeps_its_logprobs():
    stream = _sse(
        [
            {
                "choices": [
                    {
                        "index": 0,
                        "text": "Hel",
                        "logprobs": {"tokens": ["Hel"], "token_logprobs": [-0.5]},
                    }
                ]
            },
            {
                "choices": [
                    {
                        "index": 0,
                        "text": "lo",
                        "finish_reason": "length",
                        "logprobs": {"tokens": ["lo"], "token_logprobs": [-1.0]},
                    }
                ]
            },
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
        ]
    )
    with StreamOnly(stream) as stub:
        client = OpenAIClient(stub.url, "m", dialect={"stream": True})
        completion = asyncio.run(client.completions("Say hello", max_tokens=2, logprobs=1))
    assert (completion.text, completion.finish_reason) == ("Hello", "length")
    assert (completion.tokens, completion.token_logprobs) == (["Hel", "lo"], [-0.5, -1.0])
    assert completion.prompt_tokens == 3


@pytest.mark.parametrize(
    "stream, problem",
    [
        (
            _sse(
                [
                    {"choices": [{"index": 0, "delta": {"content": "par"}}]},
                    {"error": {"message": "upstream overloaded", "type": "server_error"}},
                ]
            ),
            "the stream carries an error at event 1: upstream overloaded",
        ),
        ("data: {not json\n\n", "event 0 of the stream is not JSON"),
        (": only a keep-alive\n\n", "the event stream carries no chunk"),
        (_sse([{"choices": "many"}]), "chunk 0.choices is a string, not a list"),
    ],
    ids=["error-mid-stream", "not-json", "no-chunk", "bad-choices"],
)
def test_a_broken_stream_is_a_malformed_reply_of_the_infrastructure(stream, problem):
    with StreamOnly(stream) as stub:
        client = OpenAIClient(stub.url, "m", name="tool ask, model 'm'")
        with pytest.raises(MalformedReply, match=problem) as raised:
            asyncio.run(client.chat(MESSAGES))
    assert raised.value.kind == "infra_error"
    assert str(raised.value).startswith("tool ask, model 'm': malformed reply from ")


def test_a_model_that_only_streams_refusing_a_plain_request_names_the_dialect():
    refusal = {
        "error": {
            "message": "This model only supports streaming.",
            "param": "stream",
            "code": "unsupported_value",
            "type": "invalid_request_error",
        }
    }
    with JSONServer(lambda path, headers, body: (400, refusal, {}), url_path="/v1") as stub:
        client = OpenAIClient(stub.url, "o1-pro", name="tool ask, model 'pro'")
        with pytest.raises(EndpointRefusal, match=r"dialect: \{stream: true\}"):
            asyncio.run(client.chat(MESSAGES))


@given(st.text())
def test_event_data_never_raises(text):
    events = event_data(text)
    assert isinstance(events, EventStream) and all(isinstance(data, str) for data in events)


@given(
    st.lists(
        st.one_of(
            st.text(max_size=40),
            st.recursive(
                st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                lambda children: (
                    st.lists(children, max_size=3)
                    | st.dictionaries(
                        st.sampled_from(
                            [
                                "choices",
                                "delta",
                                "content",
                                "tool_calls",
                                "index",
                                "function",
                                "name",
                                "arguments",
                                "usage",
                                "error",
                                "message",
                                "text",
                                "finish_reason",
                                "logprobs",
                                "tokens",
                            ]
                        ),
                        children,
                        max_size=4,
                    )
                ),
                max_leaves=12,
            ).map(json.dumps),
        ),
        max_size=5,
    )
)
def test_any_stream_reads_as_a_reply_or_a_malformed_one(events):
    client = OpenAIClient("http://127.0.0.1:9/v1", "m")
    for read in (
        lambda body: client.read_chat(body, model="m", latency_s=0.0),
        client.read_completion,
    ):
        try:
            read(EventStream(events))
        except MalformedReply:
            pass
