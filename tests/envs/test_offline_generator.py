from __future__ import annotations

import contextlib
import io
from collections import Counter
from typing import Any

import pytest

from nemo_orch.data.conversations import validate_conversation
from nemo_orch.envs.offline.generator import TOOLS, extract_answer, generate_conversations
from nemo_orch.envs.offline.task_families import CONVERSATION_PREFERENCES
from nemo_orch.reward.components import PREFERENCE_PHRASES
from nemo_orch.tools.schema import argument_errors

SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def conversations() -> list[dict[str, Any]]:
    return generate_conversations(1000, seed=7)


def _calls(conversation: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        call["function"]
        for message in conversation["messages"]
        for call in message.get("tool_calls", [])
    ]


def _preference_kind(conversation: dict[str, Any]) -> str:
    system = conversation["messages"][0]["content"]
    [kind] = [
        k for k, texts in PREFERENCE_PHRASES.items() if any(system.endswith(t) for t in texts)
    ]
    return kind


def test_deterministic_per_seed() -> None:
    assert generate_conversations(50, seed=3) == generate_conversations(50, seed=3)
    assert generate_conversations(50, seed=3) != generate_conversations(50, seed=4)


def test_every_conversation_is_valid(conversations: list[dict[str, Any]]) -> None:
    for conversation in conversations:
        assert validate_conversation(conversation, "generated") == conversation
        for call in _calls(conversation):
            assert argument_errors(SCHEMAS[call["name"]], call["arguments"]) == []


def test_all_tools_and_experts_are_demonstrated(conversations: list[dict[str, Any]]) -> None:
    uses = Counter(name for c in conversations for name in {call["name"] for call in _calls(c)})
    assert set(uses) == set(SCHEMAS)
    assert all(count / len(conversations) > 0.2 for count in uses.values()), uses
    models = Counter(
        call["arguments"]["model"]
        for c in conversations
        for call in _calls(c)
        if call["name"] == "call_expert"
    )
    assert set(models) == set(SCHEMAS["call_expert"]["properties"]["model"]["enum"])
    assert min(models.values()) > 30, models


def test_python_responses_are_what_the_code_prints(conversations: list[dict[str, Any]]) -> None:
    checked = 0
    for conversation in conversations:
        messages = conversation["messages"]
        for message, response in zip(messages, messages[1:]):
            for call in message.get("tool_calls", []):
                if call["function"]["name"] != "python_sandbox":
                    continue
                stdout = io.StringIO()
                with contextlib.redirect_stdout(stdout):
                    exec(call["function"]["arguments"]["code"], {})  # print(<arithmetic>)
                assert response["role"] == "tool"
                assert response["content"] == stdout.getvalue().strip()
                checked += 1
    assert checked > 300


def test_final_answer_is_copied_from_the_last_tool_response(
    conversations: list[dict[str, Any]],
) -> None:
    for conversation in conversations:
        *_, last_response, final = conversation["messages"]
        answer = extract_answer(final["content"])
        assert final["content"] == f"<answer>{answer}</answer>"
        assert answer and answer in last_response["content"]


def test_choices_follow_the_preference(conversations: list[dict[str, Any]]) -> None:
    kinds = Counter()
    for conversation in conversations:
        kind = _preference_kind(conversation)
        kinds[kind] += 1
        calls = _calls(conversation)
        models = {call["arguments"].get("model") for call in calls}
        if kind == "no_search":
            assert all(call["name"] != "search" for call in calls)
        if kind == "cost":
            assert "math-large" not in models
        if kind == "accuracy":
            assert "math-small" not in models
    assert set(kinds) == set(CONVERSATION_PREFERENCES)


def test_surface_forms_vary(conversations: list[dict[str, Any]]) -> None:
    questions = {c["messages"][1]["content"] for c in conversations}
    systems = {c["messages"][0]["content"] for c in conversations}
    assert len(questions) > 0.95 * len(conversations)
    assert len(systems) > 100


def test_extract_answer() -> None:
    assert extract_answer("x <answer> 4 </answer> y <answer>5</answer>") == "5"
    assert extract_answer("<answer>a\nb</answer>") == "a\nb"
    assert extract_answer("no tags") is None


def test_bundled_corpus_is_the_whole_world():
    import json

    from nemo_orch.config import CONF_DIR
    from nemo_orch.envs.offline.world_facts import world_documents

    shipped = [
        json.loads(line)
        for line in (CONF_DIR / "tools" / "offline" / "world.jsonl").read_text().splitlines()
    ]
    assert shipped == world_documents()
    passages = {doc["text"] for doc in shipped}
    for conversation in generate_conversations(200, seed=3):
        for call, reply in zip(conversation["messages"], conversation["messages"][1:]):
            names = [c["function"]["name"] for c in call.get("tool_calls") or []]
            if names == ["search"]:
                assert reply["content"] in passages


def test_copy_conversations_copy_the_request_into_the_answer():
    from nemo_orch.envs.offline.generator import copy_conversations

    conversations = copy_conversations(200, seed=4)
    assert conversations == copy_conversations(200, seed=4)
    for conversation in conversations:
        system, user, assistant = conversation["messages"]
        span = extract_answer(assistant["content"])
        assert span and span in user["content"] and conversation["tools"] == []
    # Every kind of span a route copies shows up: numbers, names, expressions, questions.
    spans = [extract_answer(c["messages"][2]["content"]) for c in conversations]
    assert any(s.lstrip("-").isdigit() for s in spans)
    assert any("?" in s for s in spans) and any(" * " in s or " + " in s for s in spans)
