"""A tool served elsewhere (declared with ``endpoint:``), e.g. a sandbox pool on a CPU node or a
retriever next to its index: a Triton model that ``nemo-orch serve tool NAME`` runs, reached over
KServe v2 with the project's retry and key rules.

Protocol (:func:`nemo_orch.serve.triton_models.tool_model`): the model is named after the tool
(option ``model`` overrides); inputs ``arguments`` (a JSON object) and ``context`` (the JSON of
:func:`context_to_json`: task and episode ids, the document whitelist, the seed, earlier
observations and the task itself); output ``result``, a :class:`ToolResult` as JSON.
"""

from __future__ import annotations

import json
from typing import Any

from nemo_orch.call_kinds import CallKind
from nemo_orch.clients.http import HTTPError
from nemo_orch.data.tasks import task_from_json
from nemo_orch.tools.base import BaseTool, ToolContext, ToolResult, ToolSpec, Usage

TOOL_INPUTS = ("arguments", "context")
TOOL_OUTPUT = "result"
# What a client reads in a served tool's configuration (its ``parameters``).
TOOL_DESCRIPTIONS = {
    "arguments": "JSON object: the call's arguments, as the tool's schema describes them",
    "context": "JSON object: the call's task and episode ids, document whitelist, seed, "
    "earlier observations and task (context_to_json)",
    TOOL_OUTPUT: "JSON object: the ToolResult (output, error, kind, cost_usd, latency_s, "
    "cached, answer, usage, trajectory); a tool's own failure is a result with "
    "error and its kind",
}


def context_to_json(context: ToolContext) -> dict[str, Any]:
    documents = context.allowed_documents
    return {
        "task_id": context.task_id,
        "episode_id": context.episode_id,
        "seed": context.seed,
        "allowed_documents": None if documents is None else sorted(documents),
        "observations": list(context.observations),
        "task": None if context.task is None else context.task.to_json(),
    }


def context_from_json(record: dict[str, Any]) -> ToolContext:
    """The context :func:`context_to_json` wrote; ``ValueError``/``TypeError`` if malformed."""
    documents = record.get("allowed_documents")
    task = record.get("task")
    try:
        seed = int(record.get("seed", 0))
    except OverflowError:  # JSON's Infinity
        raise ValueError(f"seed {record['seed']!r} is not an integer") from None
    return ToolContext(
        task_id=str(record.get("task_id", "")),
        episode_id=str(record.get("episode_id", "")),
        seed=seed,
        allowed_documents=None if documents is None else frozenset(documents),
        observations=tuple(map(str, record.get("observations", ()))),
        task=None if task is None else task_from_json(task, "context.task"),
    )


def result_from_json(record: dict[str, Any]) -> ToolResult:
    """The result :meth:`ToolResult.to_json` wrote; ``ValueError``/``TypeError`` if malformed
    (a ``kind`` that is no :class:`~nemo_orch.call_kinds.CallKind` or disagrees with
    ``error``). A server that sends no ``kind`` has it derived from ``error``."""
    usage = record.get("usage") or {}
    return ToolResult(
        output=str(record.get("output", "")),
        error=record.get("error"),
        kind=record.get("kind"),
        usage=Usage(
            int(usage.get("input_tokens", 0)),
            int(usage.get("output_tokens", 0)),
            int(usage.get("reasoning_tokens", 0)),
        ),
        cost_usd=float(record.get("cost_usd", 0.0)),
        latency_s=float(record.get("latency_s", 0.0)),
        cached=bool(record.get("cached", False)),
        answer=record.get("answer"),
        trajectory=record.get("trajectory"),
    )


class RemoteTool(BaseTool):
    """Options: ``model`` (the Triton model; default: the tool's name), ``api_key_env`` (the
    variable holding the endpoint's key), ``timeout_s`` per request and ``max_retries``."""

    def __init__(
        self,
        spec: ToolSpec,
        endpoint: str,
        model: str | None = None,
        api_key_env: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 2,
    ) -> None:
        from nemo_orch.clients.kserve import KServeClient

        super().__init__(spec)
        self.client = KServeClient(
            endpoint,
            model or spec.name,
            timeout_s=timeout_s,
            max_retries=max_retries,
            api_key_env=api_key_env,
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        try:
            (row,) = await self.client.infer(
                [
                    {
                        "arguments": json.dumps(arguments, ensure_ascii=False),
                        "context": json.dumps(context_to_json(context), ensure_ascii=False),
                    }
                ]
            )
            record = json.loads(row[TOOL_OUTPUT])
        except HTTPError as error:
            return ToolResult(error=f"{self.spec.name} endpoint failed: {error}", kind=error.kind)
        except ValueError:
            return ToolResult(
                error=f"{self.spec.name} endpoint sent a result that is not JSON",
                kind=CallKind.INFRA_ERROR,
            )
        if not isinstance(record, dict):
            return ToolResult(
                error=f"{self.spec.name} endpoint sent no result object", kind=CallKind.INFRA_ERROR
            )
        try:
            return result_from_json(record)
        except (ValueError, TypeError) as error:
            return ToolResult(
                error=f"{self.spec.name} endpoint sent a malformed result: {error}",
                kind=CallKind.INFRA_ERROR,
            )
