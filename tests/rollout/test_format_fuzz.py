"""The tool-call parser never raises, whatever the text, and recovers every valid call embedded
anywhere in it exactly (property-based), the closing tag inside a string included; the same
reading of the markup cuts ``content`` and the decision mask; ``nemo-orch tools parse`` answers
JSON on any input."""

from __future__ import annotations

import json
import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cli_helpers import run_cli_here

from nemo_orch.rollout.format import (
    CLOSE_CALL,
    MAX_CALL_CHARS,
    MAX_JSON_DEPTH,
    OPEN_CALL,
    ParsedTurn,
    TurnFormat,
    call_text,
    decision_end,
    parse_turn,
    without_calls,
)

FORMAT = TurnFormat(
    {
        "python_sandbox": {
            "type": "object",
            "properties": {"code": {"type": "string"}},
            "required": ["code"],
        },
        "call_expert": {
            "type": "object",
            "properties": {"model": {"type": "string", "enum": ["small", "large"]}},
            "required": ["model"],
        },
    }
)
MARKUP = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "<|im_end|>",
    "<|im_start|>",
    "<tool_response>",
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    ":",
    ",",
    "\n",
    "\x00",
    "\x1b",
    "\ud800",
    "\udfff",
    "\u2028",
    "\ufeff",
    "null",
    "name",
]
HYPOTHESIS = settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])

# Any text: arbitrary code points (lone surrogates included) and runs of markup pieces.
any_text = st.one_of(
    st.text(max_size=200),
    st.lists(st.sampled_from(MARKUP), max_size=60).map("".join),
    st.lists(st.one_of(st.sampled_from(MARKUP), st.text(max_size=8)), max_size=40).map("".join),
)
# Text between calls: anything that does not open a call or a thought itself.
noise = any_text.filter(lambda text: OPEN_CALL not in text and "<think>" not in text)
valid_call = st.one_of(
    st.builds(
        lambda code: ("python_sandbox", {"code": code}),
        st.one_of(
            st.text(max_size=40), st.lists(st.sampled_from(MARKUP), max_size=10).map("".join)
        ),
    ),
    st.builds(lambda model: ("call_expert", {"model": model}), st.sampled_from(["small", "large"])),
)


def _payload(call, **options) -> str:
    return json.dumps({"name": call[0], "arguments": call[1]}, **options)


rendering = st.sampled_from(
    [  # the canonical rendering, compact, and spread over lines
        call_text,
        lambda call: f"{OPEN_CALL}{_payload(call)}{CLOSE_CALL}",
        lambda call: (
            f"{OPEN_CALL}\n  {_payload(call, ensure_ascii=False, indent=1)}  \n{CLOSE_CALL}"
        ),
    ]
)


@HYPOTHESIS
@given(any_text)
def test_any_text_parses_without_raising(text):
    turn = parse_turn(text, FORMAT)
    assert isinstance(turn, ParsedTurn)
    assert isinstance(without_calls(text), str)
    assert 0 <= decision_end(text, turn, FORMAT) <= len(text)
    json.dumps(turn.to_json())  # what the CLI and the server serialize


@HYPOTHESIS
@given(st.lists(st.tuples(noise, valid_call, rendering), min_size=1, max_size=4), noise)
def test_valid_calls_anywhere_are_recovered_exactly(pieces, tail):
    text = "".join(gap + render(call) for gap, call, render in pieces) + tail
    turn = parse_turn(text, FORMAT)
    assert [(c.name, c.arguments) for c in turn.calls] == [call for _, call, _ in pieces]
    assert all(call.valid for call in turn.calls) and turn.error is None
    # The content without calls is exactly the text around them, less the chat template's
    # newline before each call.
    assert without_calls(text) == "".join(gap.removesuffix("\n") for gap, _, _ in pieces) + tail


def test_a_closing_tag_inside_a_string_does_not_end_the_call():
    code = "print('</tool_call>')  # <think>"
    call = (
        '<tool_call>{"name": "python_sandbox", "arguments": {"code": "' + code + '"}}</tool_call>'
    )
    turn = parse_turn(call + " and after", FORMAT)
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [
        ("python_sandbox", {"code": code}, None)
    ]
    assert without_calls(call + " and after") == " and after"
    # The decision mask reads the calls where they are, not a look-alike in the text before.
    prefix = 'I could write "name": "call_expert" here. '
    expert = call_text(("call_expert", {"model": "large"}))
    mixed = prefix + call + expert
    chosen = '"model": "large"'
    assert decision_end(mixed, parse_turn(mixed, FORMAT), FORMAT) == (
        mixed.index(chosen) + len(chosen)
    )
    alone = 'Maybe {"name": "call_expert", "model": "large"}? ' + expert
    assert decision_end(alone, parse_turn(alone, FORMAT), FORMAT) == (
        alone.rindex(chosen) + len(chosen)
    )


@given(st.integers(min_value=MAX_JSON_DEPTH + 1, max_value=200_000), st.sampled_from("[{"))
@settings(max_examples=20)
def test_deep_nesting_is_a_malformed_call(depth, bracket):
    nested = "[" * depth + "]" * depth if bracket == "[" else '{"a":' * depth + "1" + "}" * depth
    text = (
        '<tool_call>{"name": "python_sandbox", "arguments": {"code": ' + nested + "}}</tool_call>"
    )
    turn = parse_turn(text, FORMAT)
    assert turn.format_errors == ["malformed_json"]
    assert "nested deeper than" in turn.calls[0].error


def test_a_call_over_the_size_bound_is_malformed_and_one_below_it_is_read():
    def call(size: int) -> str:
        return call_text(("python_sandbox", {"code": "x" * size}))

    assert parse_turn(call(MAX_CALL_CHARS // 2), FORMAT).calls[0].valid
    turn = parse_turn(call(MAX_CALL_CHARS) + " " + "y" * MAX_CALL_CHARS, FORMAT)
    assert turn.format_errors == ["malformed_json"]
    assert f"longer than {MAX_CALL_CHARS} characters" in turn.calls[0].error


def test_unclosed_and_trailing_data_are_reported():
    unclosed = parse_turn('<tool_call>{"name": "python_sandbox"', FORMAT)
    assert unclosed.format_errors == ["unclosed_tag"]
    trailing = parse_turn(
        '<tool_call>{"name": "call_expert", "arguments": {"model": "small"}} oops</tool_call>',
        FORMAT,
    )
    assert trailing.format_errors == ["malformed_json"]
    assert "extra data after the JSON" in trailing.calls[0].error


def test_tools_parse_answers_json_on_any_bytes():
    hostile = [
        b'\xff\xfe<tool_call>\x80{"name": 1}</tool_call>',
        b"<tool_call>" + b"[" * 100_000 + b"</tool_call>",
        b"",
    ]
    for data in hostile:
        answer = json.loads(run_cli_here("tools", "parse", stdin=data).stdout)
        assert {"calls", "error", "answer", "format_errors", "invalid_calls"} <= answer.keys()
    assert answer["format_errors"] == ["no_call"]
    # A JSON escape can make a lone surrogate, which no UTF-8 stream carries: a real process
    # (on the basic tools, whose search takes a query).
    escaped = '<tool_call>{"name": "search", "arguments": {"query": "\\ud800"}}</tool_call>'
    result = subprocess.run(
        [sys.executable, "-m", "nemo_orch.cli", "tools", "parse", "tools=offline_basic"],
        input=escaped.encode(),
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
    assert json.loads(result.stdout)["calls"] == [
        {"name": "search", "arguments": {"query": "\ud800"}}
    ]


@HYPOTHESIS
@given(any_text)
def test_what_a_turn_says_to_a_user_is_read_without_raising(text):
    """With a user (tau2), a turn without a call is a message: its answer, or its text without
    thinking; never a turn that calls, never an empty message."""
    from nemo_orch.rollout.episode import Episode

    parsed = parse_turn(text, FORMAT)
    message = Episode._message_to_user(text, parsed)
    if parsed.calls:
        assert message is None
    elif message is not None:
        assert message == parsed.answer or (message.strip() and "<think>" not in message)
