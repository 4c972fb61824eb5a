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

from nemo_orch.tools.schema import argument_errors, integral

ANSWER_FORMATS = ("tag", "tool")
MULTIPLE_CALL_POLICIES = ("first", "parallel")

# Kinds of format error, each counted separately.
FORMAT_ERRORS = (
    "malformed_json",  # the text inside <tool_call> is not JSON
    "bad_call_shape",  # JSON, but not {"name": str, "arguments": object}
    "unclosed_tag",  # <tool_call> or <answer> without its closing tag
    "unknown_tool",  # a name that is not among the offered tools
    "invalid_arguments",  # missing / undeclared / mistyped argument
    "no_call",  # neither a tool call nor an answer
    "multiple_calls",  # several calls where only the first is run
)

# An unclosed think block runs to the end of the turn; the newlines after a closed one are the
# thought's (Qwen3's template separates a thought from the content with them).
_THINK_RE = re.compile(r"<think>.*?(?:</think>\n*|\Z)", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
OPEN_CALL, CLOSE_CALL = "<tool_call>", "</tool_call>"
OPEN_THINK, CLOSE_THINK = "<think>", "</think>"
# A call's JSON is read only within these bounds (beyond them: a malformed_json error): a turn
# the policy or a client wrote must never exhaust the parser's stack or the tools' validation.
MAX_CALL_CHARS = 1 << 20
MAX_JSON_DEPTH = 64
_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"\s*")


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
        return {
            "name": self.name,
            "arguments": self.arguments,
            "error": self.error,
            "error_kind": self.error_kind,
        }


@dataclass(frozen=True)
class ParsedTurn:
    """What an assistant turn asks for: calls to run (valid or not), a final answer, or neither
    (``error`` says why). ``format_errors`` lists every error kind found in the turn."""

    calls: list[ToolCall] = field(default_factory=list)
    answer: str | None = None
    error: str | None = None
    format_errors: list[str] = field(default_factory=list)
    # Where each call's <tool_call> block starts and ends in the turn's text (empty: unknown).
    spans: list[tuple[int, int]] = field(default_factory=list, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "calls": [c.to_json() for c in self.calls],
            "answer": self.answer,
            "error": self.error,
            "format_errors": self.format_errors,
        }


@dataclass(frozen=True)
class TurnFormat:
    """How turns are read: the offered tools' parameter schemas, the answer convention, and what
    to do with several calls in one turn."""

    schemas: dict[str, dict[str, Any]]
    answer_format: str = "tag"
    multiple_calls: str = "parallel"
    # Tools whose calls run whatever their arguments (a tool that answers a bad call itself:
    # ``ToolSpec.strict_arguments`` False).
    lenient: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}")
        if self.multiple_calls not in MULTIPLE_CALL_POLICIES:
            raise ValueError(f"multiple_calls must be one of {MULTIPLE_CALL_POLICIES}")

    @classmethod
    def for_tools(cls, tool_schemas: list[dict[str, Any]], **options: Any) -> TurnFormat:
        functions = [schema.get("function", schema) for schema in tool_schemas]
        return cls({f["name"]: f["parameters"] for f in functions}, **options)

    def check(self, name: str, arguments: dict[str, Any]) -> ToolCall:
        """A call of ``name`` with ``arguments`` (a JSON object), as it will run, or with the
        error that keeps it from running (an unknown tool, arguments its schema rejects)."""
        if name not in self.schemas:
            return ToolCall(
                name,
                arguments,
                f"unknown tool {name!r}; available tools: {', '.join(self.schemas)}",
                "unknown_tool",
            )
        if name in self.lenient:
            return ToolCall(name, arguments)
        problems = argument_errors(self.schemas[name], arguments)
        if problems:
            return ToolCall(
                name,
                arguments,
                f"invalid arguments for {name}: {'; '.join(problems)}",
                "invalid_arguments",
            )
        return ToolCall(name, integral(self.schemas[name], arguments))


def _depth(value: Any) -> int:
    """How deeply a decoded JSON value nests (a scalar: 0), without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, level = stack.pop()
        children = (
            value.values()
            if isinstance(value, dict)
            else value
            if isinstance(value, list)
            else None
        )
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in children)
    return deepest


def _malformed(problem: str) -> ToolCall:
    return ToolCall(
        None,
        None,
        f'the tool call is not valid JSON ({problem}); write {{"name": ..., "arguments": {{...}}}}',
        "malformed_json",
    )


def _decode(text: str, start: int) -> tuple[Any, int, str | None]:
    """The JSON value that starts at ``text[start]`` (after whitespace): ``(value, end,
    None)``, or ``(None, start, problem)``."""
    start = _WHITESPACE.match(text, start).end()
    try:
        value, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as error:
        return None, start, f"{error.msg} at character {error.pos - start}"
    except RecursionError:
        return None, start, f"nested deeper than {MAX_JSON_DEPTH} levels"
    if end - start > MAX_CALL_CHARS:
        return None, start, f"longer than {MAX_CALL_CHARS} characters"
    if _depth(value) > MAX_JSON_DEPTH:
        return None, start, f"nested deeper than {MAX_JSON_DEPTH} levels"
    return value, end, None


def _parse_call(payload: Any, fmt: TurnFormat) -> ToolCall:
    if (
        not isinstance(payload, dict)
        or not isinstance(payload.get("name"), str)
        or not isinstance(payload.get("arguments", {}), dict)
    ):
        return ToolCall(
            None,
            None,
            'a tool call must be a JSON object {"name": <string>, "arguments": <object>}',
            "bad_call_shape",
        )
    return fmt.check(payload["name"], payload.get("arguments", {}))


@dataclass(frozen=True)
class CallSpan:
    """A ``<tool_call>`` block of a turn: where it starts and ends in the text, and its decoded
    JSON, or, when the JSON or the markup is broken, the erroneous call it reads as."""

    start: int
    end: int
    payload: Any = None
    broken: ToolCall | None = None


def _read_call(text: str, start: int) -> CallSpan:
    """The block that opens at ``text[start]``. Where the call ends is the JSON decoder's
    business: a ``</tool_call>`` inside one of its strings does not end it. JSON not followed
    by the closing tag is malformed up to the next ``</tool_call>``; without one the call is
    unclosed and runs to the end of the turn."""
    body = start + len(OPEN_CALL)
    payload, end, problem = _decode(text, body)
    close = _WHITESPACE.match(text, end).end()
    if problem is None and text.startswith(CLOSE_CALL, close):
        return CallSpan(start, close + len(CLOSE_CALL), payload)
    close = text.find(CLOSE_CALL, body)
    if close == -1:
        return CallSpan(
            start,
            len(text),
            broken=ToolCall(
                None, None, f"a {OPEN_CALL} is not closed with {CLOSE_CALL}", "unclosed_tag"
            ),
        )
    if problem is None:  # valid JSON, then something else before the closing tag
        problem = f"extra data after the JSON at character {end - body}"
    return CallSpan(start, close + len(CLOSE_CALL), broken=_malformed(problem))


def call_spans(text: str) -> list[CallSpan]:
    """Every ``<tool_call>`` block of a turn outside its ``<think>`` blocks, in order: the one
    reading of the markup that parsing, ``content`` without calls and the decision mask share.
    Read left to right, so a ``<think>`` inside a call's string opens no thought, and a call
    inside a thought (an unclosed one runs to the end) is no call. Never raises."""
    spans: list[CallSpan] = []
    position = 0
    while (start := text.find(OPEN_CALL, position)) != -1:
        thought = text.find(OPEN_THINK, position, start)
        if thought != -1:
            close = text.find(CLOSE_THINK, thought)
            if close == -1:
                break
            position = close + len(CLOSE_THINK)
            continue
        spans.append(_read_call(text, start))
        position = spans[-1].end
    return spans


def without_thinking(text: str) -> str:
    """A turn's text without its ``<think>`` blocks (an unclosed one runs to the end)."""
    return _THINK_RE.sub("", text)


def without_calls(text: str) -> str:
    """A turn's text without the ``<tool_call>`` blocks :func:`parse_turn` reads, and without
    the newline the chat template writes before each (so the chat template renders the text
    and the calls back as they were); those inside ``<think>`` are not calls and stay. What an
    OpenAI server returns as ``content``."""
    pieces, position = [], 0
    for span in call_spans(text):
        pieces.append(text[position : span.start].removesuffix("\n"))
        position = span.end
    return "".join(pieces) + text[position:]


def text_beside_calls(text: str) -> str | None:
    """What a turn with calls writes beside them, as a chat API's ``content`` carries it with
    the thinking apart (:func:`without_calls`, then :func:`without_thinking`); None when
    nothing is written."""
    return without_thinking(without_calls(text)) or None


def parse_turn(text: str, fmt: TurnFormat) -> ParsedTurn:
    """Read one assistant turn (its text, without the closing ``<|im_end|>``)."""
    spans = call_spans(text)
    calls = [span.broken or _parse_call(span.payload, fmt) for span in spans]
    errors = [call.error_kind for call in calls if call.error_kind]
    visible = without_thinking(text)

    if fmt.answer_format == "tag":
        answers = _ANSWER_RE.findall(visible)
        if answers and not calls:
            return ParsedTurn(answer=answers[-1].strip(), format_errors=errors)
        if "<answer>" in visible and not answers and not calls:
            return ParsedTurn(
                error="an <answer> is not closed with </answer>", format_errors=["unclosed_tag"]
            )

    if not calls:
        expected = (
            "a <tool_call> or a final <answer>…</answer>"
            if fmt.answer_format == "tag"
            else "a <tool_call> (call the answer tool to finish)"
        )
        return ParsedTurn(
            error=f"no tool call or answer found; write {expected}", format_errors=["no_call"]
        )
    if len(calls) > 1 and fmt.multiple_calls == "first":
        first = calls[0]
        note = f"only the first of {len(calls)} tool calls was run; make one call per turn"
        return ParsedTurn(
            calls=[first],
            error=note,
            format_errors=errors[: 1 if first.error_kind else 0] + ["multiple_calls"],
            spans=[(spans[0].start, spans[0].end)],
        )
    return ParsedTurn(
        calls=calls, format_errors=errors, spans=[(span.start, span.end) for span in spans]
    )


# A routing choice: a tool and the values of its choice (``enum``) arguments.
Choice = tuple[str, dict[str, Any]]


def _choice_argument(schema: dict[str, Any]) -> str | None:
    """A tool's first choice argument: the first property with an ``enum``."""
    return next((key for key, spec in schema.get("properties", {}).items() if "enum" in spec), None)


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
    spans = parsed.spans or [(0, len(text))] * len(parsed.calls)
    for call, (start, stop) in zip(parsed.calls, spans):
        properties = fmt.schemas[call.name].get("properties", {})
        pieces = [("name", call.name)] + [
            (key, value)
            for key, value in call.arguments.items()
            if "enum" in properties.get(key, {})
        ]
        for key, value in pieces:
            found = re.compile(
                re.escape(json.dumps(key)) + r"\s*:\s*" + re.escape(json.dumps(value))
            ).search(text, max(position, start), stop)
            if found is None:  # written in a form json.dumps does not produce: all of it
                return len(text)
            end = max(end, found.end())
        position = end
    return end
