"""ToolOrchestra's composite tools: an expert model writes, a basic tool executes.

* ``search``: the expert turns the question into a search query; the retriever (or web search)
  runs it.
* ``enhance_reasoning``: the expert writes Python; the sandbox runs it.
* ``answer``: the expert answers; the result ends the episode.

Each takes a ``model`` argument choosing the expert (an alias of the expert tool), hands it the
episode's observations so far (retrieved passages, code output) as context, as the reference
does, and bills the expert's tokens plus the basic tool's fees. They are configurations of
existing tools, named in their declarations by ``expert`` and ``executor`` and built first by
the registry.

As in the reference, each expert model may have its own context length: an expert tool that
declares one per alias (``context_budget``, see :class:`BudgetedExpert`) is handed only the
newest observations that fit it (:func:`fit_observations`); the question is never cut.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from nemo_orch.call_kinds import CallKind
from nemo_orch.tools.base import (
    BaseTool,
    PricedModels,
    Pricing,
    Tool,
    ToolContext,
    ToolError,
    ToolResult,
    ToolSpec,
)

_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block, or the whole reply when there is none."""
    blocks = _CODE_BLOCK.findall(text)
    return (blocks[-1] if blocks else text).strip()


def extract_final_answer(text: str) -> str:
    """``<answer>…</answer>`` if the expert used it, else its whole reply less a leading
    ``Answer:``."""
    answers = _ANSWER.findall(text)
    return answers[-1].strip() if answers else text.strip().removeprefix("Answer:").strip()


def _combine(expert: ToolResult, executed: ToolResult, output: str) -> ToolResult:
    """The expert's writing run by the executor: billed for both, ending as the run did."""
    return ToolResult(
        output=output,
        error=executed.error,
        kind=executed.kind,
        usage=expert.usage,
        cost_usd=expert.cost_usd + executed.cost_usd,
        latency_s=expert.latency_s + executed.latency_s,
    )


# We do not have every expert's tokenizer: budgets count ~4 characters per token, about what
# BPE tokenizers average on English text.
CHARS_PER_TOKEN = 4


def check_context_budget(max_context_tokens: int | None) -> None:
    """An expert's ``max_context_tokens`` must be None (no budget) or an integer >= 1."""
    if max_context_tokens is not None and (
        not isinstance(max_context_tokens, int)
        or isinstance(max_context_tokens, bool)
        or max_context_tokens < 1
    ):
        raise ToolError(
            f"max_context_tokens must be null or an integer >= 1, got {max_context_tokens!r}"
        )


def fit_observations(observations: tuple[str, ...], max_tokens: int | None) -> tuple[str, ...]:
    """What an expert with a context budget of ``max_tokens`` (None: no budget) sees of the
    episode's observations, estimating a token as :data:`CHARS_PER_TOKEN` characters. The most
    recent are the most relevant, so the oldest whole observations are dropped first and the
    oldest one kept loses its start if only part of it fits. Without a budget the tuple itself
    comes back."""
    if max_tokens is None:
        return observations
    room = max_tokens * CHARS_PER_TOKEN
    kept: list[str] = []
    for observation in reversed(observations):
        if len(observation) > room:
            if room:
                kept.append(observation[len(observation) - room :])
            break
        kept.append(observation)
        room -= len(observation)
    return tuple(reversed(kept))


def context_text(context: ToolContext, max_tokens: int | None = None) -> str:
    """The episode's observations, fitted to ``max_tokens`` (see :func:`fit_observations`), as
    a prompt section (empty when there are none)."""
    observations = fit_observations(context.observations, max_tokens)
    if not observations:
        return ""
    return "\n\nContext:\n" + "\n\n".join(observations)


@runtime_checkable
class BudgetedExpert(Protocol):
    """An expert tool whose models have their own context lengths (``llm``, the simulated
    expert); composites hand any other expert the whole context."""

    def context_budget(self, alias: str) -> int | None: ...


class _Composite(BaseTool):
    """Resolves its parts by name. ``expert`` is any tool taking ``{"model", "question"}``.
    A prompt must place ``{question}`` and may place ``{context}`` (see :func:`context_text`).
    Without a ``question`` argument the expert is handed the task's own, as ToolOrchestra's
    orchestrator only chooses the tool and the model."""

    prompt: str = "{question}"

    def __init__(
        self, spec: ToolSpec, resolve: Callable[[str], Tool], expert: str, prompt: str | None = None
    ) -> None:
        super().__init__(spec)
        self.expert = resolve(expert)
        if prompt is not None:
            self.prompt = prompt
        if "{question}" not in self.prompt:
            raise ToolError(f"{spec.name}: prompt must contain {{question}}")

    @property
    def pricing(self) -> dict[str, Pricing]:
        """The expert's prices by alias (none when it has no priced models)."""
        return self.expert.pricing if isinstance(self.expert, PricedModels) else {}

    async def _ask(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        budget = (
            self.expert.context_budget(arguments["model"])
            if isinstance(self.expert, BudgetedExpert)
            else None
        )
        asked = arguments.get("question") or (context.task.question if context.task else "")
        question = self.prompt.format(question=asked, context=context_text(context, budget))
        return await self.expert.call({"model": arguments["model"], "question": question}, context)


def first_line(text: str) -> str:
    """The first line of the reply, unquoted (a search query)."""
    lines = text.strip().splitlines()
    return lines[0].strip().strip('"') if lines else ""


class _ExpertThenTool(_Composite):
    """The expert writes the ``argument`` of ``executor``, which then runs it."""

    argument: str
    extract: Callable[[str], str]

    def __init__(
        self,
        spec: ToolSpec,
        resolve: Callable[[str], Tool],
        expert: str,
        executor: str,
        prompt: str | None = None,
    ) -> None:
        super().__init__(spec, resolve, expert, prompt)
        self.executor = resolve(executor)

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        written = await self._ask(arguments, context)
        if written.error is not None:
            return written
        value = self.extract(written.output)
        if not value:
            return _combine(
                written,
                ToolResult(error=f"the expert wrote no {self.argument}", kind=CallKind.EMPTY),
                "",
            )
        ran = await self.executor.call({self.argument: value}, context)
        return _combine(
            written, ran, f"{self.argument.capitalize()}:\n{value}\nResult:\n{ran.observation}"
        )


class ExpertSearch(_ExpertThenTool):
    """The expert writes the query; ``executor`` (a retriever or web search) runs it."""

    argument, extract = "query", staticmethod(first_line)
    prompt = (
        "Write one short search query that would find the information needed to answer "
        "this question. Reply with the query only.{context}\n\nQuestion: {question}"
    )


class ExpertCode(_ExpertThenTool):
    """The expert writes Python; ``executor`` (the sandbox) runs it."""

    argument, extract = "code", staticmethod(extract_code)
    prompt = (
        "Write a Python program that prints the information needed to answer this "
        "question. Reply with one ```python code block.{context}\n\nQuestion: {question}"
    )


class ExpertAnswer(_Composite):
    """The expert answers; the episode ends with that answer."""

    prompt = (
        "Answer the question. Put the final answer inside <answer></answer>.{context}"
        "\n\nQuestion: {question}"
    )

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        replied = await self._ask(arguments, context)
        if replied.error is not None:
            return replied
        final = extract_final_answer(replied.output)
        return ToolResult(
            output=replied.output,
            usage=replied.usage,
            cost_usd=replied.cost_usd,
            latency_s=replied.latency_s,
            answer=final,
        )
