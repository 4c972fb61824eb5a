"""A SIMULATED chat model behind a real OpenAI-compatible endpoint, for the offline demo only:
no model runs.

Why it exists: the offline comparison needs a monolith baseline, one frontier model with the
basic tools (ToolOrchestra's "GPT-5 with tools"), and no frontier model is reachable offline. This
server plays one over real HTTP, so the baseline runs through the same
:class:`~nemo_orch.eval.chat_agent.ChatAgent`, client, tools and ledger as it would against a
real endpoint. It reads the tasks' reference answers, which is exactly why it must never be used
outside the offline demo; the real path is ``ChatAgent`` against any OpenAI-compatible endpoint.

It behaves like a frontier model that has never seen the offline world's made-up documents
(the same rules as :mod:`nemo_orch.tools.simulated_expert`): while a task's evidence
(``metadata["evidence"]``) is in no ``tool`` message, it calls the next step of the task's
``evidence_route`` through standard ``tool_calls``, if that tool is offered; otherwise it
answers ``<answer>…</answer>``, correctly with its accuracy at the task's difficulty (its
``evidence_difficulty`` once the evidence is in a tool message), else with a near miss. Usage:
prompt tokens are the request's characters / 4, completion tokens are drawn log-normal (a fixed
:data:`TOOL_CALL_TOKENS` for a tool call), and it sleeps ``time_scale`` times the seconds the real
model would take to write them. ``max_tokens`` is not enforced: the drawn count stands for a
reasoning model's hidden tokens, which the answer does not show.

Replies are deterministic per (request ``seed``, question, number of tool messages).
"""

from __future__ import annotations

import json
import math
import random
import time
import uuid
import zlib
from typing import Any

from nemo_orch.data.tasks import Task
from nemo_orch.serve.http_server import RequestError, ServerHandle, serve_json
from nemo_orch.tools.base import ToolContext
from nemo_orch.tools.simulated_expert import (
    SimulatedModel,
    difficulty,
    evidence_items,
    holds,
    wrong_answer,
)

# Completion tokens of a tool-call turn: a short JSON call, no reasoning drawn.
TOOL_CALL_TOKENS = 30


def _messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{index}] must be an object with a string 'role'")
        if not isinstance(message.get("content"), (str, type(None))):
            raise RequestError(f"messages[{index}].content must be a string or null")
    return messages


def _offered_tools(body: dict) -> list[str]:
    tools = [] if body.get("tools") is None else body["tools"]
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    names = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(
                f'tools[{index}] must be {{"type": "function", "function": {{"name": ...}}}}'
            )
        names.append(function["name"])
    return names


class _SimulatedChat:
    """Request -> simulated reply, independent of HTTP."""

    def __init__(
        self, tasks: list[Task], model: SimulatedModel, model_name: str, time_scale: float
    ) -> None:
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.tasks: dict[str, Task] = {}
        for task in tasks:
            if task.answer is None:
                raise ValueError(
                    f"task {task.id!r} has no reference answer; the simulated "
                    "model only answers tasks with one"
                )
            known = self.tasks.setdefault(task.question, task)
            if known.answer != task.answer:
                raise ValueError(
                    f"tasks {known.id!r} and {task.id!r} ask the same question "
                    "with different answers"
                )
        self.model, self.model_name, self.time_scale = model, model_name, time_scale
        self.created = int(time.time())

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "nemo-orch (simulated)",
                }
            ],
        }

    def chat(self, body: dict) -> dict:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(
                f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                404,
                "not_found_error",
            )
        messages = _messages(body)
        offered = _offered_tools(body)
        seed = 0 if body.get("seed") is None else body["seed"]
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise RequestError("'seed' must be an integer")
        question = next((m["content"] for m in messages if m["role"] == "user"), None)
        task = self.tasks.get(question)
        if task is None:
            raise RequestError(
                "the simulated model only answers the benchmark's tasks: the "
                "first user message is not one of their questions"
            )
        observations = tuple(m["content"] or "" for m in messages if m["role"] == "tool")
        rng = random.Random(zlib.crc32(f"{seed}|{question}|{len(observations)}".encode()))

        route = task.metadata.get("evidence_route") or []
        found = any(
            holds(text, evidence)
            for evidence, _ in evidence_items(task.metadata)
            for text in observations
        )
        step = route[len(observations)] if len(observations) < len(route) else None
        if not found and step is not None and step[0] in offered:
            name, arguments = step
            call = {
                "id": f"call_{len(observations)}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
            finish, completion_tokens = "tool_calls", TOOL_CALL_TOKENS
        else:
            context = ToolContext(task_id=task.id, task=task, observations=observations)
            correct = rng.random() < self.model.accuracy_on(difficulty(context))
            answer = task.answer if correct else wrong_answer(task.answer, rng)
            message = {"role": "assistant", "content": f"<answer>{answer}</answer>"}
            finish = "stop"
            completion_tokens = max(
                1,
                round(
                    rng.lognormvariate(
                        math.log(self.model.mean_output_tokens), self.model.output_tokens_sigma
                    )
                ),
            )
        characters = sum(len(m["content"] or "") for m in messages)
        if offered:
            characters += len(json.dumps(body["tools"]))
        prompt_tokens = characters // 4
        # The time the real model would take to write its tokens.
        time.sleep(self.time_scale * completion_tokens / self.model.tokens_per_second)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }


def start_simulated_chat_server(
    tasks: list[Task],
    model: SimulatedModel,
    model_name: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    time_scale: float = 1.0,
) -> ServerHandle:
    """Serve a SIMULATED chat model that answers ``tasks`` (see the module docstring) at
    ``http://host:port/v1`` (``port=0``: a free port); ``time_scale`` scales the seconds it
    sleeps per reply (0: no sleep)."""
    service = _SimulatedChat(tasks, model, model_name, time_scale)
    routes = {
        ("GET", "/v1/models"): lambda _: service.models(),
        ("POST", "/v1/chat/completions"): service.chat,
    }
    return serve_json(routes, host, port, url_path="/v1", name="simulated-chat")
