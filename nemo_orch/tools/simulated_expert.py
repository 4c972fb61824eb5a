"""A SIMULATED expert model, for the offline demo only: no model runs.

It stands in for real experts (``llm`` tool) where none can be reached. It answers a task
correctly with a probability set per model tier and task difficulty (``task.metadata
["difficulty"]``, default ``easy``), writes a plausible wrong answer otherwise, draws its token
usage from a log-normal distribution, and bills it at the list price of its real counterpart, so
cost-aware training sees realistic trade-offs. It reads the task's reference answer from the
tool context — which is exactly why it must never be used outside the offline demo.

Like ToolOrchestra's experts it is handed the episode's context: once a task's ``evidence``
(``task.metadata["evidence"]``, the fact it hinges on) is in an observation, e.g. a retrieved
passage, the task has ``task.metadata["evidence_difficulty"]`` instead (default ``easy``). With
``ends_episode`` its answer is the episode's final answer, as with ToolOrchestra's ``answer``
tool. A model with ``max_context_tokens`` sees only the newest observations that fit it
(:func:`~nemo_orch.tools.composite.fit_observations`): it bills those, and evidence in an
observation it cannot see does not help it.
"""

from __future__ import annotations

import math
import random
import re
import zlib
from dataclasses import dataclass, replace
from typing import Any

from nemo_orch.tools.base import BaseTool, ToolContext, ToolError, ToolResult, ToolSpec, Usage
from nemo_orch.tools.composite import CHARS_PER_TOKEN, check_context_budget, fit_observations
from nemo_orch.tools.pricing import model_pricing


@dataclass(frozen=True)
class SimulatedModel:
    """One alias: its real counterpart (for the price), accuracy per difficulty, usage, speed
    and context budget (None: it sees every observation)."""

    counterpart: str
    accuracy: dict[str, float]
    mean_output_tokens: float = 300.0
    output_tokens_sigma: float = 0.5
    tokens_per_second: float = 60.0
    max_context_tokens: int | None = None

    def __post_init__(self) -> None:
        if not all(0 <= p <= 1 for p in self.accuracy.values()):
            raise ToolError(f"{self.counterpart}: accuracies must be in [0, 1]")
        if self.mean_output_tokens < 1 or self.tokens_per_second <= 0:
            raise ToolError(f"{self.counterpart}: mean_output_tokens must be >= 1 and "
                            "tokens_per_second > 0")
        try:
            check_context_budget(self.max_context_tokens)
        except ToolError as error:
            raise ToolError(f"{self.counterpart}: {error}") from None

    def accuracy_on(self, difficulty: str) -> float:
        """Its accuracy on tasks of ``difficulty``; its lowest for a difficulty not listed."""
        return self.accuracy.get(difficulty, min(self.accuracy.values()))


def difficulty(context: ToolContext) -> str:
    """The task's difficulty for an expert handed this context: its ``evidence_difficulty``
    once its evidence is in an observation, else its ``difficulty`` (defaults: ``easy``)."""
    metadata = context.task.metadata if context.task is not None else {}
    evidence = metadata.get("evidence")
    if evidence and any(evidence in observation for observation in context.observations):
        return metadata.get("evidence_difficulty", "easy")
    return metadata.get("difficulty", "easy")


_NUMBER = re.compile(r"-?\d+")


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A near miss: numbers shifted, text replaced by a hedge (also the simulated chat model's,
    :mod:`nemo_orch.eval.simulated_chat`)."""
    if _NUMBER.fullmatch(answer.strip()):
        value = int(answer)
        return str(value + rng.choice([-1, 1]) * rng.randint(1, max(2, abs(value) // 10)))
    return rng.choice(["I am not sure.", "It cannot be determined.", answer[::-1]])


class SimulatedExpert(BaseTool):
    """Arguments: ``model`` (an alias of ``models``) and, optionally, ``question`` (default: the
    task's question, as when the expert is handed the task)."""

    def __init__(self, spec: ToolSpec, models: dict[str, dict[str, Any]],
                 prompt_overhead_tokens: int = 60, ends_episode: bool = False) -> None:
        super().__init__(spec)
        try:
            self.models = {alias: SimulatedModel(**options) for alias, options in models.items()}
        except TypeError as error:
            raise ToolError(f"{spec.name}: bad simulated model options: {error}") from None
        self.pricing = {alias: model_pricing(m.counterpart) for alias, m in self.models.items()}
        self.prompt_overhead_tokens = prompt_overhead_tokens
        self.ends_episode = ends_episode

    def context_budget(self, alias: str) -> int | None:
        """The context tokens ``alias`` may be handed (None: no budget, or an unknown alias)."""
        model = self.models.get(alias)
        return None if model is None else model.max_context_tokens

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        alias = arguments["model"]
        model = self.models.get(alias)
        if model is None:
            return ToolResult(error=f"unknown model {alias!r}; choose one of {sorted(self.models)}")
        if context.task is None or context.task.answer is None:
            return ToolResult(error="the simulated expert only answers tasks with a reference "
                              "answer (offline demo)")
        question = arguments.get("question") or context.task.question
        # What fits its context is all it reads, pays for and can find the evidence in.
        context = replace(context, observations=fit_observations(context.observations,
                                                                 model.max_context_tokens))
        # Same episode, model and question: same reply; different samples differ.
        rng = random.Random(zlib.crc32(f"{context.seed}|{context.episode_id}|{alias}|"
                                       f"{question}".encode()))
        correct = rng.random() < model.accuracy_on(difficulty(context))
        answer = context.task.answer if correct else wrong_answer(context.task.answer, rng)
        output_tokens = max(1, round(rng.lognormvariate(
            math.log(model.mean_output_tokens), model.output_tokens_sigma)))
        context_tokens = (sum(len(observation) for observation in context.observations)
                          // CHARS_PER_TOKEN)
        usage = Usage(input_tokens=self.prompt_overhead_tokens + len(question) // 4
                      + context_tokens, output_tokens=output_tokens)
        # Simulated time: reported, not slept, so the demo runs fast.
        seconds = output_tokens / model.tokens_per_second
        return ToolResult(output=f"Answer: {answer}", usage=usage, latency_s=seconds,
                          cost_usd=self.pricing[alias].cost(usage, 0.0)
                          + self.spec.pricing.cost(Usage(), 0.0),
                          answer=answer if self.ends_episode else None)
