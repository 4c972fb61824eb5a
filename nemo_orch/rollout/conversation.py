"""An episode's other party: tau2's customer (:class:`User`), and the bookkeeping of a
conversation with it (:class:`Conversation`), which counts steps and errors as tau2's
orchestrator does and says when a limit ends the conversation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from nemo_orch.data.tasks import Task
from nemo_orch.rollout.trajectory import Termination, TurnRecord, UserReply, UserUsage
from nemo_orch.tools.base import ToolContext


class User(Protocol):
    """The other party of a conversation episode, with tau2's limits (``max_steps``,
    ``max_errors``). ``greeting`` is the agent's fixed first message; :meth:`reply` answers an
    agent message within the steps and errors the conversation has left, and never raises (a
    failure is a reply with ``error``)."""

    greeting: str
    max_steps: int
    max_errors: int

    async def reply(self, message: str, steps_left: int, errors_left: int) -> UserReply: ...


# Builds an episode's user from its task and call context (the per-episode state's key).
UserFactory = Callable[[Task, ToolContext], User]


class Conversation:
    """tau2's bookkeeping of a conversation with a user: every agent message, user message and
    batch of tool results is a step, every failed tool call (either side's) an error. As in
    tau2's orchestrator, the limits are checked whenever a message is bound for the agent or
    the user, and a limit reached there ends the conversation even when the user stopped on
    that very step (too many errors over too many steps)."""

    def __init__(self, user: User) -> None:
        self.user, self.steps, self.errors, self.usage = user, 0, 0, UserUsage()

    def limit(self) -> Termination | None:
        if self.errors >= self.user.max_errors:
            return Termination.TOO_MANY_ERRORS
        if self.steps >= self.user.max_steps:
            return Termination.MAX_STEPS
        return None

    def agent_turn(self, record: TurnRecord) -> Termination | None:
        """Count an agent message and its calls' results; the limit it reached, if any."""
        self.steps += 1 + bool(record.calls)
        self.errors += sum(call.error is not None for call in record.calls)
        return self.limit()

    async def tell(self, message: str) -> tuple[str | None, Termination | None]:
        """The user's reply to ``message`` and what ended the conversation (None: nothing)."""
        reply = await self.user.reply(
            message, self.user.max_steps - self.steps, self.user.max_errors - self.errors
        )
        self.usage.add(reply)
        self.steps += reply.steps
        self.errors += reply.errors
        if reply.error is not None:
            return None, Termination.USER_ERROR
        return reply.text, self.limit() or (Termination.USER_STOP if reply.stop else None)
