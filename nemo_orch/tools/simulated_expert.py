"""A SIMULATED expert model, for the offline demo only: no model runs.

It stands in for real experts (``llm`` tool) where none can be reached. It answers a task
correctly with a probability set per model tier and task difficulty (``task.metadata
["difficulty"]``, default ``easy``), writes a plausible wrong answer otherwise, draws its token
usage from a log-normal distribution, and bills it at the list price of its real counterpart, so
cost-aware training sees realistic trade-offs. It reads the task's reference answer from the
tool context — which is exactly why it must never be used outside the offline demo.

Like ToolOrchestra's experts it is handed the episode's context: once a task's ``evidence``
(``task.metadata["evidence"]``, the fact it hinges on) is in an observation, e.g. a retrieved
passage, the task has ``task.metadata["evidence_difficulty"]`` instead (default ``easy``);
``evidence`` may also list ``[text, difficulty]`` pairs, the first one present counting (the
code's printed answer before the passage it was computed from). A model with a ``distraction``
below 1 is that much less likely to be right per observation it sees that holds no evidence (an
unrelated passage, a wrong program's output), as LLMs are led astray by irrelevant context. With
``ends_episode`` its answer is the episode's final answer, as with ToolOrchestra's ``answer``
tool. A model with ``max_context_tokens`` sees only the newest observations that fit it
(:func:`~nemo_orch.tools.composite.fit_observations`): it bills those, and evidence in an
observation it cannot see does not help it.

It writes what its role (``writes``) asks, for ToolOrchestra's composite tools
(:mod:`nemo_orch.tools.composite`) to execute for real:

* ``answer``: the answer (above);
* ``query``: a search query, the task's right one (``task.metadata["query"][0]``) with its
  accuracy, a plausible wrong one (``[1]``, another entity) otherwise;
* ``code``: a Python program (``task.metadata["code"]``): the ``right`` one with its accuracy
  for the code's ``difficulty``, a subtly ``wrong`` one otherwise; a program that needs a fact
  (``needs``) it cannot see in its context is the ``blind`` one, written with a guessed fact.
"""

from __future__ import annotations

import math
import random
import re
import zlib
from dataclasses import dataclass
from typing import Any

from nemo_orch.tools.base import (
    BaseTool,
    BuildSettings,
    ToolContext,
    ToolError,
    ToolResult,
    ToolSpec,
    Usage,
)
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
    distraction: float = 1.0

    def __post_init__(self) -> None:
        if not all(0 <= p <= 1 for p in [*self.accuracy.values(), self.distraction]):
            raise ToolError(f"{self.counterpart}: accuracies and distraction must be in [0, 1]")
        if self.mean_output_tokens < 1 or self.tokens_per_second <= 0:
            raise ToolError(
                f"{self.counterpart}: mean_output_tokens must be >= 1 and tokens_per_second > 0"
            )
        try:
            check_context_budget(self.max_context_tokens)
        except ToolError as error:
            raise ToolError(f"{self.counterpart}: {error}") from None

    def accuracy_on(self, difficulty: str) -> float:
        """Its accuracy on tasks of ``difficulty``; its lowest for a difficulty not listed."""
        return self.accuracy.get(difficulty, min(self.accuracy.values()))


def evidence_items(metadata: dict[str, Any]) -> list[tuple[str, str]]:
    """A task's evidence as (text, difficulty once present) pairs, most useful first."""
    evidence = metadata.get("evidence")
    if not evidence:
        return []
    if isinstance(evidence, str):
        return [(evidence, metadata.get("evidence_difficulty", "easy"))]
    return [(text, level) for text, level in evidence]


def holds(observation: str, text: str) -> bool:
    """Whether ``observation`` states ``text`` as a whole (``12`` is not in ``123``)."""
    return re.search(rf"(?<![\w.]){re.escape(text)}(?![\w])", observation) is not None


def reading(metadata: dict[str, Any], observations: tuple[str, ...]) -> tuple[str, int]:
    """What an expert handed ``observations`` faces: the difficulty of the first evidence item
    present (else the task's ``difficulty``; default ``easy``) and how many observations hold
    no evidence at all."""
    items = evidence_items(metadata)
    present = next(
        (
            level
            for text, level in items
            if any(holds(observation, text) for observation in observations)
        ),
        None,
    )
    unrelated = sum(
        not any(holds(observation, text) for text, _ in items) for observation in observations
    )
    return present or metadata.get("difficulty", "easy"), unrelated


def difficulty(context: ToolContext) -> str:
    """The task's difficulty for an expert handed this context (see :func:`reading`)."""
    metadata = context.task.metadata if context.task is not None else {}
    return reading(metadata, context.observations)[0]


_NUMBER = re.compile(r"-?\d+")


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A near miss: numbers shifted, text replaced by a hedge (also the simulated chat model's,
    :mod:`nemo_orch.eval.simulated_chat`)."""
    if _NUMBER.fullmatch(answer.strip()):
        value = int(answer)
        return str(value + rng.choice([-1, 1]) * rng.randint(1, max(2, abs(value) // 10)))
    return rng.choice(["I am not sure.", "It cannot be determined.", answer[::-1]])


WRITES = ("answer", "query", "code")


def writing_chances(
    writes: str, model: SimulatedModel, metadata: dict[str, Any], observations: tuple[str, ...]
) -> dict[str, float]:
    """What a query writer or coder handed ``observations`` may write for a task, each kind
    (``right``, ``wrong``, ``blind``) with its chance: the one rule the simulation draws from
    and the offline oracle enumerates."""
    if writes == "query":
        p = model.accuracy_on("easy")
        return {"right": p, "wrong": 1 - p}
    code = metadata["code"]
    if code["needs"] and not any(holds(observation, code["needs"]) for observation in observations):
        return {"blind": 1.0}
    if code["right"] is None:
        return {"wrong": 1.0}
    p = model.accuracy_on(code["difficulty"])
    return {"right": p, "wrong": 1 - p}


class SimulatedExpert(BaseTool):
    """Arguments: ``model`` (an alias of ``models``) and, optionally, ``question`` (default: the
    task's question, as when the expert is handed the task; a composite tool's prompt, which
    already carries the episode's context)."""

    def __init__(
        self,
        spec: ToolSpec,
        models: dict[str, dict[str, Any]],
        prompt_overhead_tokens: int = 60,
        ends_episode: bool = False,
        writes: str = "answer",
        build: BuildSettings = BuildSettings(),
    ) -> None:
        super().__init__(spec)
        if writes not in WRITES:
            raise ToolError(
                f"{spec.name}: writes must be one of {', '.join(WRITES)}, got {writes!r}"
            )
        self.writes = writes
        try:
            self.models = {alias: SimulatedModel(**options) for alias, options in models.items()}
        except TypeError as error:
            raise ToolError(f"{spec.name}: bad simulated model options: {error}") from None
        self.pricing = {
            alias: model_pricing(m.counterpart, build.prices) for alias, m in self.models.items()
        }
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
            return ToolResult(
                error="the simulated expert only answers tasks with a reference "
                "answer (offline demo)"
            )
        question = arguments.get("question") or context.task.question
        # What fits its context is all it reads, pays for and can find the evidence in.
        observations = fit_observations(context.observations, model.max_context_tokens)
        # One draw per episode and model: asked again, a model makes the same choice (the same
        # query, the same program, right or wrong alike); different samples differ.
        rng = random.Random(zlib.crc32(f"{context.seed}|{context.episode_id}|{alias}".encode()))
        output, answer = self._write(model, context.task, observations, rng)
        output_tokens = max(
            1,
            round(
                rng.lognormvariate(math.log(model.mean_output_tokens), model.output_tokens_sigma)
            ),
        )
        # A composite's prompt already holds the context it was handed.
        context_tokens = (
            0
            if "question" in arguments
            else sum(len(observation) for observation in observations) // CHARS_PER_TOKEN
        )
        usage = Usage(
            input_tokens=self.prompt_overhead_tokens + len(question) // 4 + context_tokens,
            output_tokens=output_tokens,
        )
        # Simulated time: reported, not slept, so the demo runs fast.
        seconds = output_tokens / model.tokens_per_second
        return ToolResult(
            output=output,
            usage=usage,
            latency_s=seconds,
            cost_usd=self.pricing[alias].cost(usage, 0.0) + self.spec.pricing.cost(Usage(), 0.0),
            answer=answer if self.ends_episode else None,
        )

    def _write(
        self, model: SimulatedModel, task: Any, observations: tuple[str, ...], rng: random.Random
    ) -> tuple[str, str | None]:
        """Its reply, and the answer in it (None unless it writes answers)."""
        metadata = task.metadata
        if self.writes != "answer":
            chances = writing_chances(self.writes, model, metadata, observations)
            # A draw only where there is a choice: right with its chance, else wrong.
            kind = (
                next(iter(chances))
                if len(chances) == 1
                else "right"
                if rng.random() < chances["right"]
                else "wrong"
            )
            if self.writes == "query":
                return metadata["query"][0 if kind == "right" else 1], None
            return f"```python\n{metadata['code'][kind]}\n```", None
        level, unrelated = reading(metadata, observations)
        correct = rng.random() < model.accuracy_on(level) * model.distraction**unrelated
        answer = task.answer if correct else wrong_answer(task.answer, rng)
        return f"Answer: {answer}", answer
