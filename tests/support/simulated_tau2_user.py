"""A SIMULATED tau2 user: rules standing in for the user LLM, behind the project's real
OpenAI-compatible server on 127.0.0.1 (a scripted engine served by ``serve.openai_server``), so
nemo-orch's LLM-user path runs for real: tau2's user system prompt and message conversion, the
HTTP client, function calling, the user's tools on the episode's environment.

The rules read the conversation the server renders (the agent's messages arrive as ``user``
turns, the simulated user's own as ``assistant`` turns, as tau2 flips them):
- it performs, one call per reply, every user tool the agent's last message names as
  ``name {json arguments}`` in backticks, then says what the last one returned;
- to a message saying the request is handled it answers ``###STOP###``;
- to anything else (the greeting, a question) it states its scenario's reason for call and
  known info (a scenario without them: its instructions).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.serve.openai_server import start_server

MODEL = "simulated-tau2-user"
_REQUEST = re.compile(r"`(\w+) (\{.*?\})`")


def _messages(prompt: str) -> list[tuple[str, str]]:
    """(role, content) of each message the chat template rendered (the generation prompt
    left out)."""
    messages = []
    for chunk in prompt.split("<|im_start|>")[1:]:
        role, _, body = chunk.partition("\n")
        if "<|im_end|>" in body:
            messages.append((role, body.split("<|im_end|>")[0]))
    return messages


def _field(scenario: str, label: str) -> str:
    found = re.search(rf"{label}:\s*(.*?)(?=\n\t\w[\w ]*:|\Z)", scenario, re.S)
    return " ".join(found[1].split()) if found else ""


def simulated_user_reply(prompt: str) -> str:
    messages = _messages(prompt)
    scenario = re.search(r"<scenario>(.*?)</scenario>", messages[0][1], re.S)[1]
    last = max(
        index
        for index, (role, content) in enumerate(messages)
        if role == "user" and "<tool_response>" not in content
    )
    agent_message, since = messages[last][1], messages[last + 1 :]
    asked = _REQUEST.findall(agent_message)
    done = sum(content.count("<tool_call>") for role, content in since if role == "assistant")
    if done < len(asked):
        name, arguments = asked[done]
        call = json.dumps({"name": name, "arguments": json.loads(arguments)})
        return f"<tool_call>\n{call}\n</tool_call>"
    if asked:
        output = re.search(r"<tool_response>\s*(.*?)\s*</tool_response>", since[-1][1], re.S)
        return f"Done. My phone says: {' '.join(output[1].split())}"
    if "handled" in agent_message:
        return "Thank you, that is all. ###STOP###"
    opening = " ".join(
        filter(None, (_field(scenario, "Reason for call"), _field(scenario, "Known info")))
    )
    return opening or _field(scenario, "Instructions")


@contextmanager
def simulated_user_server(tokenizer: Any) -> Iterator[str]:
    """The SIMULATED user served on 127.0.0.1; yields its base URL (``.../v1``)."""
    with start_server(ScriptedEngine(tokenizer, simulated_user_reply), tokenizer, MODEL) as server:
        yield server.url
