"""A scripted policy that carries out a plan written into the task's question: its tool calls,
one per turn, then an answer. Not a model: it drives the real episode runner, tools and scorers
through a known sequence of calls (domain tasks, tau2-bench)."""

from __future__ import annotations

import json
import re
from typing import Any

from nemo_orch.data.tasks import Task

_PLAN = re.compile(r"PLAN (\{.*\}) END", re.DOTALL)


def with_plan(row: Task, calls: list[tuple[str, dict[str, Any]]], answer: str) -> Task:
    """``row`` with the plan appended to its question."""
    plan = json.dumps({"calls": calls, "answer": answer})
    return Task(
        id=row.id,
        question=f"{row.question}\nPLAN {plan} END",
        system=row.system,
        tools=row.tools,
        metadata=row.metadata,
    )


def follow_plan(prompt: str) -> str:
    """The next step of the plan in ``prompt``: the call after those already answered, or the
    answer once every call has a response."""
    plan = json.loads(_PLAN.search(prompt)[1])
    done = prompt.count("<tool_response>")
    if done < len(plan["calls"]):
        name, arguments = plan["calls"][done]
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
    return f"<answer>{plan['answer']}</answer>"


def reloadable_plan_engine(tokenizer_dir: str, weights: Any = None) -> tuple[Any, Any]:
    """:func:`plan_engine`'s engine, taking refits (its replies do not depend on weights)."""
    from nemo_orch.rollout.engines.scripted import ScriptedEngine

    class Reloadable(ScriptedEngine):
        def update_weights(self, state: Any) -> None:
            self.weights = dict(state)

    engine, tokenizer = plan_engine(tokenizer_dir)
    return Reloadable(tokenizer, engine.reply), tokenizer


def plan_engine(tokenizer_dir: str, weights: Any = None) -> tuple[Any, Any]:
    """A scripted engine following plans (a question without one is answered ``42``) and the
    tokenizer in ``tokenizer_dir``: what a Ray rollout worker builds (an ``EngineFactory``)."""
    from nemo_orch.models.tokenizer import load_tokenizer
    from nemo_orch.rollout.engines.scripted import ScriptedEngine

    tokenizer = load_tokenizer(tokenizer_dir)
    return ScriptedEngine(
        tokenizer,
        lambda prompt: follow_plan(prompt) if _PLAN.search(prompt) else "<answer>42</answer>",
    ), tokenizer
