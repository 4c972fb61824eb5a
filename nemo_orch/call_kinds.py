"""One taxonomy for how a call to anything outside the policy ended, from the endpoint to the
advantage: expert LLMs, judges, user simulators, MCP and HTTP tools, the sandbox, retrievers,
web search. Every call record carries its :class:`CallKind`; the policy's observation names it;
every report counts it.

An *episode* whose outcome a failure outside the policy decided (:class:`InfraFailure`: a call
that failed as ``infra_error``, a user or policy endpoint that ended it, a judge that could not
score it, a gold action that failed) says nothing of the policy: training masks it out of its
group and the loss, evaluations list it and leave it out of accuracy (a resumed evaluation runs
it again). A ``tool_error``, ``refused``, ``truncated`` or ``empty`` call stays in the reward:
the policy chose the call, and must learn to handle tools that say no.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class CallKind(StrEnum):
    """How one call ended."""

    # It answered, with usable content.
    OK = "ok"
    # Cut short: the endpoint's finish_reason ``length`` or ``content_filter``, or a cap hit;
    # what came back, if anything, is kept beside the error.
    TRUNCATED = "truncated"
    # The endpoint refused the request for what it carried (HTTP 400/413/422: a parameter, the
    # context's length, a policy): the request as the policy's choices made it.
    REFUSED = "refused"
    # The tool ran and said no (bad arguments, an unknown model, code that raised): the
    # policy's own doing.
    TOOL_ERROR = "tool_error"
    # The infrastructure failed: a timeout, 5xx or 429 after the retries, no connection, a
    # malformed reply, a server gone, an open circuit, a tool that crashed.
    INFRA_ERROR = "infra_error"
    # An answer without usable content (an image only where text is expected, an empty reply).
    EMPTY = "empty"


# The order every report lists kinds in.
KINDS: tuple[CallKind, ...] = tuple(CallKind)

# How an observation introduces a failed call's message, by kind: the policy reads whether the
# call, the tool or the infrastructure failed. A tool error keeps the plain "Error:" prefix that
# tau2-bench's own tools write.
OBSERVATION_PREFIX: dict[CallKind, str] = {
    CallKind.TOOL_ERROR: "Error",
    CallKind.REFUSED: "Refused",
    CallKind.INFRA_ERROR: "Unavailable (infrastructure failure, not the call's fault)",
    CallKind.TRUNCATED: "Truncated",
    CallKind.EMPTY: "Empty result",
}

# Why an episode says nothing of the policy (InfraFailure.reason): a call that failed as
# infra_error, the user's or the policy's endpoint that ended it (its terminations), the judge
# that could not score it, a gold action that failed, an external agent loop that failed.
INFRA_REASONS = (
    "infra_error",
    "user_error",
    "engine_error",
    "judge_error",
    "gold_error",
    "agent_error",
)


def kind_of(kind: str | None, error: str | None) -> CallKind:
    """The kind of a call that ended with ``error`` (None: none), as declared (``kind``) or,
    when not, ``ok`` without an error and ``tool_error`` with one; a ValueError when the two
    disagree (an ok call with an error, a failed one without)."""
    resolved = (
        CallKind(kind)
        if kind is not None
        else (CallKind.OK if error is None else CallKind.TOOL_ERROR)
    )
    if (resolved == CallKind.OK) != (error is None):
        raise ValueError(
            f"a call of kind {resolved} must {'not ' * (error is not None)}carry "
            f"an error message (error={error!r})"
        )
    return resolved


@dataclass(frozen=True)
class InfraFailure:
    """What failure outside the policy decided an episode: ``reason`` (one of
    :data:`INFRA_REASONS`), the ``endpoint`` that failed (``answer(model=answer-1)``,
    ``the user``, ``the policy``, ``the judge``, a gold action) and its message."""

    reason: str
    endpoint: str
    detail: str

    def __post_init__(self) -> None:
        if self.reason not in INFRA_REASONS:
            raise ValueError(
                f"unknown infrastructure failure {self.reason!r}; one of {', '.join(INFRA_REASONS)}"
            )

    def __str__(self) -> str:
        return f"{self.reason} at {self.endpoint}: {self.detail}"


class InfrastructureError(RuntimeError):
    """More of a step's episodes were decided by infrastructure failures than
    ``rollout.max_infra_error_rate`` allows: training stops rather than learn from them."""
