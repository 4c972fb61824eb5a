"""The tool-call format (Qwen3/Hermes) and its parser.

The policy may think in ``<think>…</think>``, then either calls tools::

    <tool_call>
    {"name": "python_sandbox", "arguments": {"code": "print(2 + 2)"}}
    </tool_call>

or answers: ``<answer>…</answer>`` (``answer_format="tag"``), or, with ``answer_format="tool"``,
calls a tool whose result ends the episode (``answer``: an expert writes the final answer). An
answer tag next to tool calls is ignored: the calls run. Results come back in ``<tool_response>``.

:func:`parse_turn` never raises: every way a turn can be wrong becomes an error observation with
a kind (:data:`FORMAT_ERRORS`) that rollouts count, so RL can penalise it and logs can show it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from nemo_orch.tools.schema import argument_errors

ANSWER_FORMATS = ("tag", "tool")
MULTIPLE_CALL_POLICIES = ("first", "parallel")

# Kinds of format error, each counted separately.
FORMAT_ERRORS = (
    "malformed_json",      # the text inside <tool_call> is not JSON
    "bad_call_shape",      # JSON, but not {"name": str, "arguments": object}
    "unclosed_tag",        # <tool_call> or <answer> without its closing tag
    "unknown_tool",        # a name that is not among the offered tools
    "invalid_arguments",   # missing / undeclared / mistyped argument
    "no_call",             # neither a tool call nor an answer
    "multiple_calls",      # several calls where only the first is run
)

# An unclosed think block runs to the end of the turn.
_THINK_RE = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)
_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """A call as written by the policy; ``error`` set when it cannot be run (then ``name`` and
    ``arguments`` hold what could be read)."""

    name: str | None
    arguments: dict[str, Any] | None
    error: str | None = None
    error_kind: str | None = None

    @property
    def valid(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "error": self.error,
                "error_kind": self.error_kind}


@dataclass(frozen=True)
class ParsedTurn:
    """What an assistant turn asks for: calls to run (valid or not), a final answer, or neither
    (``error`` says why). ``format_errors`` lists every error kind found in the turn."""

    calls: list[ToolCall] = field(default_factory=list)
    answer: str | None = None
    error: str | None = None
    format_errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"calls": [c.to_json() for c in self.calls], "answer": self.answer,
                "error": self.error, "format_errors": self.format_errors}


@dataclass(frozen=True)
class TurnFormat:
    """How turns are read: the offered tools' parameter schemas, the answer convention, and what
    to do with several calls in one turn."""

    schemas: dict[str, dict[str, Any]]
    answer_format: str = "tag"
    multiple_calls: str = "parallel"

    def __post_init__(self) -> None:
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}")
        if self.multiple_calls not in MULTIPLE_CALL_POLICIES:
            raise ValueError(f"multiple_calls must be one of {MULTIPLE_CALL_POLICIES}")

    @classmethod
    def for_tools(cls, tool_schemas: list[dict[str, Any]], **options: Any) -> "TurnFormat":
        functions = [schema.get("function", schema) for schema in tool_schemas]
        return cls({f["name"]: f["parameters"] for f in functions}, **options)


def _parse_call(body: str, fmt: TurnFormat) -> ToolCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall(None, None, f"the tool call is not valid JSON ({error.msg} at "
                        f"character {error.pos}); write {{\"name\": ..., \"arguments\": {{...}}}}",
                        "malformed_json")
    if (not isinstance(payload, dict) or not isinstance(payload.get("name"), str)
            or not isinstance(payload.get("arguments", {}), dict)):
        return ToolCall(None, None, "a tool call must be a JSON object {\"name\": <string>, "
                        "\"arguments\": <object>}", "bad_call_shape")
    name, arguments = payload["name"], payload.get("arguments", {})
    if name not in fmt.schemas:
        return ToolCall(name, arguments, f"unknown tool {name!r}; available tools: "
                        f"{', '.join(fmt.schemas)}", "unknown_tool")
    problems = argument_errors(fmt.schemas[name], arguments)
    if problems:
        return ToolCall(name, arguments, f"invalid arguments for {name}: {'; '.join(problems)}",
                        "invalid_arguments")
    return ToolCall(name, arguments)


def without_thinking(text: str) -> str:
    """A turn's text without its ``<think>`` blocks (an unclosed one runs to the end)."""
    return _THINK_RE.sub("", text)


def without_calls(text: str) -> str:
    """A turn's text without the ``<tool_call>`` blocks :func:`parse_turn` reads; those inside
    ``<think>`` are not calls and stay (what an OpenAI server returns as ``content``)."""
    pieces = re.split(f"({_THINK_RE.pattern})", text, flags=re.DOTALL)
    return "".join(piece if index % 2 else _CALL_RE.sub("", piece)
                   for index, piece in enumerate(pieces))


def parse_turn(text: str, fmt: TurnFormat) -> ParsedTurn:
    """Read one assistant turn (its text, without the closing ``<|im_end|>``)."""
    visible = without_thinking(text)
    errors: list[str] = []
    calls = [_parse_call(body.strip(), fmt) for body in _CALL_RE.findall(visible)]
    opened = visible.count("<tool_call>")
    if opened > len(calls):
        calls.append(ToolCall(None, None, "a <tool_call> is not closed with </tool_call>",
                              "unclosed_tag"))
    errors.extend(c.error_kind for c in calls if c.error_kind)

    if fmt.answer_format == "tag":
        answers = _ANSWER_RE.findall(visible)
        if answers and not calls:
            return ParsedTurn(answer=answers[-1].strip(), format_errors=errors)
        if "<answer>" in visible and not answers and not calls:
            return ParsedTurn(error="an <answer> is not closed with </answer>",
                              format_errors=["unclosed_tag"])

    if not calls:
        expected = ("a <tool_call> or a final <answer>…</answer>" if fmt.answer_format == "tag"
                    else "a <tool_call> (call the answer tool to finish)")
        return ParsedTurn(error=f"no tool call or answer found; write {expected}",
                          format_errors=["no_call"])
    if len(calls) > 1 and fmt.multiple_calls == "first":
        first = calls[0]
        note = (f"only the first of {len(calls)} tool calls was run; make one call per turn")
        return ParsedTurn(calls=[first], error=note,
                          format_errors=errors[: 1 if first.error_kind else 0]
                          + ["multiple_calls"])
    return ParsedTurn(calls=calls, format_errors=errors)


# A routing choice: a tool and the values of its choice (``enum``) arguments.
Choice = tuple[str, dict[str, Any]]


def _choice_argument(schema: dict[str, Any]) -> str | None:
    """A tool's first choice argument: the first property with an ``enum``."""
    return next((key for key, spec in schema.get("properties", {}).items() if "enum" in spec),
                None)


def choices(fmt: TurnFormat) -> list[Choice]:
    """Every routing choice the offered tools allow: one per value of a tool's first choice
    argument (e.g. each expert model), or the tool alone."""
    found: list[Choice] = []
    for name, schema in fmt.schemas.items():
        key = _choice_argument(schema)
        if key is None:
            found.append((name, {}))
        else:
            found.extend((name, {key: value}) for value in schema["properties"][key]["enum"])
    return found


def choice_of(name: str, arguments: dict[str, Any], fmt: TurnFormat) -> Choice:
    """The routing choice a valid call of ``name`` with ``arguments`` makes."""
    key = _choice_argument(fmt.schemas[name])
    return (name, {key: arguments[key]} if key in arguments else {})


def call_text(choice: Choice) -> str:
    """The canonical text of a call of ``choice`` (the chat template's rendering)."""
    name, arguments = choice
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def decision_end(text: str, parsed: ParsedTurn, fmt: TurnFormat) -> int:
    """Where a turn's routing decision ends, as a character index into ``text``: after the
    ``<answer>`` tag (the decision to answer now), or after the last tool name and choice
    argument (one with an ``enum`` in the schema) of its calls; the whole turn when it has a
    format error, which is one bad decision. What follows (free-text arguments, the answer's
    text) is copying, which GRPO's ``advantage_tokens=decisions`` leaves to SFT and the KL term."""
    if parsed.format_errors or parsed.error is not None:
        return len(text)
    if parsed.answer is not None:
        return text.index("<answer>") + len("<answer>")
    end = position = 0
    for call in parsed.calls:
        properties = fmt.schemas[call.name].get("properties", {})
        pieces = [("name", call.name)] + [(key, value) for key, value in call.arguments.items()
                                          if "enum" in properties.get(key, {})]
        for key, value in pieces:
            found = re.compile(re.escape(json.dumps(key)) + r"\s*:\s*"
                               + re.escape(json.dumps(value))).search(text, position)
            if found is None:  # written in a form json.dumps does not produce: all of it
                return len(text)
            end = max(end, found.end())
        position = end
    return end
