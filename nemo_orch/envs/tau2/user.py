"""tau2's user simulator, played by an LLM behind an OpenAI-compatible endpoint (``env.user``).

What the user is told and how it reads the conversation are tau2's own: ``UserSimulator``'s
system prompt (its guidelines, the tool guidelines where the user has tools, and the task's
``user_scenario``), ``UserState.flip_roles`` (the agent's messages become the user LLM's "user"
turns) and ``to_litellm_messages``, and ``UserSimulator.is_stop`` (``###STOP###``,
``###TRANSFER###``, ``###OUT-OF-SCOPE###``). The greeting is tau2's orchestrator's.

Requests go through the project's one HTTP client (:class:`~nemo_orch.clients.openai.
OpenAIClient`), not tau2's litellm call: the same timeouts, retries with backoff, per-endpoint
concurrency bound and key handling as every other endpoint, and async, so a slow user never
blocks the event loop the other episodes share. tau2's own retry of an empty reply is kept.

The user's tool calls (telecom's phone) run through the domain's user toolbox on the episode's
own tau2 environment, and each call, message and reply lands in the episode's transcript,
which tau2's evaluator replays.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from nemo_orch.clients.http import HTTPError
from nemo_orch.clients.openai import EndpointRefusal, OpenAIClient
from nemo_orch.clients.openai_replies import ChatResult
from nemo_orch.config import UserConfig
from nemo_orch.data.tasks import Task
from nemo_orch.envs.tau2.adapter import ASSISTANT, USER, Tau2Domain, _tau2, tau2_task_of
from nemo_orch.rollout.trajectory import UserReply
from nemo_orch.tools.base import Pricing, ToolContext, ToolError, ToolResult, Usage
from nemo_orch.tools.pricing import model_pricing

# tau2's generate() asks again when a reply has neither text nor tool calls.
EMPTY_REPLY_RETRIES = 3


def user_pricing(config: UserConfig) -> Pricing:
    """The user's token prices: the configured ones, else the model's list price, else free
    (a local model)."""
    if config.input_usd_per_million is not None or config.output_usd_per_million is not None:
        return Pricing.per_million_tokens(
            config.input_usd_per_million or 0.0, config.output_usd_per_million or 0.0
        )
    try:
        return model_pricing(config.model)
    except ToolError:
        return Pricing()


class Tau2Users:
    """Makes each episode's :class:`Tau2User` (a
    :data:`~nemo_orch.rollout.conversation.UserFactory`); the HTTP client, and so its concurrency bound, is shared by all of them."""

    def __init__(self, config: UserConfig, domain: Tau2Domain) -> None:
        if config.base_url is None or config.model is None:
            raise ValueError("an LLM user needs env.user.base_url and env.user.model")
        self.config, self.domain = config, domain
        self.client = OpenAIClient(
            config.base_url,
            config.model,
            dialect=config.dialect,
            name="env.user",
            api_key_env=config.api_key_env,
            timeout_s=config.timeout_s,
            max_retries=config.max_retries,
            max_in_flight=config.max_in_flight,
        )
        self.pricing = user_pricing(config)
        self.toolbox = domain.user_toolbox()
        self.tool_schemas = self.toolbox.schemas()

    def __call__(self, task: Task, context: ToolContext) -> Tau2User:
        return Tau2User(self, task, context)

    def describe(self) -> str:
        """The protocol line of a report: tau2-bench's protocol, and what still differs from
        tau2's own runner (docs/evaluation.md, "Conformance with tau2's runner")."""
        config = self.config
        return (
            f"LLM user {config.model} at {config.base_url} (tau2's user simulator), "
            f"max_steps {config.max_steps}, max_errors {config.max_errors}, tau2's "
            "LLMAgent system prompt. Differences from tau2's runner: the agent writes "
            "through its own chat template (tau2: function calling through litellm); the "
            "policy's context may end an episode tau2 would continue (context_limit, "
            "scored 0); a failing user endpoint ends the episode as user_error (counted, "
            "run again on resume), where tau2's run fails; a call naming no tool of the "
            "domain is refused before tau2 (counted as tau2 counts it, not in the "
            "transcript), where tau2 records its 'Tool not found' error; a call whose "
            "arguments are not JSON is a format error the agent may recover from, where "
            "tau2's run fails"
        )


class Tau2User:
    """One episode's user: tau2's user simulator state, advanced by the user LLM."""

    def __init__(self, users: Tau2Users, task: Task, context: ToolContext) -> None:
        tau2 = _tau2()
        self.users, self.context = users, context
        self.max_steps, self.max_errors = users.config.max_steps, users.config.max_errors
        self.greeting = tau2.orchestrator.DEFAULT_FIRST_AGENT_MESSAGE.content
        tau2_task = tau2_task_of(task)
        simulator = tau2.user_simulator.UserSimulator(
            tools=users.domain.user_tools or None, instructions=str(tau2_task.user_scenario)
        )
        initial = tau2_task.initial_state
        history = (
            [
                message
                for message in (initial.message_history or [])
                if tau2.user_base.is_valid_user_history_message(message)
            ]
            if initial
            else []
        )
        self.state = simulator.get_init_state(message_history=history)
        self.transcript = users.domain.environments.get(context)
        self.call_messages = 0  # the user's messages of tool calls so far

    async def reply(self, message: str, steps_left: int, errors_left: int) -> UserReply:
        """The user's answer to the agent's ``message``: the user LLM's turns until it writes
        text, running its tool calls in between (each call batch and its results count as two
        of tau2's steps), until then or until its results reach ``steps_left`` steps or
        ``errors_left`` failed calls (where tau2's orchestrator checks its limits)."""
        tau2 = _tau2()
        self.transcript.say(ASSISTANT, message)
        self.state.messages.append(tau2.message.AssistantMessage(role="assistant", content=message))
        steps = errors = 0
        usage = Usage()
        started = time.perf_counter()

        def ledger(**fields: Any) -> UserReply:
            seconds = time.perf_counter() - started
            return UserReply(
                steps=steps,
                errors=errors,
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
                cost_usd=self.users.pricing.cost(usage, seconds),
                seconds=seconds,
                **fields,
            )

        while steps < steps_left and errors < errors_left:
            try:
                result = await self._generate()
            except EndpointRefusal:
                raise  # the user endpoint's dialect is wrong: every episode would fail alike
            except (HTTPError, ValueError) as error:
                return ledger(text=None, error=f"the user endpoint failed: {error}")
            steps += 1
            usage += Usage(result.input_tokens, result.output_tokens)
            if result.tool_calls:
                errors += await self._run_calls(result)
                steps += 1
                continue
            user_message = tau2.message.UserMessage(role="user", content=result.text)
            self.state.messages.append(user_message)
            self.transcript.say(USER, result.text)
            return ledger(
                text=result.text, stop=tau2.user_simulator.UserSimulator.is_stop(user_message)
            )
        return ledger(text="")  # out of steps or errors: the conversation's limit ends it

    async def _generate(self) -> ChatResult:
        tau2, config = _tau2(), self.users.config
        messages = tau2.llm_utils.to_litellm_messages(
            self.state.system_messages + self.state.flip_roles()
        )
        tools = self.users.tool_schemas
        for _ in range(EMPTY_REPLY_RETRIES + 1):
            result = await self.users.client.chat(
                messages,
                max_tokens=config.max_tokens,
                temperature=config.temperature,
                top_p=config.top_p,
                seed=self.context.seed if config.seed is None else config.seed,
                tools=tools or None,
                extra={"tool_choice": "auto"} if tools else None,
            )
            if result.text.strip() or result.tool_calls:
                return result
        raise ValueError(
            f"the user returned no text and no tool call {EMPTY_REPLY_RETRIES + 1} times"
        )

    async def _run_calls(self, result: ChatResult) -> int:
        """Run the user's tool calls on the episode's environment; how many failed."""
        tau2 = _tau2()
        calls, parsed = [], []
        for index, raw in enumerate(result.tool_calls):  # normalized by the client
            function = raw["function"]
            try:
                arguments = json.loads(function["arguments"] or "{}")
                if not isinstance(arguments, dict):
                    raise ValueError("arguments are not a JSON object")
            except ValueError as error:
                arguments, failure = {}, f"malformed arguments: {error}"
            else:
                failure = None
            call = tau2.message.ToolCall(
                id=raw["id"] or f"user_call_{index}",
                name=function["name"],
                arguments=arguments,
                requestor="user",
            )
            calls.append(call)
            parsed.append(failure)
        self.state.messages.append(
            tau2.message.UserMessage(role="user", content=result.text or None, tool_calls=calls)
        )
        failed = 0
        # The calls of this message, and the text beside them, are one message of the transcript.
        context = dataclasses.replace(
            self.context, turn=self.call_messages, message=result.text or None
        )
        self.call_messages += 1
        for call, failure in zip(calls, parsed):
            outcome = (
                None
                if failure is not None
                else await self.users.toolbox.call(call.name, call.arguments, context)
            )
            if outcome is None:
                outcome = ToolResult(error=failure)
            failed += outcome.error is not None
            self.state.messages.append(
                tau2.message.ToolMessage(
                    id=call.id,
                    role="tool",
                    requestor="user",
                    error=outcome.error is not None,
                    content=outcome.observation,
                )
            )
        return failed
