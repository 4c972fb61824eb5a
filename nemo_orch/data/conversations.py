"""Conversation files: JSONL, one OpenAI-format conversation per line.

Each line is ``{"messages": [...], "tools": [...]}``: chat messages with roles ``system``,
``user``, ``assistant`` and ``tool`` (assistant messages may carry ``tool_calls``:
``[{"type": "function", "function": {"name": ..., "arguments": {...}}}]``), and the OpenAI
function schemas of the tools offered. Everything is checked on read, so a bad line fails with a
:class:`DataError` naming the file and line instead of turning into a silent training sample, and
the returned conversations are normalized: ``content`` is always a string and tool-call
``arguments`` always a dict.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nemo_orch.data.jsonl import DataError, read_jsonl
from nemo_orch.tools.schema import argument_errors

__all__ = ["DataError", "read_conversations", "validate_conversation", "write_conversations"]

ROLES = ("system", "user", "assistant", "tool")
_FUNCTION_SHAPE = "{'type': 'function', 'function': {'name': ...}}"
_Schemas = dict[str, dict[str, Any]]  # a tool's name -> its parameters' JSON schema


def _check_tools(tools: Any, where: str) -> _Schemas:
    """The declared tools' parameter schemas by name."""
    if not isinstance(tools, list):
        raise DataError(f"{where}: 'tools' must be a list of function schemas")
    schemas = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (
            isinstance(function, dict)
            and tool.get("type") == "function"
            and isinstance(function.get("name"), str)
        ):
            raise DataError(f"{where}: tools[{i}] is not a {_FUNCTION_SHAPE}")
        schemas[function["name"]] = function.get("parameters", {})
    return schemas


def _normalize_tool_call(call: Any, schemas: _Schemas, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise DataError(f"{where}: a tool call must be a {_FUNCTION_SHAPE}")
    name, arguments = function["name"], function.get("arguments", {})
    if name not in schemas:
        raise DataError(f"{where}: call to {name!r}, which is not among the conversation's tools")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: arguments of {name!r} are not valid JSON: {error}") from None
    if not isinstance(arguments, dict):
        raise DataError(f"{where}: arguments of {name!r} must be a JSON object")
    errors = argument_errors(schemas[name], arguments)
    if errors:
        raise DataError(f"{where}: call to {name!r}: " + "; ".join(errors))
    return {**call, "type": "function", "function": {"name": name, "arguments": arguments}}


def _normalize_message(message: Any, schemas: _Schemas, where: str) -> dict[str, Any]:
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise DataError(f"{where}: a message must be an object with a role in {ROLES}")
    tool_calls = message.get("tool_calls") or []
    content = message.get("content")
    # OpenAI writes content=null for an assistant message that only calls tools.
    if content is None and tool_calls:
        content = ""
    if not isinstance(content, str):
        raise DataError(f"{where}: {message['role']} message content must be a string")
    if tool_calls and message["role"] != "assistant":
        raise DataError(f"{where}: only assistant messages may carry tool_calls")
    if not isinstance(tool_calls, list):
        raise DataError(f"{where}: tool_calls must be a list")
    normalized = {**message, "content": content}
    if tool_calls:
        normalized["tool_calls"] = [_normalize_tool_call(c, schemas, where) for c in tool_calls]
    else:
        normalized.pop("tool_calls", None)
    return normalized


def validate_conversation(conversation: Any, where: str) -> dict[str, Any]:
    """Check one conversation and return its normalized copy; errors are prefixed by ``where``."""
    if not isinstance(conversation, dict) or not isinstance(conversation.get("messages"), list):
        raise DataError(f"{where}: expected an object with a 'messages' list")
    tools = conversation.get("tools") or []
    schemas = _check_tools(tools, where)
    messages = [
        _normalize_message(message, schemas, f"{where}: messages[{i}]")
        for i, message in enumerate(conversation["messages"])
    ]
    if not any(message["role"] == "assistant" for message in messages):
        raise DataError(f"{where}: no assistant message, so nothing to learn")
    return {**conversation, "messages": messages, "tools": tools}


def read_conversations(path: str | Path) -> list[dict[str, Any]]:
    """Read and validate a JSONL conversation file; blank lines are skipped."""
    return [
        validate_conversation(record, where) for where, record in read_jsonl(path, "conversation")
    ]


def write_conversations(path: str | Path, conversations: Iterable[dict[str, Any]]) -> None:
    """Validate and write conversations as JSONL (creating parent directories)."""
    path = Path(path)
    lines = [
        json.dumps(validate_conversation(conversation, f"conversation {i}"), ensure_ascii=False)
        for i, conversation in enumerate(conversations)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
