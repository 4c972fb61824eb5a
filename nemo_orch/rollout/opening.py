"""An episode's opening: its id, its task's budget, its first messages and what they take of
the policy's context."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_orch.data.tasks import Task
from nemo_orch.models.tokenizer import escape_markup
from nemo_orch.tools.registry import Toolbox


def episode_id(task_id: str, sample: int = 0) -> str:
    """The id of a task's ``sample``-th episode: per-episode state (a domain's database, a tau2
    environment) is keyed by it."""
    return f"{task_id}#{sample}"


def task_budget(task: Task) -> float | None:
    """The task's USD budget (``metadata["budget_usd"]``; None: no budget)."""
    budget = task.metadata.get("budget_usd")
    return None if budget is None else float(budget)


def initial_messages(
    task: Task, tokenizer: PreTrainedTokenizerBase, greeting: str | None = None
) -> list[dict[str, Any]]:
    """An episode's first messages: the task's system prompt and question, markup escaped; the
    question followed by the task's budget, when it has one. With a user, the agent's
    ``greeting`` instead of the question: the user speaks next."""
    messages = []
    if task.system:
        messages.append({"role": "system", "content": escape_markup(task.system, tokenizer)})
    if greeting is not None:
        return [*messages, {"role": "assistant", "content": greeting}]
    question, budget = task.question, task_budget(task)
    if budget is not None:
        question += f"\nBudget: at most ${budget:g} for this task."
    messages.append({"role": "user", "content": escape_markup(question, tokenizer)})
    return messages


def prompt_length(task: Task, toolbox: Toolbox, tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokens of a task's first prompt (system prompt, tools, question): what must fit the
    policy's context before it writes anything."""
    schemas = (toolbox if task.tools is None else toolbox.subset(task.tools)).schemas()
    text = tokenizer.apply_chat_template(
        initial_messages(task, tokenizer),
        tools=schemas or None,
        tokenize=False,
        add_generation_prompt=True,
    )
    return len(tokenizer.encode(text, add_special_tokens=False))
