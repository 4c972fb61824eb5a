"""Outcome scoring served elsewhere (``reward.endpoint``): the Triton model ``reward`` that
``nemo-orch serve reward`` runs (:func:`nemo_orch.serve.triton_models.reward_model`).

One item per answer: ``problem`` (the question), ``prediction`` (the final answer; empty for
none), ``reference`` (the reference answer) and ``metadata``, a JSON object with the task's
``id``, its ``metadata``, whether it has a reference (``has_reference``) and the episode's tool
``calls`` ([name, arguments] pairs: database tasks are scored on them). The answer is
``score`` (1.0 or 0.0), ``correct`` and the components ``method`` and ``detail`` of
:class:`~nemo_orch.reward.outcome.OutcomeResult`. The server runs the same
:class:`~nemo_orch.reward.outcome.OutcomeScorer` as in-process scoring, so the results are equal.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from nemo_orch.data.tasks import Task
from nemo_orch.reward.outcome import OutcomeResult

REWARD_MODEL = "reward"
REWARD_INPUTS = ("problem", "prediction", "reference", "metadata")
REWARD_OUTPUTS: dict[str, type] = {
    "score": np.float32,
    "correct": np.bool_,
    "method": bytes,
    "detail": bytes,
}
# What a client reads in the served model's configuration (its ``parameters``).
REWARD_DESCRIPTIONS = {
    "model": "Outcome scoring: is the prediction a right answer to the problem?",
    "problem": "UTF-8: the question",
    "prediction": "UTF-8: the final answer (empty: none)",
    "reference": "UTF-8: the reference answer (empty: none)",
    "metadata": "JSON object: id (string, required), metadata (object, the task's), "
    "has_reference (bool), calls ([[tool, arguments], ...], the episode's calls)",
    "score": "1.0 when right, else 0.0",
    "correct": "true when right",
    "method": "how it was decided: exact, numeric, judge, judge_error, database, ...",
    "detail": "why",
}


def reward_item(
    task: Task, answer: str | None, calls: Sequence[tuple[str, dict[str, Any]]] = ()
) -> dict[str, str]:
    """The model's inputs for one answer to ``task``."""
    metadata = {
        "id": task.id,
        "metadata": task.metadata,
        "has_reference": task.answer is not None,
        "calls": [[name, arguments] for name, arguments in calls],
    }
    return {
        "problem": task.question,
        "prediction": answer or "",
        "reference": task.answer or "",
        "metadata": json.dumps(metadata, ensure_ascii=False),
    }


def parse_reward_item(item: dict[str, str]) -> tuple[Task, str, list[tuple[str, dict[str, Any]]]]:
    """The task, answer and calls of one item; ``ValueError`` says what is malformed."""
    try:
        metadata = json.loads(item["metadata"])
    except ValueError as error:
        raise ValueError(f"metadata is not JSON: {error}") from None
    if not isinstance(metadata, dict) or not isinstance(metadata.get("id"), str):
        raise ValueError("metadata must be a JSON object with a string 'id'")
    task_metadata = metadata.get("metadata", {})
    calls = metadata.get("calls", [])
    if not isinstance(task_metadata, dict):
        raise ValueError("metadata.metadata must be an object")
    if not isinstance(calls, list) or not all(
        isinstance(call, list)
        and len(call) == 2
        and isinstance(call[0], str)
        and isinstance(call[1], dict)
        for call in calls
    ):
        raise ValueError("metadata.calls must be a list of [name, arguments] pairs")
    has_reference = metadata.get("has_reference", True)
    task = Task(
        id=metadata["id"],
        question=item["problem"],
        metadata=task_metadata,
        answer=item["reference"] if has_reference else None,
    )
    return task, item["prediction"], [(name, arguments) for name, arguments in calls]


class RemoteOutcomeScorer:
    """:class:`~nemo_orch.reward.outcome.OutcomeScorer`'s interface, answered by a reward
    server. The ``score`` calls made together (a ``score_groups`` call gathers a whole batch of
    groups; concurrent callers add theirs) go in requests of up to ``batch_size`` answers: the
    server's per-request cost (milliseconds in PyTriton's proxy) is paid per request, not per
    answer. ``batch_size`` must not exceed the server's ``serve.max_batch_size``. No circuit
    breaker or retry budget cuts its requests short: a run cannot train without rewards, so
    they wait out a restarting server within their retries."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float,
        max_retries: int,
        max_in_flight: int | None = None,
        batch_size: int = 64,
    ) -> None:
        from nemo_orch.clients.breaker import UNGUARDED
        from nemo_orch.clients.kserve import KServeClient

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.client = KServeClient(
            endpoint,
            REWARD_MODEL,
            timeout_s=timeout_s,
            max_retries=max_retries,
            max_in_flight=max_in_flight,
            guard=UNGUARDED,
        )
        self.batch_size = batch_size
        # Answers waiting for the next request, per event loop (futures belong to one loop).
        self._waiting: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, list[tuple[dict[str, str], asyncio.Future[dict]]]
        ] = weakref.WeakKeyDictionary()
        self._requests: set[asyncio.Task[None]] = set()

    async def score(
        self, task: Task, answer: str | None, calls: Sequence[tuple[str, dict[str, Any]]] = ()
    ) -> OutcomeResult:
        loop = asyncio.get_running_loop()
        waiting = self._waiting.setdefault(loop, [])
        answered: asyncio.Future[dict] = loop.create_future()
        waiting.append((reward_item(task, answer, calls), answered))
        if len(waiting) == 1:
            # Sent once the callers scheduled with this one (a gather's) have queued theirs.
            loop.call_soon(self._send_waiting, loop)
        row = await answered
        return OutcomeResult(bool(row["correct"]), str(row["method"]), str(row["detail"]))

    def _send_waiting(self, loop: asyncio.AbstractEventLoop) -> None:
        waiting = self._waiting.pop(loop, [])
        for start in range(0, len(waiting), self.batch_size):
            request = loop.create_task(self._request(waiting[start : start + self.batch_size]))
            self._requests.add(request)  # the loop keeps only a weak reference to a task
            request.add_done_callback(self._requests.discard)

    async def _request(self, items: list[tuple[dict[str, str], asyncio.Future[dict]]]) -> None:
        try:
            rows = await self.client.infer([item for item, _ in items])
        except Exception as error:  # every answer of the request gets the failure
            for _, answered in items:
                if not answered.done():
                    answered.set_exception(error)
            return
        for (_, answered), row in zip(items, rows):
            if not answered.done():  # a caller may have been cancelled
                answered.set_result(row)
