"""What a request to the OpenAI-compatible endpoint (:mod:`nemo_orch.serve.openai_server`) says,
checked before the engine sees it: a field of the type it must have (:func:`request_field`,
which the orchestrator's routes read too), the functions it declares (:func:`request_tools`),
its conversation as the chat templates render it (:func:`chat_messages`: text content,
assistant ``tool_calls`` with object arguments) and whether it streams
(:func:`stream_options`). Anything else is a :class:`~nemo_orch.serve.http_server.RequestError`
(a 400) naming what is wrong. The service keeps what depends on it: the model it serves, the
sampling parameters (its tokenizer's end of text), the engine call and the response.
"""

from __future__ import annotations

import json
from typing import Any

from nemo_orch.serve.http_server import RequestError

# A function declared without parameters takes none.
NO_PARAMETERS = {"type": "object", "properties": {}}
STREAM_OPTIONS = ("include_usage",)


def request_field(
    body: dict, name: str, types: type | tuple[type, ...], default: Any = None
) -> Any:
    """``body[name]`` checked to be of ``types`` (a bool is no number); missing or null:
    ``default``."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise RequestError(f"'{name}' has the wrong type")
    if not isinstance(value, types):
        raise RequestError(f"'{name}' has the wrong type")
    return value


def request_tools(body: dict) -> list[dict] | None:
    """The request's ``tools``, each a function with ``parameters`` (the chat templates list
    them), or None."""
    tools = request_field(body, "tools", list)
    if not tools:
        return None
    checked = []
    for index, tool in enumerate(tools):
        function = (
            tool.get("function")
            if isinstance(tool, dict) and tool.get("type") == "function"
            else None
        )
        if not (
            isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and function["name"]
        ):
            raise RequestError(
                f'tools[{index}] must be {{"type": "function", "function": '
                f'{{"name": <string>, "parameters": <JSON schema>}}}}'
            )
        parameters = function.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise RequestError(f"tools[{index}].function.parameters must be a JSON schema object")
        checked.append({**tool, "function": {**function, "parameters": parameters}})
    return checked


def _incoming_call(call: Any, where: str) -> dict:
    """An assistant message's tool call as the chat templates render it: arguments as an
    object (a JSON string is decoded), so it reads as the policy writes calls."""
    function = call.get("function") if isinstance(call, dict) else None
    if not (
        isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]
    ):
        raise RequestError(
            f'{where} must be {{"type": "function", "function": {{"name": '
            f'<string>, "arguments": <JSON object or its string>}}}}'
        )
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise RequestError(
                f"{where}.function.arguments is not valid JSON ({error.msg} at "
                f"character {error.pos})"
            ) from None
        except RecursionError:
            raise RequestError(f"{where}.function.arguments nests too deeply") from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object")
    return {
        **call,
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def chat_messages(messages: Any) -> list[dict]:
    """OpenAI messages as the chat templates read them: text content (parts joined, null as
    empty) and assistant ``tool_calls`` with object arguments; a shape they cannot render is a
    400 naming the message."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    clean = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"{where} must be an object with a 'role'")
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts: only text is understood
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(f"{where}: only text content parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        elif content is not None and not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string")
        calls = message.get("tool_calls") or []
        if calls and message["role"] != "assistant":
            raise RequestError(f"{where}: only assistant messages carry tool_calls")
        if not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls must be a list")
        clean.append(
            {
                **message,
                "content": content,
                "tool_calls": [
                    _incoming_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)
                ],
            }
        )
    return clean


def stream_options(body: dict) -> tuple[bool, bool]:
    """Whether the request streams, and whether its stream ends with a usage chunk."""
    stream = request_field(body, "stream", bool, False)
    options = request_field(body, "stream_options", dict)
    if options is None:
        return stream, False
    if not stream:
        raise RequestError("'stream_options' is only allowed with 'stream': true")
    unknown = sorted(set(options) - set(STREAM_OPTIONS))
    if unknown:
        raise RequestError(
            f"stream_options {unknown} are not supported; supported: {', '.join(STREAM_OPTIONS)}"
        )
    return True, request_field(options, "include_usage", bool, False)
