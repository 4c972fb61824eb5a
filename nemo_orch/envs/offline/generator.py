"""The bundled offline orchestrator data: seeded demonstrations, no LLM and no downloads.

Every conversation offers the same three tools (:data:`TOOLS`) and demonstrates one task of the
offline world's families (:mod:`.task_families`: arithmetic, lookups in the made-up world, lookup
then arithmetic, hard math and word puzzles for the experts).

The system prompt carries a preference instruction sampled per task ("Keep the cost low.",
"Accuracy matters most.", "Do not use web search.", ...), and the choice of expert follows it:
cost-minded prompts get ``math-small``, accuracy-minded ones ``math-large``, the others the model
that fits the question's difficulty. Tool-calling assistant messages have empty content.

Answer convention: the final assistant message is exactly ``<answer>ANSWER</answer>``, where
ANSWER is copied from the last tool response; :func:`extract_answer` reads it back.
"""

from __future__ import annotations

import copy
import random
import re
from typing import Any

from nemo_orch.envs.offline.task_families import SolvedTask, ToolStep, copy_span, draw_solved_task
from nemo_orch.reward.components import PREFERENCE_PHRASES

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "python_sandbox",
            "description": "Run Python code and return what it prints. Cheap.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search local documents for a passage about an entity. Cheap.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "call_expert",
            "description": "Ask an expert model: math-small (cheap), math-large (costly, best at "
            "math) or generalist (language tasks).",
            "parameters": {
                "type": "object",
                "properties": {
                    "model": {"type": "string", "enum": ["math-small", "math-large", "generalist"]},
                    "question": {"type": "string"},
                },
                "required": ["model", "question"],
            },
        },
    },
]

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str) -> str | None:
    """The stripped text of the last ``<answer>...</answer>`` in ``text``, or None."""
    answers = _ANSWER_RE.findall(text)
    return answers[-1].strip() if answers else None


_SYSTEM_PROMPTS = (
    "You are an orchestrator that answers questions by calling tools. "
    "Finish with the final answer inside <answer></answer> tags.",
    "You coordinate tools and expert models to solve the user's task. "
    "When you know the answer, reply with <answer>...</answer>.",
    "Solve the task with the tools provided. Put the final answer between <answer> and </answer>.",
    "You are a helpful assistant with access to tools. Use them, then give the final answer "
    "as <answer>your answer</answer>.",
    "Answer the user's question. Use a tool to get the result and reply only with "
    "<answer>result</answer>.",
)
_PREFERENCE_JOINERS = (" ", "\n", "\nPreference: ", "\nUser preference: ")


_EXPERT_REPLIES = ("Answer: {a}", "{a}", "The answer is {a}")


def _expert_step(rng: random.Random, task: SolvedTask, preference: str) -> ToolStep:
    easy, hard_model, hard = task.expert_choice
    if preference == "cost":
        model = easy
    elif preference == "accuracy":
        model = hard_model
    else:
        model = hard_model if hard else easy
    reply = rng.choice(_EXPERT_REPLIES).format(a=task.answer)
    return ToolStep("call_expert", {"model": model, "question": task.question}, reply)


def _conversation(rng: random.Random, task: SolvedTask) -> dict[str, Any]:
    preference = rng.choice(task.preferences)
    system = rng.choice(_SYSTEM_PROMPTS) + rng.choice(_PREFERENCE_JOINERS)
    system += rng.choice(PREFERENCE_PHRASES[preference])
    steps = task.steps if task.expert_choice is None else [_expert_step(rng, task, preference)]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": task.question},
    ]
    for step in steps:
        call = {"type": "function", "function": {"name": step.tool, "arguments": step.arguments}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "content": step.observation})
    messages.append({"role": "assistant", "content": f"<answer>{task.answer}</answer>"})
    return {"messages": messages, "tools": copy.deepcopy(TOOLS)}


def generate_conversations(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` demonstration conversations, the same for the same ``seed``."""
    rng = random.Random(seed)
    return [_conversation(rng, draw_solved_task(rng)[1]) for _ in range(n)]


_COPY_REQUESTS = (
    "Repeat exactly: {s}",
    "Copy this: {s}",
    'Say "{s}" and nothing else.',
    "Echo back the text: {s}",
    "{s}",
)


def copy_conversations(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` conversations that copy a span from the request into the answer: what every route
    needs (the question into a query, an expression into code, an observation into the answer),
    alone and dense. A policy trained from scratch forms its copying circuits from these far
    sooner than from demonstrations, where copied tokens are a few per conversation."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(n):
        span = copy_span(rng)
        conversations.append(
            {
                "messages": [
                    {"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)},
                    {"role": "user", "content": rng.choice(_COPY_REQUESTS).format(s=span)},
                    {"role": "assistant", "content": f"<answer>{span}</answer>"},
                ],
                "tools": [],
            }
        )
    return conversations
