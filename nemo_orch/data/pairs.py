"""Preference pair files (DPO): JSONL, one pair of continuations of one prompt per line.

Each line is an object::

    {"id": "q17",
     "prompt":   [chat messages: system, user, and earlier turns],
     "chosen":   [the preferred continuation: assistant and tool messages],
     "rejected": [the other continuation],
     "tools":    [OpenAI function schemas offered, optional],
     "chosen_reward": 0.83, "rejected_reward": 0.0,     (optional, null or numbers)
     "tokens": {...}}                                      (optional, see below)

Messages are those of a conversation file (:mod:`nemo_orch.data.conversations`, checked and
normalized the same way, tool calls against ``tools``). The prompt is stored once, so both sides
continue the same one; each side starts with the assistant's message (the policy answers the
prompt) and may go on with tool results and further turns. Loss falls on the sides' assistant
tokens only: the prompt and every tool message are context.

``tokens`` is the token-level history of pairs made from rollouts (``nemo-orch dpo`` writes it):
``{"prompt": [ids], "chosen": {"ids": [...], "loss_mask": [...]}, "rejected": {...}}``, each
side's ids continuing the prompt's, mask 1 on the tokens the policy sampled and 0 on
observations. Training uses these ids as they are, never re-tokenizing the episode; they belong
to the tokenizer of the policy that sampled them. Pairs without ``tokens`` are rendered with the
chat template.

Every problem raises a :class:`DataError` naming the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_orch.data.conversations import validate_conversation
from nemo_orch.data.jsonl import DataError, read_jsonl

__all__ = [
    "DataError",
    "Pair",
    "PairTokens",
    "SideTokens",
    "read_pairs",
    "validate_pair",
    "write_pairs",
]

SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class SideTokens:
    """One side's tokens after the prompt's, with the loss mask (1: sampled by the policy)."""

    ids: list[int]
    loss_mask: list[int]


@dataclass(frozen=True)
class PairTokens:
    prompt: list[int]
    chosen: SideTokens
    rejected: SideTokens


@dataclass(frozen=True)
class Pair:
    id: str
    prompt: list[dict[str, Any]]
    chosen: list[dict[str, Any]]
    rejected: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    chosen_reward: float | None = None
    rejected_reward: float | None = None
    tokens: PairTokens | None = None

    def conversation(self, side: str) -> dict[str, Any]:
        """The prompt followed by ``side`` ("chosen" or "rejected"), as a conversation."""
        return {"messages": self.prompt + getattr(self, side), "tools": self.tools}

    def to_json(self) -> dict[str, Any]:
        record = {
            "id": self.id,
            "prompt": self.prompt,
            "chosen": self.chosen,
            "rejected": self.rejected,
            "tools": self.tools,
            "chosen_reward": self.chosen_reward,
            "rejected_reward": self.rejected_reward,
        }
        if self.tokens is not None:
            record["tokens"] = {
                "prompt": self.tokens.prompt,
                **{
                    side: {
                        "ids": getattr(self.tokens, side).ids,
                        "loss_mask": getattr(self.tokens, side).loss_mask,
                    }
                    for side in SIDES
                },
            }
        return record


def _token_ids(value: Any, where: str) -> list[int]:
    if not (
        isinstance(value, list)
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    ):
        raise DataError(f"{where} must be a list of token ids (integers >= 0)")
    return value


def _side_tokens(value: Any, where: str) -> SideTokens:
    if not isinstance(value, dict):
        raise DataError(f"{where} must be an object with 'ids' and 'loss_mask'")
    ids = _token_ids(value.get("ids"), f"{where}.ids")
    mask = value.get("loss_mask")
    if not (
        isinstance(mask, list)
        and len(mask) == len(ids)
        and all(flag in (0, 1) and not isinstance(flag, bool) for flag in mask)
    ):
        raise DataError(f"{where}.loss_mask must be a list of 0/1, one per id")
    if not any(mask):
        raise DataError(f"{where}: no policy token (loss_mask has no 1), nothing to compare")
    return SideTokens(ids, mask)


def _pair_tokens(value: Any, where: str) -> PairTokens:
    if not isinstance(value, dict):
        raise DataError(
            f"{where}: 'tokens' must be an object with 'prompt', 'chosen' and 'rejected'"
        )
    prompt = _token_ids(value.get("prompt"), f"{where}: tokens.prompt")
    chosen, rejected = (_side_tokens(value.get(side), f"{where}: tokens.{side}") for side in SIDES)
    if chosen == rejected:
        raise DataError(f"{where}: the chosen and rejected tokens are the same")
    return PairTokens(prompt, chosen, rejected)


def _reward(record: dict[str, Any], key: str, where: str) -> float | None:
    value = record.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise DataError(f"{where}: {key} must be a number or null")
    return None if value is None else float(value)


def validate_pair(record: Any, where: str) -> Pair:
    """Check one pair and return it with its messages normalized; errors are prefixed by
    ``where``."""
    if not isinstance(record, dict):
        raise DataError(
            f"{where}: expected a JSON object with 'id', 'prompt', 'chosen' and 'rejected'"
        )
    missing = [key for key in ("id", "prompt", *SIDES) if key not in record]
    if missing:
        raise DataError(f"{where}: missing {', '.join(repr(key) for key in missing)}")
    if not isinstance(record["id"], str) or not record["id"]:
        raise DataError(f"{where}: 'id' must be a non-empty string")
    for key in ("prompt", *SIDES):
        if not isinstance(record[key], list) or not record[key]:
            raise DataError(f"{where}: '{key}' must be a non-empty list of messages")
    for side in SIDES:
        first = record[side][0]
        role = first.get("role") if isinstance(first, dict) else None
        if role != "assistant":
            raise DataError(
                f"{where}: '{side}' must start with the assistant's message, which "
                f"answers the prompt (got {role!r})"
            )
    # Each side is checked as the conversation it makes: its tool calls against the pair's
    # tools, its message indices counted from the prompt's first.
    tools = record.get("tools") or []
    conversations = {
        side: validate_conversation(
            {"messages": record["prompt"] + record[side], "tools": tools}, f"{where}: {side}"
        )
        for side in SIDES
    }
    prompt_size = len(record["prompt"])
    prompt = conversations["chosen"]["messages"][:prompt_size]
    chosen, rejected = (conversations[side]["messages"][prompt_size:] for side in SIDES)
    if chosen == rejected:
        raise DataError(f"{where}: 'chosen' and 'rejected' are the same, so neither is preferred")
    chosen_reward = _reward(record, "chosen_reward", where)
    rejected_reward = _reward(record, "rejected_reward", where)
    if None not in (chosen_reward, rejected_reward) and chosen_reward < rejected_reward:
        raise DataError(
            f"{where}: chosen_reward {chosen_reward} is below rejected_reward "
            f"{rejected_reward}: the sides are swapped"
        )
    tokens = None if record.get("tokens") is None else _pair_tokens(record["tokens"], where)
    return Pair(
        record["id"], prompt, chosen, rejected, tools, chosen_reward, rejected_reward, tokens
    )


def read_pairs(path: str | Path) -> list[Pair]:
    """Read and validate a JSONL pair file; blank lines are skipped."""
    return [validate_pair(record, where) for where, record in read_jsonl(path, "pair")]


def write_pairs(path: str | Path, pairs: Iterable[Pair]) -> None:
    """Validate and write pairs as JSONL (creating parent directories)."""
    path = Path(path)
    lines = [
        json.dumps(validate_pair(pair.to_json(), f"pair {i}").to_json(), ensure_ascii=False)
        for i, pair in enumerate(pairs)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
