"""Preference pair files: the round trip, normalization, and every bad input named by file and
line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nemo_orch.data.pairs import DataError, read_pairs, write_pairs
from nemo_orch.envs.offline.generator import TOOLS


def pair_record() -> dict[str, Any]:
    """A pair whose chosen side calls a tool (arguments as a JSON string, content null, as
    OpenAI writes them) and reads its result; the rejected side guesses."""
    call = {"type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}
    return {
        "id": "p1",
        "prompt": [
            {"role": "system", "content": "Answer with <answer>."},
            {"role": "user", "content": "q"},
        ],
        "chosen": [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "r"},
            {"role": "assistant", "content": "<answer>r</answer>"},
        ],
        "rejected": [{"role": "assistant", "content": "<answer>guess</answer>"}],
        "tools": TOOLS,
        "chosen_reward": 1.0,
        "rejected_reward": 0.0,
    }


def test_pairs_are_normalized_like_conversations(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(pair_record()) + "\n\n")  # blank lines are skipped
    [pair] = read_pairs(path)
    assert pair.chosen[0]["content"] == ""
    assert pair.chosen[0]["tool_calls"][0]["function"]["arguments"] == {"query": "x"}
    assert [m["role"] for m in pair.prompt] == ["system", "user"]
    assert pair.tokens is None and (pair.chosen_reward, pair.rejected_reward) == (1.0, 0.0)
    assert pair.conversation("rejected") == {
        "messages": pair.prompt + pair.rejected,
        "tools": TOOLS,
    }


def test_round_trip_with_and_without_tokens(tmp_path: Path) -> None:
    tokens = {
        "prompt": [1, 2, 3],
        "chosen": {"ids": [4, 5], "loss_mask": [1, 0]},
        "rejected": {"ids": [6], "loss_mask": [1]},
    }
    records = [
        pair_record(),
        {**pair_record(), "id": "p2", "tokens": tokens, "chosen_reward": None},
    ]
    source = tmp_path / "source.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in records))
    pairs = read_pairs(source)
    assert pairs[1].tokens.chosen.ids == [4, 5] and pairs[1].tokens.rejected.loss_mask == [1]
    assert pairs[1].to_json()["tokens"] == tokens and pairs[1].chosen_reward is None
    written = tmp_path / "sub" / "pairs.jsonl"
    write_pairs(written, pairs)
    assert read_pairs(written) == pairs


def _broken(edit: str) -> str:
    record = pair_record()
    if edit == "missing side":
        del record["rejected"]
    elif edit == "empty side":
        record["chosen"] = []
    elif edit == "side not answering the prompt":
        record["rejected"] = [{"role": "user", "content": "and?"}] + record["rejected"]
    elif edit == "same sides":
        record["rejected"] = record["chosen"]
    elif edit == "swapped rewards":
        record["chosen_reward"], record["rejected_reward"] = 0.0, 1.0
    elif edit == "undeclared tool":
        record["chosen"][0]["tool_calls"][0]["function"]["name"] = "browse"
    elif edit == "bad prompt message":
        record["prompt"][1]["role"] = "critic"
    elif edit == "tokens without a mask per id":
        record["tokens"] = {
            "prompt": [1],
            "chosen": {"ids": [2, 3], "loss_mask": [1]},
            "rejected": {"ids": [4], "loss_mask": [1]},
        }
    elif edit == "tokens without a policy token":
        record["tokens"] = {
            "prompt": [1],
            "chosen": {"ids": [2], "loss_mask": [1]},
            "rejected": {"ids": [4], "loss_mask": [0]},
        }
    elif edit == "not json":
        return '{"id": "p1", "prompt": ['
    return json.dumps(record)


@pytest.mark.parametrize(
    "edit, message",
    [
        ("missing side", "missing 'rejected'"),
        ("empty side", "'chosen' must be a non-empty list of messages"),
        ("side not answering the prompt", "'rejected' must start with the assistant's message"),
        ("same sides", "'chosen' and 'rejected' are the same"),
        ("swapped rewards", "chosen_reward 0.0 is below rejected_reward 1.0"),
        ("undeclared tool", "chosen: messages[2]: call to 'browse', which is not among"),
        ("bad prompt message", "messages[1]: a message must be an object with a role"),
        (
            "tokens without a mask per id",
            "tokens.chosen.loss_mask must be a list of 0/1, one per id",
        ),
        ("tokens without a policy token", "tokens.rejected: no policy token"),
        ("not json", "not valid JSON"),
    ],
)
def test_bad_pairs_name_file_and_line(tmp_path: Path, edit: str, message: str) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(pair_record()) + "\n" + _broken(edit) + "\n")
    with pytest.raises(DataError) as error:
        read_pairs(path)
    assert str(error.value).startswith(f"{path}:2: ") and message in str(error.value)


def test_an_empty_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match="no pairs"):
        read_pairs(path)
