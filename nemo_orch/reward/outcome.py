"""Is the final answer right? String and number matching, the LLM judge, and database state.

The protocol follows the ToolOrchestra reference: an empty answer, or one longer than
``reward.max_answer_words`` words, is wrong; a normalized exact match or a numeric match is right;
anything else goes to the LLM judge when one is configured (``reward.judge_base_url``), asked and
read as its template says (``reward.judge_template``: :mod:`nemo_orch.reward.judge`), and is
wrong otherwise. A judge that fails or answers unreadably makes the answer wrong with the reason
recorded (method ``judge_error``): scoring never raises over an external call.

Domain (database) tasks, rows whose ``metadata["scorer"]`` is ``database``, are right when the
episode's tool calls, replayed on a fresh database, reach the state the gold actions reach and every
required fact is in the final answer (method ``database``; see
:func:`nemo_orch.data.domain_tasks.score_episode`).
"""

from __future__ import annotations

import asyncio
import math
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol

from nemo_orch.clients.openai import EndpointRefusal, OpenAIClient
from nemo_orch.config import RewardConfig
from nemo_orch.data.domain import Domain
from nemo_orch.data.domain_tasks import DomainTask, score_episode
from nemo_orch.data.tasks import Task
from nemo_orch.reward.judge import JudgeTemplate, load_judge_template

# How an outcome was decided; every one is logged as its own component.
OUTCOME_METHODS = (
    "empty",
    "too_long",
    "exact",
    "numeric",
    "judge",
    "no_match",
    "judge_error",
    "database",
    "agent",  # an external agent loop's own verdict (rollout.agent=external)
)

_ANSWER_PREFIX = re.compile(r"^\s*(?:final\s+)?answer\s*:\s*", re.IGNORECASE)
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
# Punctuation that carries a number's meaning: a sign before a digit, a decimal point or a
# fraction bar between digits. SQuAD normalization would turn "-3.5" and "35" into the same string.
_NUMERIC_PUNCTUATION = re.compile(r"(?:(?<![\w.])-(?=\d)|(?<=\d)[./](?=\d))")
_PUNCTUATION = frozenset(string.punctuation)
_NUMBER = re.compile(
    r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+|(?<=\d))"
    r"(?:\s*/\s*\d+(?![\d.]))?(?:[eE][-+]?\d+)?"
)


def normalize_answer(text: str) -> str:
    """SQuAD-style normalization (lowercase; punctuation, articles and extra whitespace removed),
    after dropping a leading ``Answer:``. Signs, decimal points and fraction bars inside numbers
    are kept, so different numbers never normalize to the same string."""
    text = _ANSWER_PREFIX.sub("", text).lower()
    kept = {match.start() for match in _NUMERIC_PUNCTUATION.finditer(text)}
    text = "".join(
        char for index, char in enumerate(text) if char not in _PUNCTUATION or index in kept
    )
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> bool:
    """Equal after :func:`normalize_answer` (an empty normalization never matches)."""
    normalized = normalize_answer(prediction)
    return bool(normalized) and normalized == normalize_answer(reference)


def parse_number(text: str) -> float | None:
    """The value of ``text`` if it is one number written like ``1,234``, ``-3.5``, ``.5``,
    ``1e-3`` or ``3/4``; else None."""
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        return None
    text = text.replace(",", "").replace(" ", "")
    try:
        return float(Fraction(text)) if "/" in text else float(text)
    except ZeroDivisionError:
        return None


def numeric_match(prediction: str, reference: str, rel_tol: float, abs_tol: float) -> bool:
    """The last number in the prediction equals the reference, which must be a single number
    (optionally with ``$``, ``%`` or a final period), within ``rel_tol`` / ``abs_tol``."""
    core = _ANSWER_PREFIX.sub("", reference).strip().removesuffix(".").strip()
    expected = parse_number(core.removeprefix("$").removesuffix("%"))
    numbers = [match[0] for match in _NUMBER.finditer(prediction)]
    got = parse_number(numbers[-1]) if numbers else None
    if expected is None or got is None:
        return False
    return math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol)


@dataclass(frozen=True)
class OutcomeResult:
    """Whether an answer is right, how that was decided (one of :data:`OUTCOME_METHODS`) and why."""

    correct: bool
    method: str
    detail: str = ""


class AnswerScorer(Protocol):
    """What scores answers: :class:`OutcomeScorer` in-process, or
    :class:`~nemo_orch.reward.remote.RemoteOutcomeScorer` on a reward server."""

    async def score(
        self, task: Task, answer: str | None, calls: Sequence[tuple[str, dict[str, Any]]] = ()
    ) -> OutcomeResult: ...


class OutcomeScorer:
    """Scores final answers under the reference protocol (see the module docstring).

    ``client`` overrides the judge client built from ``config`` (e.g. with other timeouts);
    ``judge_in_flight`` bounds the built client's requests in flight. With a judge, its template
    (``reward.judge_template``) is read once, here.
    Judge verdicts are cached per (task id, normalized answer), and concurrent requests for the
    same pair share one judge call, so a group repeating a wrong answer costs one request.
    Judge failures are not cached: the next score asks again.
    """

    def __init__(
        self,
        config: RewardConfig,
        client: OpenAIClient | None = None,
        domains: Mapping[str, Domain] | None = None,
        judge_in_flight: int | None = None,
    ) -> None:
        self.config = config
        self.domains = dict(domains or {})
        self._domain_tasks: dict[str, DomainTask] = {}
        if client is None and config.judge_base_url is not None:
            client = OpenAIClient(
                config.judge_base_url,
                config.judge_model,
                dialect=config.judge_dialect,
                name="reward.judge",
                api_key_env=config.judge_api_key_env,
                timeout_s=config.judge_timeout_s,
                max_retries=config.judge_max_retries,
                max_in_flight=judge_in_flight,
            )
        self.client = client
        self.judge: JudgeTemplate | None = (
            None if client is None else load_judge_template(config.judge_template)
        )
        self._verdicts: dict[tuple[str, str], OutcomeResult] = {}
        self._pending: dict[tuple[str, str], asyncio.Future[OutcomeResult]] = {}

    async def score(
        self, task: Task, answer: str | None, calls: Sequence[tuple[str, dict[str, Any]]] = ()
    ) -> OutcomeResult:
        """The outcome of ``answer`` (None: the episode gave none) for ``task``; ``calls`` are
        the episode's tool calls, which a domain task is scored on."""
        if task.metadata.get("scorer") == "database":
            return self._database(task, answer or "", calls)
        answer = (answer or "").strip()
        if not normalize_answer(answer):
            return OutcomeResult(False, "empty")
        words = len(answer.split())
        if words > self.config.max_answer_words:
            return OutcomeResult(
                False,
                "too_long",
                f"{words} words > max_answer_words={self.config.max_answer_words}",
            )
        if task.answer is None:
            return OutcomeResult(False, "no_match", "the task has no reference answer")
        if exact_match(answer, task.answer):
            return OutcomeResult(True, "exact")
        if numeric_match(
            answer, task.answer, self.config.numeric_rel_tol, self.config.numeric_abs_tol
        ):
            return OutcomeResult(True, "numeric")
        if self.client is None:
            return OutcomeResult(False, "no_match")
        return await self._judged(task, answer)

    def _database(
        self, task: Task, answer: str, calls: Sequence[tuple[str, dict[str, Any]]]
    ) -> OutcomeResult:
        name = task.metadata["domain"]
        if name not in self.domains:
            raise ValueError(f"task {task.id}: domain {name!r} is not loaded (tools.domains)")
        domain_task = self._domain_tasks.get(task.id)
        if domain_task is None:
            domain_task = DomainTask.model_validate(task.metadata["domain_task"])
            self._domain_tasks[task.id] = domain_task
        score = score_episode(self.domains[name], domain_task, calls, answer)
        problems = (
            ([] if score.db_match else ["the database differs from the gold state"])
            + [f"not communicated: {fact!r}" for fact in score.missing_facts]
            + [f"not called: {action}" for action in score.missing_actions]
        )
        return OutcomeResult(score.reward == 1.0, "database", "; ".join(problems))

    async def _judged(self, task: Task, answer: str) -> OutcomeResult:
        key = (task.id, normalize_answer(answer))
        if key in self._verdicts:
            return self._verdicts[key]
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._ask_judge(task, answer))
            self._pending[key] = pending
            pending.add_done_callback(lambda done: self._forget(key, done))
        # Shielded: one waiter's cancellation must not cancel the call the others share.
        result = await asyncio.shield(pending)
        if result.method == "judge":
            self._verdicts[key] = result
        return result

    def _forget(self, key: tuple[str, str], done: asyncio.Future[OutcomeResult]) -> None:
        if self._pending.get(key) is done:
            del self._pending[key]

    async def _ask_judge(self, task: Task, answer: str) -> OutcomeResult:
        judge = self.judge
        assert self.client is not None and judge is not None and task.answer is not None
        extra = (
            None if judge.response_format is None else {"response_format": judge.response_format}
        )
        try:
            reply = await self.client.chat(
                judge.messages(task.question, task.answer, answer),
                max_tokens=judge.max_tokens,
                temperature=judge.temperature,
                extra=extra,
            )
        except EndpointRefusal:
            raise  # a judge that refuses its dialect would fail every answer alike
        except Exception as error:  # any failure of the judge is a wrong answer, never a crash
            return OutcomeResult(False, "judge_error", f"{type(error).__name__}: {error}")
        unusable = reply.unusable(judge.max_tokens)
        verdict, detail = judge.parse(reply.text)
        if unusable is not None and verdict is None:  # a verdict before the cut still stands
            return OutcomeResult(False, "judge_error", f"the judge {unusable[1]} ({unusable[0]})")
        if verdict is None:
            return OutcomeResult(
                False, "judge_error", f"no verdict ({detail}) in {reply.text[:200]!r}"
            )
        return OutcomeResult(verdict, "judge", detail)
