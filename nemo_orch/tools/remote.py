"""A tool served elsewhere (declared with ``endpoint:``), e.g. a sandbox pool on a CPU node or a
retriever next to its index, reached with the project's retry and key rules.

Protocol: ``POST <endpoint>`` with ``{"arguments": {...}, "context": {"task_id", "episode_id",
"allowed_documents", "seed", "observations"}}``; the answer is a :class:`ToolResult` as JSON (what
:func:`nemo_orch.serve.tool_server.start_tool_server` serves).
"""

from __future__ import annotations

from typing import Any

from nemo_orch.http import HTTPError, JSONClient
from nemo_orch.tools.base import BaseTool, ToolContext, ToolResult, ToolSpec, Usage


def context_to_json(context: ToolContext) -> dict[str, Any]:
    documents = context.allowed_documents
    return {"task_id": context.task_id, "episode_id": context.episode_id, "seed": context.seed,
            "allowed_documents": None if documents is None else sorted(documents),
            "observations": list(context.observations)}


def context_from_json(record: dict[str, Any]) -> ToolContext:
    documents = record.get("allowed_documents")
    return ToolContext(task_id=str(record.get("task_id", "")),
                       episode_id=str(record.get("episode_id", "")),
                       seed=int(record.get("seed", 0)),
                       allowed_documents=None if documents is None else frozenset(documents),
                       observations=tuple(map(str, record.get("observations", ()))))


def result_from_json(record: dict[str, Any]) -> ToolResult:
    usage = record.get("usage") or {}
    return ToolResult(output=str(record.get("output", "")), error=record.get("error"),
                      usage=Usage(int(usage.get("input_tokens", 0)),
                                  int(usage.get("output_tokens", 0))),
                      cost_usd=float(record.get("cost_usd", 0.0)),
                      latency_s=float(record.get("latency_s", 0.0)),
                      cached=bool(record.get("cached", False)), answer=record.get("answer"))


class RemoteTool(BaseTool):
    """Options: ``api_key_env`` (the variable holding the endpoint's key), ``timeout_s`` per
    request and ``max_retries``."""

    def __init__(self, spec: ToolSpec, endpoint: str, api_key_env: str | None = None,
                 timeout_s: float = 60.0, max_retries: int = 2) -> None:
        super().__init__(spec)
        self.client = JSONClient(endpoint, api_key_env=api_key_env, timeout_s=timeout_s,
                                 max_retries=max_retries)

    async def close(self) -> None:
        await self.client.aclose()

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        try:
            record = await self.client.request("POST", "", {
                "arguments": arguments, "context": context_to_json(context)})
        except HTTPError as error:
            return ToolResult(error=f"{self.spec.name} endpoint failed: {error}")
        if not isinstance(record, dict):
            return ToolResult(error=f"{self.spec.name} endpoint sent no result object")
        return result_from_json(record)
