"""Every way a turn can be malformed becomes a specific, counted error; nothing raises."""

from __future__ import annotations

import json

import pytest

from nemo_orch.rollout.format import (
    FORMAT_ERRORS,
    TurnFormat,
    call_text,
    choice_of,
    choices,
    decision_end,
    parse_turn,
)

SCHEMAS = {
    "python_sandbox": {
        "type": "object",
        "properties": {"code": {"type": "string"}},
        "required": ["code"],
    },
    "retriever": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "top_k": {"type": "integer", "minimum": 1}},
        "required": ["query"],
    },
}
FORMAT = TurnFormat(SCHEMAS)


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_valid_call_after_thinking():
    text = "<think>I should compute. <tool_call>not a call</tool_call></think>\n" + call(
        "python_sandbox", code="print(1)"
    )
    turn = parse_turn(text, FORMAT)
    assert turn.error is None and turn.format_errors == [] and turn.answer is None
    assert [(c.name, c.arguments) for c in turn.calls] == [("python_sandbox", {"code": "print(1)"})]


def test_answer_tag():
    turn = parse_turn("<think>done</think><answer> 42 </answer>", FORMAT)
    assert turn.answer == "42" and turn.calls == [] and turn.format_errors == []


@pytest.mark.parametrize(
    "text, kind, phrase",
    [
        ("<tool_call>{'name': 'retriever'}</tool_call>", "malformed_json", "not valid JSON"),
        ('<tool_call>["retriever"]</tool_call>', "bad_call_shape", "JSON object"),
        (
            '<tool_call>{"name": "retriever", "arguments": "q"}</tool_call>',
            "bad_call_shape",
            "JSON object",
        ),
        (call("web_search", query="x"), "unknown_tool", "unknown tool 'web_search'"),
        (call("retriever"), "invalid_arguments", "missing argument 'query'"),
        (
            call("retriever", query="x", lang="en"),
            "invalid_arguments",
            "undeclared argument 'lang'",
        ),
        (call("retriever", query=3), "invalid_arguments", "'query' should be of type string"),
        (call("retriever", query="x", top_k=0), "invalid_arguments", "'top_k' must be >= 1"),
        (
            '<tool_call>{"name": "retriever", "arguments": {"query": "x"}}',
            "unclosed_tag",
            "not closed",
        ),
    ],
)
def test_call_errors(text, kind, phrase):
    turn = parse_turn(text, FORMAT)
    assert turn.format_errors == [kind]
    assert len(turn.calls) == 1 and not turn.calls[0].valid
    assert turn.calls[0].error_kind == kind and phrase in turn.calls[0].error


@pytest.mark.parametrize(
    "text", ["The answer is 4.", "", "<think>hmm</think>", "<think>unclosed thinking <tool_call>"]
)
def test_no_call(text):
    turn = parse_turn(text, FORMAT)
    assert turn.calls == [] and turn.answer is None
    assert turn.format_errors == ["no_call"] and "no tool call or answer" in turn.error


def test_unclosed_answer():
    turn = parse_turn("<answer>42", FORMAT)
    assert turn.format_errors == ["unclosed_tag"] and "</answer>" in turn.error


def test_several_calls_run_in_parallel_or_first_only():
    text = call("python_sandbox", code="1") + "\n" + call("retriever", query="q")
    parallel = parse_turn(text, FORMAT)
    assert [c.name for c in parallel.calls] == ["python_sandbox", "retriever"]
    assert parallel.format_errors == [] and parallel.error is None

    first = parse_turn(text, TurnFormat(SCHEMAS, multiple_calls="first"))
    assert [c.name for c in first.calls] == ["python_sandbox"]
    assert first.format_errors == ["multiple_calls"] and "only the first of 2" in first.error


def test_mixed_valid_and_invalid_calls_keep_both():
    text = call("python_sandbox", code="1") + call("nope")
    turn = parse_turn(text, FORMAT)
    assert [c.valid for c in turn.calls] == [True, False]
    assert turn.format_errors == ["unknown_tool"]


def test_answer_tool_mode_ignores_tags():
    fmt = TurnFormat(SCHEMAS, answer_format="tool")
    turn = parse_turn("<answer>4</answer>", fmt)
    assert turn.answer is None and turn.format_errors == ["no_call"]
    assert "answer tool" in turn.error


def test_calls_win_over_an_answer_tag():
    turn = parse_turn("<answer>4</answer>" + call("python_sandbox", code="1"), FORMAT)
    assert turn.answer is None and [c.name for c in turn.calls] == ["python_sandbox"]


def test_error_kinds_are_declared():
    texts = ["x", call("nope"), "<tool_call>{</tool_call>", call("retriever")]
    for text in texts:
        assert set(parse_turn(text, FORMAT).format_errors) <= set(FORMAT_ERRORS)


DECISION_SCHEMAS = [
    {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
    {
        "name": "call_expert",
        "parameters": {
            "type": "object",
            "required": ["model"],
            "properties": {
                "model": {"type": "string", "enum": ["small", "large"]},
                "question": {"type": "string"},
            },
        },
    },
]
DECISION_FORMAT = TurnFormat.for_tools(DECISION_SCHEMAS)


def _end(text: str) -> str:
    return text[: decision_end(text, parse_turn(text, DECISION_FORMAT), DECISION_FORMAT)]


def test_the_decision_is_the_tool_name_and_its_choice_arguments():
    search = '<tool_call>\n{"name": "search", "arguments": {"query": "capital of X"}}\n</tool_call>'
    assert _end(search) == '<tool_call>\n{"name": "search"'
    expert = (
        '<tool_call>\n{"name": "call_expert", "arguments": {"question": "why?", '
        '"model": "large"}}\n</tool_call>'
    )
    assert _end(expert) == expert[: expert.index('"large"') + len('"large"')]
    both = search + "\n" + expert
    assert _end(both) == both[: both.index('"large"') + len('"large"')]


def test_answering_is_the_tag_and_a_format_error_is_the_whole_turn():
    assert _end("<answer>42</answer>") == "<answer>"
    for broken in (
        '<tool_call>\n{"name": "search"',
        "I think 42",
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
    ):
        assert _end(broken) == broken


def test_choices_are_tools_and_the_values_of_their_first_choice_argument():
    assert choices(DECISION_FORMAT) == [
        ("search", {}),
        ("call_expert", {"model": "small"}),
        ("call_expert", {"model": "large"}),
    ]
    assert choice_of("call_expert", {"question": "q", "model": "large"}, DECISION_FORMAT) == (
        "call_expert",
        {"model": "large"},
    )
    assert choice_of("search", {"query": "q"}, DECISION_FORMAT) == ("search", {})
    assert call_text(("search", {})) == (
        '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
    )
