from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from nemo_orch.data.conversations import DataError, read_conversations, write_conversations
from nemo_orch.envs.offline.generator import TOOLS


def _conversation() -> dict[str, Any]:
    call = {"type": "function", "function": {"name": "search", "arguments": {"query": "x"}}}
    return {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "r"},
            {"role": "assistant", "content": "<answer>r</answer>"},
        ],
        "tools": TOOLS,
    }


def test_roundtrip(offline_conversations: list[dict[str, Any]], tmp_path: Path) -> None:
    path = tmp_path / "sub" / "data.jsonl"
    write_conversations(path, offline_conversations[:20])
    assert read_conversations(path) == offline_conversations[:20]


def test_normalizes_null_content_and_string_arguments(tmp_path: Path) -> None:
    record = _conversation()
    record["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"query": "x"}'
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(record) + "\n\n")
    [read] = read_conversations(path)
    assert read["messages"][1]["content"] == ""
    assert read["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"query": "x"}


def _broken(edit: str) -> dict[str, Any]:
    record = _conversation()
    messages, call = record["messages"], record["messages"][1]["tool_calls"][0]["function"]
    if edit == "role":
        messages[0]["role"] = "critic"
    elif edit == "no assistant":
        record["messages"] = messages[:1]
    elif edit == "undeclared tool":
        call["name"] = "browse"
    elif edit == "missing argument":
        call["arguments"] = {}
    elif edit == "enum":
        call.update(name="call_expert", arguments={"model": "math-huge", "question": "q"})
    elif edit == "content":
        messages[0]["content"] = ["not", "a", "string"]
    elif edit == "arguments json":
        call["arguments"] = "{query"
    return record


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("role", "a role in"),
        ("no assistant", "no assistant message"),
        ("undeclared tool", "'browse', which is not among"),
        ("missing argument", "missing argument 'query'"),
        ("enum", "must be one of"),
        ("content", "content must be a string"),
        ("arguments json", "not valid JSON"),
    ],
)
def test_malformed_record_names_file_and_line(edit: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    lines = [_conversation(), _broken(edit), _conversation()]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(DataError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(message)):
        read_conversations(path)


def test_invalid_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(_conversation()) + "\n{oops\n")
    with pytest.raises(DataError, match=re.escape(f"{path}:2: not valid JSON")):
        read_conversations(path)


def test_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "none.jsonl"))):
        read_conversations(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no conversations"):
        read_conversations(tmp_path / "empty.jsonl")


def test_write_rejects_invalid_conversations_without_writing(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    with pytest.raises(DataError, match="conversation 1: .*no assistant message"):
        write_conversations(path, [_conversation(), _broken("no assistant")])
    assert not path.exists()


def test_write_does_not_mutate_its_input(tmp_path: Path) -> None:
    record = _conversation()
    original = copy.deepcopy(record)
    write_conversations(tmp_path / "data.jsonl", [record])
    assert record == original
