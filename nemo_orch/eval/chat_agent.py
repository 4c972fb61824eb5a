"""The monolith baseline: one OpenAI-compatible chat model with the basic tools, through standard
function calling (ToolOrchestra's "GPT-5 with tools").

:class:`ChatAgent` has the evaluation harness's agent seam, ``episode(task, seed) ->
Trajectory``, so a served model is scored, priced and timed exactly like the orchestrator. It
works at the message level: there are no token ids to keep (the trajectory's token fields are
empty), the server's usage is the ledger, and the monolith's own price bills it.

Calls come back either as standard ``tool_calls`` (e.g. from the project's
:mod:`nemo_orch.serve.openai_server`) or, from servers without a tool-call parser (Qwen-style
models served plain, or markup no parser can read), as ``<tool_call>`` markup in ``content``,
read with the orchestrator's own parser (:func:`~nemo_orch.rollout.format.parse_turn`). A
markup turn is kept as written (content only): adding ``tool_calls`` too would render every
call twice in such a server's chat template. Either way each call's observation goes back as a
``tool`` message, and every malformed call becomes a format error of the turn
(:data:`~nemo_orch.rollout.format.FORMAT_ERRORS`) and an error observation the model can recover
from. An endpoint that fails for good ends the episode (``engine_error``); nothing is raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

from nemo_orch.clients.openai import OpenAIClient, OpenAIError
from nemo_orch.clients.openai_replies import ChatResult
from nemo_orch.data.tasks import Task
from nemo_orch.rollout.format import ToolCall, TurnFormat, parse_turn, without_thinking
from nemo_orch.rollout.opening import episode_id
from nemo_orch.rollout.trajectory import CallRecord, Termination, Trajectory, TurnRecord
from nemo_orch.tools.base import Pricing, ToolContext, ToolResult, Usage
from nemo_orch.tools.registry import Toolbox


@dataclass
class _Reply:
    """How one assistant reply is read: the message to keep, the calls it asks for (with their
    ids), its final answer when it asks for none, and its format errors."""

    message: dict[str, Any]
    calls: list[tuple[str, ToolCall]]
    answer: str | None
    format_errors: list[str]


def _standard_call(
    entry: dict[str, Any], call_id: str, fmt: TurnFormat
) -> tuple[ToolCall, dict[str, Any]]:
    """One standard ``tool_calls`` entry (as the client normalizes it: a named function call,
    its arguments a string), checked like a markup call, and its canonical form to send back in
    the assistant message (the id set)."""
    function = entry["function"]
    name, raw = function["name"], function["arguments"]
    echo = {"id": call_id, "type": "function", "function": {"name": name, "arguments": raw}}
    try:
        arguments = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as error:
        return ToolCall(
            name,
            None,
            f"the arguments of {name} are not valid JSON ({error.msg} at character {error.pos})",
            "malformed_json",
        ), echo
    if not isinstance(arguments, dict):
        return ToolCall(
            name, None, f"the arguments of {name} must be a JSON object", "bad_call_shape"
        ), echo
    return fmt.check(name, arguments), echo


def _read_reply(reply: ChatResult, fmt: TurnFormat, turn: int) -> _Reply:
    """Read one chat reply: standard ``tool_calls`` if any, else ``<tool_call>`` markup in the
    content, else a final answer (the last ``<answer>``, or the whole visible content). Call ids
    missing from the reply are synthesized as ``call_<turn>_<index>``."""
    if reply.tool_calls:
        calls, echoed = [], []
        for index, entry in enumerate(reply.tool_calls):
            call_id = entry["id"] or f"call_{turn}_{index}"
            call, echo = _standard_call(entry, call_id, fmt)
            calls.append((call_id, call))
            echoed.append(echo)
        message = {"role": "assistant", "content": reply.text or None, "tool_calls": echoed}
        return _Reply(message, calls, None, [c.error_kind for _, c in calls if c.error_kind])
    message = {"role": "assistant", "content": reply.text}
    parsed = parse_turn(reply.text, fmt)
    if parsed.calls:
        return _Reply(
            message,
            [(f"call_{turn}_{i}", c) for i, c in enumerate(parsed.calls)],
            None,
            list(parsed.format_errors),
        )
    if parsed.answer is not None:
        return _Reply(message, [], parsed.answer, list(parsed.format_errors))
    # No call and no closed answer tag: a plain answer (a chat model need not use the tag);
    # an unclosed <answer> stays a format error, an empty reply is no answer at all.
    visible = without_thinking(reply.text).strip()
    errors = [kind for kind in parsed.format_errors if kind != "no_call" or not visible]
    return _Reply(message, [], visible or None, errors)


class ChatAgent:
    """Runs tasks with one served chat model and a toolbox (see the module docstring).

    ``pricing`` is the model's list price (e.g. ``model_pricing("gpt-5")``): each request's
    server-counted usage is billed at it. ``max_turns`` bounds the requests of an episode.
    """

    def __init__(
        self,
        client: OpenAIClient,
        toolbox: Toolbox,
        pricing: Pricing,
        *,
        max_turns: int,
        max_tokens: int = 1024,
        temperature: float = 0.0,
    ) -> None:
        if max_turns < 1 or max_tokens < 1 or temperature < 0:
            raise ValueError("ChatAgent needs max_turns >= 1, max_tokens >= 1 and temperature >= 0")
        self.client, self.toolbox, self.pricing = client, toolbox, pricing
        self.max_turns, self.max_tokens, self.temperature = max_turns, max_tokens, temperature

    async def episode(self, task: Task, sample: int, seed: int) -> Trajectory:
        """Run ``task`` once: request, run the calls, repeat until an answer, ``max_turns`` or
        an endpoint failure. Never raises for a model, tool or endpoint failure."""
        started = time.perf_counter()
        toolbox = self.toolbox if task.tools is None else self.toolbox.subset(task.tools)
        schemas = toolbox.schemas()
        fmt = TurnFormat.for_tools(schemas, lenient=toolbox.lenient())
        context = ToolContext(
            task_id=task.id,
            episode_id=episode_id(task.id, sample),
            allowed_documents=task.allowed_documents,
            seed=seed,
            task=task,
        )
        messages: list[dict[str, Any]] = []
        if task.system:
            messages.append({"role": "system", "content": task.system})
        messages.append({"role": "user", "content": task.question})
        turns: list[TurnRecord] = []
        termination, answer = Termination.MAX_TURNS, None
        for turn in range(self.max_turns):
            request_start = time.perf_counter()
            try:
                reply = await self.client.chat(
                    messages,
                    tools=schemas or None,
                    max_tokens=self.max_tokens,
                    temperature=self.temperature,
                    seed=seed,
                )
            except OpenAIError as error:  # retries are spent: this episode ends, not the run
                turns.append(
                    TurnRecord(
                        turn=turn,
                        input_tokens=0,
                        output_tokens=0,
                        generation_seconds=time.perf_counter() - request_start,
                        orchestrator_cost_usd=0.0,
                        finish_reason=f"error: {type(error).__name__}: {error}",
                    )
                )
                termination = Termination.ENGINE_ERROR
                break
            usage = Usage(reply.input_tokens, reply.output_tokens)
            record = TurnRecord(
                turn=turn,
                input_tokens=reply.input_tokens,
                output_tokens=reply.output_tokens,
                generation_seconds=reply.latency_s,
                orchestrator_cost_usd=self.pricing.cost(usage, 0.0),
                finish_reason=reply.finish_reason,
                replayed=reply.replayed,
            )
            turns.append(record)
            read = _read_reply(reply, fmt, turn)
            record.format_errors = read.format_errors
            messages.append(read.message)
            if not read.calls:
                termination, answer = Termination.ANSWER, read.answer
                break
            observations = tuple(m["content"] for m in messages if m["role"] == "tool")
            results = await self._run_calls(
                toolbox,
                dataclasses.replace(
                    context,
                    observations=observations,
                    turn=turn,
                    message=read.message.get("content") or None,
                ),
                read,
                record,
            )
            messages.extend(
                {"role": "tool", "tool_call_id": call_id, "content": result.observation}
                for (call_id, _), result in zip(read.calls, results)
            )
            final = next((r.answer for r in results if r.answer is not None), None)
            if final is not None:
                termination, answer = Termination.ANSWER, final
                break
        return Trajectory.without_tokens(
            task_id=task.id,
            sample=sample,
            seed=seed,
            messages=messages,
            tools=schemas,
            turns=turns,
            termination=termination,
            answer=answer,
            wall_seconds=time.perf_counter() - started,
        )

    @staticmethod
    async def _run_calls(
        toolbox: Toolbox, context: ToolContext, read: _Reply, record: TurnRecord
    ) -> list[ToolResult]:
        """Run the valid calls concurrently and ledger every call; per call, its result (an
        error result for a call that could not run)."""
        valid = [call for _, call in read.calls if call.valid]
        results = iter(
            await asyncio.gather(
                *(toolbox.call(call.name, call.arguments, context) for call in valid)
            )
        )
        outcomes: list[ToolResult] = []
        for _, call in read.calls:
            if not call.valid:
                record.calls.append(
                    CallRecord(tool=call.name, arguments=call.arguments, error=call.error)
                )
                outcomes.append(ToolResult(error=call.error))
                continue
            result = next(results)
            record.calls.append(CallRecord.of(call.name, call.arguments, result))
            outcomes.append(result)
        return outcomes
