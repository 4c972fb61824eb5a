"""An episode's record: what a finished episode leaves for training, rewards and reports.

A :class:`Trajectory` holds the token record the trainer scores, the messages, and the ledger:
one :class:`TurnRecord` per policy turn, one :class:`CallRecord` per tool call, the user's
:class:`UserUsage` in a conversation. Every record is keyword-only: its fields are many and
alike (counts, seconds, dollars), and a positional slip would go unnoticed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from nemo_orch.call_kinds import CallKind, InfraFailure, kind_of
from nemo_orch.rollout.format import FORMAT_ERRORS
from nemo_orch.tools.base import ToolResult


class Termination(StrEnum):
    """Why an episode ended."""

    # The policy answered (an ``<answer>``, or an ``answer`` tool's result).
    ANSWER = "answer"
    # ``rollout.max_turns`` turns went by without an answer.
    MAX_TURNS = "max_turns"
    # The context had no room for another turn, or for the turn's observations.
    CONTEXT_LIMIT = "context_limit"
    # The policy's engine failed (an infrastructure failure: the turn's finish_reason says how).
    ENGINE_ERROR = "engine_error"
    # The turn's calls took the episode past the task's USD budget.
    BUDGET = "budget"
    # With a user (tau2's customer): the user ended the conversation.
    USER_STOP = "user_stop"
    # With a user: the user's endpoint failed (an infrastructure failure).
    USER_ERROR = "user_error"
    # With a user: tau2's step limit.
    MAX_STEPS = "max_steps"
    # With a user: tau2's limit on failed tool calls.
    TOO_MANY_ERRORS = "too_many_errors"
    # A gold replay whose action failed: the task's gold, not a policy, is at fault.
    GOLD_ERROR = "gold_error"
    # An external agent loop (rollout.agent=external) ended the episode before an answer or a
    # limit: what the policy wrote is scored as it stands.
    AGENT_STOP = "agent_stop"
    # An external agent loop failed, or abandoned the episode (no end reported in time): an
    # infrastructure failure (``Trajectory.agent_error`` says which).
    AGENT_ERROR = "agent_error"


class RolloutError(RuntimeError):
    """The rollout machinery broke an invariant (never a model or tool mistake)."""


class TokenHistory:
    """Token ids (the first ``prompt_length`` the prompt's) with, per token, the loss mask, whether it is part of a routing decision (see
    :func:`~nemo_orch.rollout.format.decision_end`), the sampling logprob (0 off-policy) and
    whether exploration forced it."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_length = len(prompt_ids)
        self.ids = list(prompt_ids)
        self.mask = [0] * len(prompt_ids)
        self.decisions = [0] * len(prompt_ids)
        self.logprobs = [0.0] * len(prompt_ids)
        self.forced = [0] * len(prompt_ids)

    def add_policy(self, ids: list[int], logprobs: list[float], forced: int = 0) -> None:
        """The policy's tokens, the first ``forced`` of them written by exploration."""
        if len(ids) != len(logprobs):
            raise RolloutError(f"engine returned {len(ids)} tokens but {len(logprobs)} logprobs")
        self.ids += ids
        self.mask += [1] * len(ids)
        self.decisions += [0] * len(ids)
        self.logprobs += logprobs
        self.forced += [1] * forced + [0] * (len(ids) - forced)

    def add_template(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.decisions += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.forced += [0] * len(ids)

    def mark_decision(self, start: int, count: int) -> None:
        self.decisions[start : start + count] = [1] * count


@dataclass(frozen=True, kw_only=True)
class UserReply:
    """The user's answer to one agent message: its text (None on ``error``), whether it ends
    the conversation, the steps and errors it took as tau2 counts them (its messages, its own
    tool calls' results and their failures) and what it cost."""

    text: str | None
    stop: bool = False
    error: str | None = None
    steps: int = 0
    errors: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    seconds: float = 0.0


@dataclass(kw_only=True)
class UserUsage:
    """The user's side of an episode's ledger, kept apart from the orchestrator's and the
    experts' cost (the reward's cost term never sees it), and the failure of its endpoint
    that ended the episode, if one did."""

    messages: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    seconds: float = 0.0
    error: str | None = None

    def add(self, reply: UserReply) -> None:
        self.messages += reply.error is None
        self.error = reply.error or self.error
        self.input_tokens += reply.input_tokens
        self.output_tokens += reply.output_tokens
        self.cost_usd += reply.cost_usd
        self.seconds += reply.seconds


@dataclass(kw_only=True)
class CallRecord:
    """The ledger line of one call: its cost, seconds and tokens by kind (``reasoning_tokens``
    of the ``output_tokens``), its error and :class:`~nemo_orch.call_kinds.CallKind` (left out:
    derived from ``error``, as :class:`ToolResult` derives it; a call the parser refused is the
    policy's ``tool_error``); ``trajectory`` is the episode a sub-orchestrator ran for it
    (:attr:`ToolResult.trajectory`), saved with the caller's trajectory."""

    tool: str | None
    arguments: dict[str, Any] | None
    cost_usd: float = 0.0
    seconds: float = 0.0
    cached: bool = False
    error: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    trajectory: dict[str, Any] | None = None
    reasoning_tokens: int = 0
    kind: CallKind | None = None
    replayed: bool = False  # answered from the call store: its cost recorded, not spent

    def __post_init__(self) -> None:
        self.kind = kind_of(self.kind, self.error)

    @classmethod
    def of(cls, tool: str, arguments: dict[str, Any], result: ToolResult) -> CallRecord:
        """The record of a call that ran and produced ``result``."""
        return cls(
            tool=tool,
            arguments=arguments,
            cost_usd=result.cost_usd,
            seconds=result.latency_s,
            cached=result.cached,
            error=result.error,
            input_tokens=result.usage.input_tokens,
            output_tokens=result.usage.output_tokens,
            trajectory=result.trajectory,
            reasoning_tokens=result.usage.reasoning_tokens,
            kind=result.kind,
            replayed=result.replayed,
        )

    @property
    def endpoint(self) -> str:
        """What was called, as a failure names it: the tool, and the model it chose
        (``answer(model=answer-1)``)."""
        model = (self.arguments or {}).get("model")
        tool = self.tool or "(unreadable call)"
        return f"{tool}(model={model})" if isinstance(model, str) else tool


@dataclass(kw_only=True)
class TurnRecord:
    """The ledger line of one turn: what the orchestrator read and wrote, what it called, and
    the version of the policy's weights that wrote it (None where the engine's are not
    versioned)."""

    turn: int
    input_tokens: int
    output_tokens: int
    generation_seconds: float
    orchestrator_cost_usd: float
    finish_reason: str
    calls: list[CallRecord] = field(default_factory=list)
    format_errors: list[str] = field(default_factory=list)
    policy_version: int | None = None
    # A chat agent's turn answered from the call store: its cost recorded, not spent.
    replayed: bool = False

    @property
    def cost_usd(self) -> float:
        return self.orchestrator_cost_usd + sum(call.cost_usd for call in self.calls)

    @property
    def tool_seconds(self) -> float:
        # Calls of one turn run concurrently: the turn waits for the slowest.
        return max((call.seconds for call in self.calls), default=0.0)


@dataclass(kw_only=True)
class Trajectory:
    """A finished episode: the token record for training, the messages, and the ledger."""

    task_id: str
    sample: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    token_ids: list[int]
    loss_mask: list[int]
    decision_mask: list[int]
    logprobs: list[float]
    prompt_length: int
    turns: list[TurnRecord]
    termination: Termination
    answer: str | None
    wall_seconds: float
    user: UserUsage | None = None
    # With ``task_id`` and ``sample``, what keys the episode's state (see EpisodeStates).
    seed: int = 0
    # The offered tools that came from a tool source (an MCP server), by the source's name.
    tool_sources: dict[str, str] = field(default_factory=dict)
    # Per token, 1 where exploration forced it (GRPO's ``explore_share`` and
    # ``explore_models``): a policy token trained on, but not the policy's draw. Empty: none.
    forced_mask: list[int] = field(default_factory=list)
    # An external agent loop's episode (nemo_orch.rollout.external): how it failed (termination
    # agent_error), its own verdict on the answer where it scores itself (None: the environment
    # scores), and how often its conversation left the recorded one (each time a new branch).
    agent_error: str | None = None
    agent_correct: bool | None = None
    branches: int = 0

    def __post_init__(self) -> None:
        self.termination = Termination(self.termination)

    @classmethod
    def without_tokens(
        cls,
        *,
        task_id: str,
        sample: int,
        seed: int,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        turns: list[TurnRecord],
        termination: Termination,
        answer: str | None,
        wall_seconds: float,
    ) -> Trajectory:
        """The episode of an agent that is not a token-level policy (a chat endpoint, a gold
        replay): the same messages and ledger, no token record."""
        return cls(
            task_id=task_id,
            sample=sample,
            messages=messages,
            tools=tools,
            token_ids=[],
            loss_mask=[],
            decision_mask=[],
            logprobs=[],
            prompt_length=0,
            turns=turns,
            termination=termination,
            answer=answer,
            wall_seconds=wall_seconds,
            seed=seed,
        )

    @property
    def cost_usd(self) -> float:
        return sum(turn.cost_usd for turn in self.turns)

    @property
    def spent_usd(self) -> float:
        """What this run paid: :attr:`cost_usd` but what the call store answered (a chat
        agent's turns, tools' calls), which the reports bill at its recorded cost."""
        return sum(
            (0.0 if turn.replayed else turn.orchestrator_cost_usd)
            + sum(call.cost_usd for call in turn.calls if not call.replayed)
            for turn in self.turns
        )

    @property
    def tool_seconds(self) -> float:
        return sum(turn.tool_seconds for turn in self.turns)

    @property
    def generation_seconds(self) -> float:
        return sum(turn.generation_seconds for turn in self.turns)

    @property
    def oldest_policy_version(self) -> int | None:
        """The version of the oldest weights that wrote a turn (an episode in flight during a
        weight update continues on the new ones); None where none is versioned."""
        versions = [turn.policy_version for turn in self.turns if turn.policy_version is not None]
        return min(versions, default=None)

    def calls(self) -> list[tuple[str, dict[str, Any]]]:
        """Every well-formed tool call of the episode, in order (what a domain task is scored
        on: the database replays them)."""
        return [
            (call.tool, call.arguments)
            for turn in self.turns
            for call in turn.calls
            if call.tool is not None and call.arguments is not None
        ]

    @property
    def format_errors(self) -> dict[str, int]:
        counts = Counter(kind for turn in self.turns for kind in turn.format_errors)
        return {kind: counts[kind] for kind in FORMAT_ERRORS if counts[kind]}

    def tool_counts(self) -> dict[str, int]:
        """The calls that succeeded (kind ``ok``), by tool."""
        return dict(
            Counter(
                call.tool
                for turn in self.turns
                for call in turn.calls
                if call.tool is not None and call.error is None
            )
        )

    def call_kinds(self) -> dict[str, dict[str, int]]:
        """Every call, by tool (``?`` where the policy wrote no readable name) and
        :class:`~nemo_orch.call_kinds.CallKind`."""
        counts: dict[str, Counter] = {}
        for turn in self.turns:
            for call in turn.calls:
                counts.setdefault(call.tool or "?", Counter())[call.kind] += 1
        return {
            tool: {str(kind): count for kind, count in kinds.items()}
            for tool, kinds in counts.items()
        }

    def infra_failure(self) -> InfraFailure | None:
        """The failure outside the policy that decided this episode (None: none did): the
        policy's engine or the user's endpoint that ended it, a gold action that failed, or
        the first call that failed as ``infra_error``. Any such call decides the episode,
        whatever came after it: masking only the episodes that then went wrong would favour
        the flaky endpoints (their failures hidden, their luck kept)."""
        if self.termination == Termination.ENGINE_ERROR:
            return InfraFailure(
                "engine_error", "the policy", self.turns[-1].finish_reason if self.turns else ""
            )
        if self.termination == Termination.AGENT_ERROR:
            return InfraFailure("agent_error", "the agent loop", self.agent_error or "")
        if self.termination == Termination.USER_ERROR:
            return InfraFailure(
                "user_error", "the user", (self.user.error if self.user is not None else None) or ""
            )
        failed = [call for turn in self.turns for call in turn.calls if call.kind != CallKind.OK]
        if self.termination == Termination.GOLD_ERROR:
            call = failed[0]
            return InfraFailure("gold_error", call.endpoint, f"{call.kind}: {call.error}")
        infra = next((call for call in failed if call.kind == CallKind.INFRA_ERROR), None)
        return (
            None
            if infra is None
            else InfraFailure("infra_error", infra.endpoint, infra.error or "")
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "sample": self.sample,
            "seed": self.seed,
            "messages": self.messages,
            "termination": self.termination,
            "answer": self.answer,
            "num_tokens": len(self.token_ids),
            "prompt_tokens": self.prompt_length,
            "policy_tokens": sum(self.loss_mask),
            "cost_usd": self.cost_usd,
            "spent_usd": self.spent_usd,
            "tool_seconds": self.tool_seconds,
            "generation_seconds": self.generation_seconds,
            "wall_seconds": self.wall_seconds,
            "format_errors": self.format_errors,
            "tool_counts": self.tool_counts(),
            "call_kinds": self.call_kinds(),
            "tool_sources": self.tool_sources,
            "user": None if self.user is None else asdict(self.user),
            "ledger": [asdict(turn) | {"cost_usd": turn.cost_usd} for turn in self.turns],
            "token_ids": self.token_ids,
            "loss_mask": self.loss_mask,
            "decision_mask": self.decision_mask,
            "logprobs": self.logprobs,
            "forced_mask": self.forced_mask,
            "agent_error": self.agent_error,
            "agent_correct": self.agent_correct,
            "branches": self.branches,
        }
