"""Orchestrators as tools of another: a sub-orchestrator's episode, billed to the caller.

A served orchestrator answers a question with one episode of its own loop and that episode's
bill: ``nemo-orch serve orchestrator``'s ``POST /v1/orchestrate`` and ``nemo-orch serve mcp``'s
``solve`` tool return the same body (:mod:`nemo_orch.serve.orchestrator`), whose ``ledger``
holds the episode's total ``cost_usd`` (its own tokens, its experts' tokens and fees) and
``calls``, beside its ``messages``. Either way it is reached — an MCP server declared with
``orchestrator: true`` in ``tools.mcp`` (:mod:`nemo_orch.tools.mcp`), or
:class:`OrchestratorTool` on the ``/v1/orchestrate`` route — the call's result is made here by
:func:`sub_orchestration_result`: the sub-orchestrator's spending is added to the call's own
price, so it reaches the caller's ledger and reward like any expert's tokens, and its episode
(messages and ledger) is kept in :attr:`~nemo_orch.tools.base.ToolResult.trajectory`, which
the caller's trajectory saves with the call.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

from nemo_orch.call_kinds import CallKind
from nemo_orch.tools.base import BaseTool, ToolContext, ToolResult, ToolSpec, Usage, billed_result

# What an orchestrator is asked: the arguments of `solve` (and of /v1/orchestrate's body).
SOLVE_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "question": {"type": "string", "minLength": 1, "description": "The task, stated in full."},
        "preference": {
            "type": "object",
            "additionalProperties": {"type": "number"},
            "description": "Optional feature weights of the answer wanted: accuracy, cost, "
            "latency, tool:<name> or model:<alias> (negative: avoid), e.g. "
            '{"accuracy": 1, "cost": 1}.',
        },
    },
    "required": ["question"],
    "additionalProperties": False,
}


# How ``nemo-orch serve mcp``'s ``solve`` states a refusal or a failure in its ``isError`` text
# (MCP results carry no status): ``HTTP 503 (upstream_unavailable): <why>``, as
# ``/v1/orchestrate`` answers it.
_FAILURE_STATUS = re.compile(r"^HTTP (\d{3}) \(\w+\): ")


def failure_text(status: int, kind: str, message: str) -> str:
    """The ``isError`` text of a ``solve`` call the orchestrator refused or could not answer
    (``/v1/orchestrate``'s status and error type, then why)."""
    return f"HTTP {status} ({kind}): {message}"


def failure_kind(text: str) -> CallKind:
    """The kind of a declared orchestrator's ``isError`` result (:func:`failure_text`): a
    failure behind it (5xx: its experts, its policy's engine) is ``infra_error``, a refusal of
    the request (4xx) ``refused``; any other text is the tool's ``tool_error``."""
    status = _FAILURE_STATUS.match(text)
    if status is None:
        return CallKind.TOOL_ERROR
    return CallKind.INFRA_ERROR if int(status[1]) >= 500 else CallKind.REFUSED


def _non_negative_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def orchestration_text(body: dict[str, Any]) -> str:
    """An orchestration as text, for a reader of text only (an MCP client, the calling policy):
    its answer, then its bill."""
    ledger = body["ledger"]
    head = (
        body["answer"]
        if body.get("answer") is not None
        else f"No answer ({body.get('finish_reason')})."
    )
    called = ", ".join(str(call.get("tool")) for call in ledger["calls"]) or "none"
    return f"{head}\n[cost ${ledger['cost_usd']:.6f}; calls: {called}]"


def sub_orchestration_result(
    spec: ToolSpec, started: float, context: ToolContext, body: Any, observation: str | None = None
) -> ToolResult:
    """The result of a call a sub-orchestrator answered with ``body`` (an orchestration: the
    ``/v1/orchestrate`` answer) and ``observation`` (what the caller's policy reads; None:
    :func:`orchestration_text`): billed at ``spec.pricing`` for its seconds (a per-call fee, by
    default none) plus the episode's ``ledger.cost_usd``; its usage the episode's tokens (the
    sub-orchestrator's and its calls'); its ``trajectory`` the episode. A body without a ledger
    is an error observation: what the call cost is unknown, and a caller must not get its
    answer for free."""
    ledger = body.get("ledger") if isinstance(body, dict) else None
    if not (
        isinstance(ledger, dict)
        and _non_negative_number(ledger.get("cost_usd"))
        and isinstance(ledger.get("calls"), list)
        and isinstance(body.get("messages"), list)
    ):
        return billed_result(
            spec,
            started,
            context,
            kind=CallKind.INFRA_ERROR,
            error=(
                f"{spec.name}: the orchestrator's result carries no ledger (an object with "
                "messages and ledger.cost_usd and ledger.calls)"
            ),
        )
    billed = billed_result(
        spec, started, context, orchestration_text(body) if observation is None else observation
    )
    tokens = ledger.get("tokens") if isinstance(ledger.get("tokens"), dict) else {}
    calls = [call for call in ledger["calls"] if isinstance(call, dict)]

    def spent(kind: str) -> int:
        counts = [tokens.get(kind), *(call.get(f"{kind}_tokens") for call in calls)]
        return sum(int(count) for count in counts if _non_negative_number(count))

    trajectory = {
        key: body.get(key)
        for key in ("id", "model", "seed", "answer", "finish_reason", "turns", "messages", "ledger")
    }
    return dataclasses.replace(
        billed,
        cost_usd=billed.cost_usd + float(ledger["cost_usd"]),
        usage=Usage(spent("input"), spent("output"), spent("reasoning")),
        trajectory=trajectory,
    )


# Where an MCP call carries the sub-orchestrator's seed: the request's ``_meta`` (the policy's
# arguments stay the tool's own), which ``nemo-orch serve mcp`` reads.
SEED_META = "nemo_orch/seed"


def sub_seed(context: ToolContext, tool: str, arguments: dict[str, Any]) -> int:
    """The seed of the sub-orchestrator's episode for this call, derived from the caller's: a
    caller's episode replays whole. Below 2**31, as ``/v1/orchestrate`` takes it."""
    from nemo_orch.seeding import derive_seed

    return derive_seed(context.seed, "orchestrate", context.turn, tool, arguments) % 2**31


class OrchestratorTool(BaseTool):
    """Another orchestrator behind its ``/v1/orchestrate`` route (``nemo-orch serve
    orchestrator``), declared with ``class: nemo_orch.tools.orchestrator.OrchestratorTool`` and
    the parameters :data:`SOLVE_PARAMETERS`. Options: ``base_url`` (ending in ``/v1``),
    ``model`` (the served name, checked by the server; null: any), ``api_key_env`` (the variable
    holding its key), ``timeout_s`` per episode and ``max_retries`` (0 by default: a request
    that failed may still have run its episode, and spent; it is not repeated unless asked).
    The episode's seed derives from the caller's call, so a caller's episode replays whole."""

    def __init__(
        self,
        spec: ToolSpec,
        base_url: str,
        model: str | None = None,
        api_key_env: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 0,
    ) -> None:
        from nemo_orch.clients.http import JSONClient

        super().__init__(spec)
        self.model = model
        self.client = JSONClient(
            base_url, api_key_env=api_key_env, timeout_s=timeout_s, max_retries=max_retries
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        from nemo_orch.clients.http import HTTPError

        started = time.perf_counter()
        request = {**arguments, "seed": sub_seed(context, self.spec.name, arguments)}
        if self.model is not None:
            request["model"] = self.model
        try:
            body = await self.client.request("POST", "/orchestrate", request)
        except HTTPError as error:  # unreachable, refused or timed out: this call's error
            return billed_result(
                self.spec,
                started,
                context,
                error=f"{self.spec.name} failed: {error}",
                kind=error.kind,
            )
        return sub_orchestration_result(self.spec, started, context, body)
