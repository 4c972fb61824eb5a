"""Replies of OpenAI-compatible endpoints, whatever they send: a shape the OpenAI API allows
(content as a list of parts, a refusal, a null content beside tool calls, no usage, arguments
sent as an object) parses, normalized; any other (a null message, no choices, a body that is not
JSON, a tool call that is no function call) is a MalformedReply naming the endpoint, never a
crash, never retried. Property tests feed the client's readers arbitrary bodies; the named cases
go over real HTTP on 127.0.0.1, legal bodies also through the official ``openai`` SDK; a tau2
user endpoint answering each malformed body ends the episode as a counted ``user_error``."""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Any

import openai
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion
from openai.types.chat.chat_completion_assistant_message_param import ContentArrayOfContentPart
from pydantic import TypeAdapter
from support.local_http import JSONServer
from support.strategies import json_values

from nemo_orch.clients.openai import MalformedReply, OpenAIClient
from nemo_orch.clients.openai_replies import ChatResult, Completion

KEY = "sk-SENTINEL-malformed-0123456789"
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
FUZZED = OpenAIClient("http://127.0.0.1:9/v1", "m", name="fuzzed")
KEYS = [
    "choices",
    "message",
    "content",
    "tool_calls",
    "function",
    "name",
    "arguments",
    "id",
    "type",
    "usage",
    "prompt_tokens",
    "completion_tokens",
    "completion_tokens_details",
    "reasoning_tokens",
    "finish_reason",
    "refusal",
    "text",
    "model",
    "error",
    "logprobs",
    "tokens",
    "token_logprobs",
]
WORDS = [
    "function",
    "text",
    "refusal",
    "custom",
    "stop",
    "tool_calls",
    "calculator",
    "{}",
    '{"x": 1}',
    "token_id:5",
]
ANY = json_values(KEYS, WORDS, allow_nan=True)


def _or_any(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """``strategy``, or one time in four any JSON (so that whole bodies often get through)."""
    return st.sampled_from([strategy] * 3 + [ANY]).flatmap(lambda chosen: chosen)


# OpenAI-shaped bodies, each field drawn from its legal shapes and the malformed ones above.
TOOL_CALLS = st.lists(
    _or_any(
        st.fixed_dictionaries(
            {
                "function": _or_any(
                    st.fixed_dictionaries(
                        {"name": _or_any(st.sampled_from(["calculator", ""]))},
                        optional={
                            "arguments": _or_any(st.sampled_from(['{"x": 1}', "not json", ""]))
                        },
                    )
                )
            },
            optional={
                "id": _or_any(st.text(max_size=6)),
                "type": _or_any(st.sampled_from(["function", "custom"])),
            },
        )
    ),
    max_size=3,
)
PARTS = st.lists(
    _or_any(
        st.fixed_dictionaries(
            {"type": _or_any(st.sampled_from(["text", "refusal", "reasoning"]))},
            optional={
                "text": _or_any(st.text(max_size=8)),
                "refusal": _or_any(st.text(max_size=8)),
            },
        )
    ),
    max_size=3,
)
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.just("assistant"),
        "content": _or_any(st.one_of(st.text(max_size=10), PARTS)),
        "refusal": _or_any(st.text(max_size=8)),
        "tool_calls": _or_any(TOOL_CALLS),
    },
)
COUNTS = st.fixed_dictionaries(
    {},
    optional={
        key: _or_any(st.integers(-2, 10**6)) for key in ("prompt_tokens", "completion_tokens")
    },
)
CHOICE = st.fixed_dictionaries(
    {"message": _or_any(MESSAGE)},
    optional={
        "finish_reason": _or_any(st.just("stop")),
        "text": _or_any(st.text(max_size=10)),
        "logprobs": _or_any(
            st.fixed_dictionaries(
                {},
                optional={
                    "tokens": _or_any(st.lists(st.sampled_from(["token_id:5", "a"]), max_size=3)),
                    "token_logprobs": _or_any(st.lists(st.floats(-5, 0), max_size=3)),
                },
            )
        ),
    },
)
SHAPED = st.fixed_dictionaries(
    {"choices": _or_any(st.lists(_or_any(CHOICE), max_size=2))},
    optional={"usage": _or_any(COUNTS), "model": _or_any(st.just("served")), "error": ANY},
)
BODIES = st.one_of(st.binary(max_size=100), ANY, SHAPED)


def _assert_normalized(result: ChatResult) -> None:
    assert isinstance(result.text, str) and isinstance(result.finish_reason, str)
    assert isinstance(result.model, str)
    for count in (result.input_tokens, result.output_tokens, result.reasoning_tokens):
        assert isinstance(count, int) and count >= 0
    for call in result.tool_calls:
        assert call.keys() == {"id", "type", "function"} and call["type"] == "function"
        assert call["id"] is None or isinstance(call["id"], str) and call["id"]
        function = call["function"]
        assert function.keys() == {"name", "arguments"} and function["name"]
        assert isinstance(function["name"], str) and isinstance(function["arguments"], str)


def _assert_names_the_endpoint(error: MalformedReply, path: str) -> None:
    assert str(error).startswith(f"fuzzed: malformed reply from http://127.0.0.1:9/v1/{path}: ")


@given(body=BODIES)
@example(body={"choices": [{"message": None}]})
@example(body={"choices": [{"message": {"content": [{"type": "text", "text": "4"}]}}]})
@example(body={"choices": [{"message": {"tool_calls": ["calculator"]}}]})
def test_any_chat_body_parses_normalized_or_is_a_malformed_reply(body):
    try:
        result = FUZZED.read_chat(body, model="m", latency_s=0.0)
    except MalformedReply as error:
        _assert_names_the_endpoint(error, "chat/completions")
    else:
        _assert_normalized(result)


@given(body=BODIES)
@example(body={"choices": [{"text": "4", "logprobs": {"tokens": "token_id:5"}}]})
@example(body={"choices": [{"text": "4", "logprobs": {"token_logprobs": [None]}}]})
def test_any_completions_body_parses_or_is_a_malformed_reply(body):
    try:
        result = FUZZED.read_completion(body)
    except MalformedReply as error:
        _assert_names_the_endpoint(error, "completions")
    else:
        assert isinstance(result.text, str) and isinstance(result.finish_reason, str)
        assert all(isinstance(token, str) for token in result.tokens)
        assert all(type(value) is float for value in result.token_logprobs)
        assert result.prompt_tokens is None or result.prompt_tokens >= 0


@st.composite
def legal_replies(draw: st.DrawFn, sdk_shaped: bool = False) -> tuple[dict, dict]:
    """A reply the OpenAI API allows, and what it must parse to. With ``sdk_shaped``, one the
    official SDK's types validate: a string content and string arguments."""
    pieces = draw(st.lists(st.text(max_size=8), max_size=3))
    refusal = draw(st.text(max_size=8))
    arguments = draw(
        st.lists(
            st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4), max_size=2),
            max_size=2,
        )
    )
    as_parts = not sdk_shaped and draw(st.booleans())
    as_objects = not sdk_shaped and draw(st.booleans())  # arguments as vLLM variants send them
    calls = [
        {
            "id": f"call_{index}",
            "type": "function",
            "function": {
                "name": f"tool_{index}",
                "arguments": given if as_objects else json.dumps(given, ensure_ascii=False),
            },
        }
        for index, given in enumerate(arguments)
    ]
    text = "".join(pieces)
    if as_parts:
        content: Any = [{"type": "text", "text": piece} for piece in pieces]
        content += [{"type": "refusal", "refusal": refusal}] if refusal else []
        message: dict[str, Any] = {"role": "assistant", "content": content}
    else:
        message = {"role": "assistant", "content": text or None, "refusal": refusal or None}
    if calls:
        message["tool_calls"] = calls
    counts = draw(st.none() | st.tuples(*[st.integers(0, 10**6)] * 3))
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "served",
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": draw(st.sampled_from(["stop", "length", "tool_calls"])),
            }
        ],
    }
    if counts is not None:
        body["usage"] = {
            "prompt_tokens": counts[0],
            "completion_tokens": counts[1],
            "total_tokens": counts[0] + counts[1],
            "completion_tokens_details": {"reasoning_tokens": counts[2]},
        }
    expected = {
        "text": text or refusal,
        "input_tokens": counts[0] if counts else 0,
        "output_tokens": counts[1] if counts else 0,
        "reasoning_tokens": counts[2] if counts else 0,
        "finish_reason": body["choices"][0]["finish_reason"],
        "model": "served",
        "tool_calls": [
            {
                "id": f"call_{index}",
                "type": "function",
                "function": {
                    "name": f"tool_{index}",
                    "arguments": json.dumps(given, ensure_ascii=False),
                },
            }
            for index, given in enumerate(arguments)
        ],
    }
    return body, expected


def _fields(result: ChatResult) -> dict[str, Any]:
    return {
        key: getattr(result, key)
        for key in (
            "text",
            "input_tokens",
            "output_tokens",
            "reasoning_tokens",
            "finish_reason",
            "model",
            "tool_calls",
        )
    }


PARTS_ADAPTER = TypeAdapter(list[ContentArrayOfContentPart])


@given(reply=legal_replies())
def test_a_legal_reply_parses_to_exactly_its_content(reply):
    body, expected = reply
    content = body["choices"][0]["message"]["content"]
    if isinstance(content, list):  # the parts are the SDK's own (an assistant message's)
        PARTS_ADAPTER.validate_python(content)
    assert _fields(FUZZED.read_chat(body, model="m", latency_s=0.0)) == expected


# (reply body, the ChatResult fields it gives or the MalformedReply message it raises)
NAMED = {
    "message null": (
        {"choices": [{"message": None}]},
        r"choices\[0\]\.message is null, not an object",
    ),
    "content parts": (
        {
            "choices": [
                {
                    "message": {
                        "content": [
                            {"type": "text", "text": "The answer "},
                            {"type": "reasoning", "reasoning": "2+2"},
                            {"type": "text", "text": "is 4."},
                        ]
                    },
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 7, "completion_tokens": 5},
        },
        {"text": "The answer is 4.", "input_tokens": 7, "output_tokens": 5},
    ),
    "a refusal": (
        {"choices": [{"message": {"content": None, "refusal": "I can't help."}}]},
        {"text": "I can't help.", "tool_calls": []},
    ),
    "tool call not an object": (
        {"choices": [{"message": {"content": None, "tool_calls": ["calculator(2+2)"]}}]},
        r"choices\[0\]\.message\.tool_calls\[0\] is a string, not an object",
    ),
    "tool call without a name": (
        {"choices": [{"message": {"tool_calls": [{"function": {"arguments": "{}"}}]}}]},
        r"tool_calls\[0\]\.function has no name",
    ),
    "a custom tool call": (
        {"choices": [{"message": {"tool_calls": [{"type": "custom", "custom": {}}]}}]},
        r'tool_calls\[0\]\.type is not "function"',
    ),
    "null content, object arguments, no id, no usage": (
        {
            "choices": [
                {
                    "message": {
                        "content": None,
                        "tool_calls": [
                            {
                                "type": "function",
                                "function": {
                                    "name": "calculator",
                                    "arguments": {"expression": "2+2"},
                                },
                            }
                        ],
                    },
                    "finish_reason": "tool_calls",
                }
            ]
        },
        {
            "text": "",
            "input_tokens": 0,
            "output_tokens": 0,
            "finish_reason": "tool_calls",
            "tool_calls": [
                {
                    "id": None,
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'},
                }
            ],
        },
    ),
    "empty choices": ({"choices": [], "usage": {}}, r"choices is empty"),
    "an error with HTTP 200": (
        {"error": {"message": f"bad key {KEY}"}},
        r"the body has no choices \(it carries an error: bad key \[redacted\]\)",
    ),
    "a list": ([{"choices": []}], r"the body is a list, not an object"),
    "usage not an object": (
        {"choices": [{"message": {"content": "4"}}], "usage": [7, 1]},
        r"usage is a list, not an object",
    ),
    "not JSON": ("<html>502 Bad Gateway</html>", r"the body \(HTTP 200\) is not JSON"),
}


class Served(JSONServer):
    """Answers every request with ``body`` (a str as is), counting the requests."""

    def __init__(self) -> None:
        self.body: Any = None
        self.requests = 0

        def answer(path, headers, request):
            self.requests += 1
            return 200, self.body, {}

        super().__init__(answer, url_path="/v1")

    def serve(self, body: Any) -> Served:
        self.body, self.requests = body, 0
        return self


@pytest.fixture(scope="module")
def served():
    with Served() as server:
        yield server


@pytest.fixture(scope="module")
def run():
    """Runs a coroutine on one event loop for the module: the client keeps its connection pool
    per loop, and building one per example would be most of a property test's time."""
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


@pytest.mark.parametrize("case", NAMED)
def test_each_named_reply_over_http(case, served, monkeypatch):
    body, expected = NAMED[case]
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    client = OpenAIClient(
        served.serve(body).url,
        "m",
        name="env.user",
        api_key_env="OPENAI_API_KEY",
        max_retries=3,
        backoff_s=0.01,
    )
    if isinstance(expected, dict):
        result = asyncio.run(client.chat(MESSAGES))
        assert {key: getattr(result, key) for key in expected} == expected
    else:
        with pytest.raises(MalformedReply) as raised:
            asyncio.run(client.chat(MESSAGES))
        message = str(raised.value)
        assert message.startswith(f"env.user: malformed reply from {served.url}/chat/completions: ")
        assert re.search(expected, message) and KEY not in message
        assert raised.value.status == (200 if case == "not JSON" else None)
    assert served.requests == 1  # a malformed reply is not retried


@pytest.fixture(scope="module")
def client(served):
    return OpenAIClient(served.url, "m", max_retries=0)


@settings(max_examples=40)
@given(body=st.one_of(st.text(max_size=60), SHAPED.map(json.dumps)))
def test_any_body_over_http_is_a_reply_or_a_malformed_reply(served, client, run, body):
    served.serve(body)
    try:
        _assert_normalized(run(client.chat(MESSAGES)))
    except MalformedReply as error:
        assert str(error).startswith(f"malformed reply from {served.url}/chat/completions")


def test_completions_over_http(served):
    served.serve(
        {
            "choices": [
                {
                    "text": "4",
                    "finish_reason": "stop",
                    "logprobs": {"tokens": ["token_id:19"], "token_logprobs": [-0.5]},
                }
            ]
        }
    )
    client = OpenAIClient(served.url, "m", name="policy")
    assert asyncio.run(client.completions("2 + 2 =")) == Completion(
        "4", "stop", ["token_id:19"], [-0.5], None
    )
    served.serve({"choices": [{"text": ["4"]}]})
    with pytest.raises(
        MalformedReply,
        match=r"^policy: .*choices\[0\]\.text is a list, not "
        "a string",
    ):
        asyncio.run(client.completions("2 + 2 ="))


@pytest.fixture(scope="module")
def sdk(served):
    return openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0)


@settings(max_examples=25)
@given(reply=legal_replies(sdk_shaped=True))
def test_legal_replies_read_as_the_official_sdk_reads_them(served, client, run, sdk, reply):
    """Bodies the SDK's types validate read alike through it and through the client, over
    HTTP."""
    body, expected = reply
    ChatCompletion.model_validate(body)
    served.serve(body)
    theirs = sdk.chat.completions.create(model="m", messages=MESSAGES)
    ours = run(client.chat(MESSAGES))
    message = theirs.choices[0].message
    assert ours.text == (message.content or message.refusal or "") == expected["text"]
    assert ours.tool_calls == [call.model_dump() for call in message.tool_calls or []]
    usage = theirs.usage
    assert (ours.input_tokens, ours.output_tokens) == (
        (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)
    )


@pytest.mark.tau2
def test_a_tau2_user_endpoint_sending_malformed_replies_ends_the_episode_as_user_error(
    served, tiny_tokenizer
):
    """The three replies that crashed an evaluation (a null message, content as parts, a tool
    call that is no object) and the other malformed shapes: a malformed one ends the episode as
    a counted user_error; content parts are the user's text."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    pytest.importorskip("tau2")
    from nemo_orch import config as config_lib
    from nemo_orch.config import RolloutConfig
    from nemo_orch.envs import build_environment
    from nemo_orch.rollout.engines.scripted import ScriptedEngine
    from nemo_orch.rollout.runner import run_rollouts

    environment = build_environment(
        config_lib.load(
            [
                "env=tau2",
                "env.domain=retail",
                "env.split=train",
                f"env.user.base_url={served.url}",
                "env.user.model=m",
                "env.user.max_steps=3",
            ]
        )
    )
    task = next(
        task for task in environment.domain.tasks if task.metadata["tau2_task"]["id"] == "0"
    )
    rollout = RolloutConfig(
        max_context_tokens=1 << 15, max_turns=4, max_new_tokens=64, check_template=False
    )

    def play(body: Any) -> Any:
        served.serve(body)
        return asyncio.run(
            run_rollouts(
                [task],
                1,
                ScriptedEngine(tiny_tokenizer, lambda prompt: "Hello?"),
                environment.toolbox(),
                tiny_tokenizer,
                rollout,
                users=environment.users(),
            )
        )[0]

    for case, (body, expected) in NAMED.items():
        if not isinstance(expected, dict):
            assert play(body).termination == "user_error", case
    trajectory = play(NAMED["content parts"][0])
    assert trajectory.termination != "user_error"
    user = trajectory.messages[2]
    assert (user["role"], user["content"]) == ("user", "The answer is 4.")
