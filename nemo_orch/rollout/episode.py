"""One episode: the policy and the tools take turns until an answer, a limit or a failure.

An episode can have a user (tau2's customer, :class:`~nemo_orch.rollout.conversation.User`): then the conversation opens with
the agent's greeting and the user's first message, every policy message without a tool call
goes to the user, and the user's reply is the next observation, until the user stops or tau2's
step and error limits end it, exactly as tau2's orchestrator runs its ``LLMAgent`` (whose
messages, ``###STOP###`` included, all go to the user). Such an episode is bounded by tau2's
limits and the policy's context alone: ``rollout.max_turns``, ``max_new_tokens`` and
``max_observation_tokens`` (limits tau2 does not have) do not apply.

The token-level history is the record: the prompt and every observation are appended as
template tokens (loss mask 0), every sampled token as a policy token (loss mask 1, with the
engine's logprob). Earlier turns are never re-tokenized, so what the trainer scores is exactly what
the engine sampled. Observations are cut from the chat template's own rendering, so the kept
tokens decode to the template's rendering of the conversation (checked every turn when
``check_template`` is on).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time
from collections.abc import Sequence
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from nemo_orch.clients import call_store
from nemo_orch.clients.openai import EndpointRefusal
from nemo_orch.config import RolloutConfig
from nemo_orch.data.tasks import Task
from nemo_orch.models.tokenizer import control_strings, escape_markup
from nemo_orch.rollout import journal
from nemo_orch.rollout.conversation import Conversation, UserFactory
from nemo_orch.rollout.engines.base import Generation, SamplingParams
from nemo_orch.rollout.format import (
    Choice,
    ParsedTurn,
    ToolCall,
    TurnFormat,
    call_text,
    choice_of,
    choices,
    decision_end,
    parse_turn,
    text_beside_calls,
    without_thinking,
)
from nemo_orch.rollout.opening import episode_id, initial_messages, task_budget
from nemo_orch.rollout.trajectory import (
    CallRecord,
    RolloutError,
    Termination,
    TokenHistory,
    Trajectory,
    TurnRecord,
    UserUsage,
)
from nemo_orch.seeding import derive_seed
from nemo_orch.tools.base import Pricing, ToolContext, ToolResult
from nemo_orch.tools.registry import Toolbox

# No token of a byte-level BPE vocabulary spans more characters than this (a long run of
# spaces is the longest in practice): the prefix of an observation that can hold its kept tokens.
_MAX_CHARS_PER_TOKEN = 64


class PolicyClient(Protocol):
    # The weights' version the next turns are generated with (None: not versioned).
    version: int | None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...


class Episode:
    """Runs one task once under ``rollout.*`` settings (limits, sampling, answer format,
    the orchestrator's price). Build one per (task, sample) and ``await episode.run()``.

    Turn ``t`` samples with the seed ``derive_seed(seed, "turn", t)``, carried with its prompt
    into the engine: an episode's tokens depend on its seed alone, not on the episodes batched
    with it, the worker that ran it or the order they finished in.

    ``forced_choice`` (directed exploration) makes the first turn start with the decision
    tokens of a call of that choice; the policy writes the rest (its arguments). With chance
    ``explore_models`` any other turn whose first call has a choice argument (an expert model)
    is written again from a call of the same tool with another value of it, drawn uniformly.
    Forced tokens are policy tokens with logprob 0, marked in ``forced_mask``: not sampled.

    ``users`` (tau2's customer) makes it a conversation: see the module docstring."""

    def __init__(
        self,
        task: Task,
        sample: int,
        policy: PolicyClient,
        toolbox: Toolbox,
        tokenizer: PreTrainedTokenizerBase,
        settings: RolloutConfig,
        seed: int = 0,
        forced_choice: Choice | None = None,
        explore_models: float = 0.0,
        users: UserFactory | None = None,
    ) -> None:
        if settings.max_context_tokens is None:
            raise RolloutError(
                "rollout.max_context_tokens must be resolved (see Config.resolved_rollout)"
            )
        self.task, self.sample, self.policy, self.settings = task, sample, policy, settings
        self.orchestrator_pricing = Pricing.per_million_tokens(
            settings.input_usd_per_million, settings.output_usd_per_million
        )
        self.tokenizer = tokenizer
        # The tools on offer now, for the whole episode (a tool source may change its list
        # meanwhile: see Toolbox.refresh).
        self.toolbox = toolbox.subset(toolbox.tools if task.tools is None else task.tools)
        self.offer(self.toolbox.schemas())
        self.context = ToolContext(
            task_id=task.id,
            episode_id=episode_id(task.id, sample),
            allowed_documents=task.allowed_documents,
            seed=seed,
            task=task,
        )
        self.eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        self.forced_ids = [] if forced_choice is None else self._decision_prefix(forced_choice)
        self.explore_models = explore_models
        self.user = None if users is None else users(task, self.context)
        self.messages = initial_messages(
            task, tokenizer, None if self.user is None else self.user.greeting
        )
        # A conversation is bounded by tau2's limits and the context alone (module docstring).
        unbounded = self.user is not None
        self.max_turns = None if unbounded else settings.max_turns
        self.max_new_tokens = settings.max_context_tokens if unbounded else settings.max_new_tokens
        self.max_observation_tokens = (
            settings.max_context_tokens if unbounded else settings.max_observation_tokens
        )

    def offer(self, schemas: list[dict[str, Any]]) -> None:
        """The tools the policy is offered, and reads its turns against: the toolbox's, or what
        an external agent loop offers instead (:mod:`nemo_orch.rollout.external`)."""
        self.schemas = schemas
        self.format = TurnFormat.for_tools(
            schemas,
            answer_format=self.settings.answer_format,
            multiple_calls=self.settings.multiple_calls,
            lenient=self.toolbox.lenient(),
        )

    # ------------------------------------------------------------------ rendering
    def render(self, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            self.messages,
            tools=self.schemas or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _check_agreement(self, history: TokenHistory) -> None:
        """The kept tokens must decode to the template's rendering of the messages so far, and
        hold each control string (:func:`control_strings`) exactly as often as the template
        writes it: as often as in its rendering with every content but the assistant's (the
        policy's own turns, the fixed greeting) blanked out. Equal text alone would let an
        observation's unescaped ``<|im_start|>`` through: the rendering carries it too."""
        if not self.settings.check_template:
            return
        # After an assistant turn the kept tokens end at its eos; the template adds a newline
        # only before the next turn.
        after_turn = self.messages[-1]["role"] == "assistant"
        kept = self.tokenizer.decode(history.ids, skip_special_tokens=False) + "\n" * after_turn
        rendered = self.render(generation_prompt=not after_turn)
        if kept != rendered:
            at = next(
                (i for i, (a, b) in enumerate(zip(kept, rendered)) if a != b),
                min(len(kept), len(rendered)),
            )
            raise RolloutError(
                f"episode {self.context.episode_id}: kept tokens and the chat "
                f"template disagree at character {at}: "
                f"{kept[at : at + 40]!r} vs {rendered[at : at + 40]!r}"
            )
        blanked = [
            message if message["role"] == "assistant" else {**message, "content": ""}
            for message in self.messages
        ]
        written = self.tokenizer.apply_chat_template(
            blanked,
            tools=self.schemas or None,
            tokenize=False,
            add_generation_prompt=not after_turn,
        )
        for string in control_strings(self.tokenizer):
            if (found := kept.count(string)) != (expected := written.count(string)):
                raise RolloutError(
                    f"episode {self.context.episode_id}: {string!r} occurs "
                    f"{found} times in the kept tokens but {expected} in the "
                    f"chat template's own rendering: markup from an observation "
                    f"or the task was not escaped"
                )

    def _truncate_observation(self, text: str) -> str:
        """At most ``max_observation_tokens`` of a tool's output (in a conversation: what the
        context holds). Only a prefix long enough to hold them is tokenized: a tool that returns
        megabytes must not stall the event loop every episode shares."""
        limit = self.max_observation_tokens
        head = text[: limit * _MAX_CHARS_PER_TOKEN]
        ids = self.encode(head)
        if len(ids) <= limit and len(head) == len(text):
            return text
        return (
            self.tokenizer.decode(ids[:limit])
            + f"\n[observation truncated: {len(text)} characters, showing {limit} tokens]"
        )

    # ------------------------------------------------------------------ the loop
    async def run(self) -> Trajectory:
        with call_store.episode_scope(self.scope_name):
            return await self._run()

    @property
    def scope_name(self) -> str:
        """What makes its calls through a call store or journal its own
        (:mod:`nemo_orch.rollout.journal`): its id and seed, and the weights' version, since on
        other weights (a later step's validation of the same tasks) it is another episode."""
        return f"{self.context.episode_id}@{self.context.seed}/v{self.policy.version}"

    async def _run(self) -> Trajectory:
        started = time.perf_counter()
        conversation = None if self.user is None else Conversation(self.user)
        ended = None
        if conversation is not None:  # the user answers the greeting: the prompt's last message
            opening, ended = await conversation.tell(self.user.greeting)
            if ended is None:
                self.messages.append({"role": "user", "content": self.observation(opening)})
        history = TokenHistory(self.encode(self.render(generation_prompt=True)))
        turns: list[TurnRecord] = []
        termination, answer = ended or Termination.MAX_TURNS, None
        turn_indices = itertools.count() if self.max_turns is None else range(self.max_turns)
        for turn_index in turn_indices if ended is None else ():
            turn = await self.policy_turn(history, turn_index, turns)
            if isinstance(turn, Termination):
                termination = turn
                break
            record, text, parsed = turn
            message = None if conversation is None else self._message_to_user(text, parsed)
            if message is not None:
                record.format_errors = []  # a message to the user is no missing call
                answer = message
                ended = await self._talk(history, conversation, record, message)
                if ended is not None:
                    termination = ended
                    break
                continue
            if parsed.answer is not None:
                termination, answer = Termination.ANSWER, parsed.answer
                break
            results = await self.run_calls(parsed, record, text)
            final = next((r.answer for r in results if r.answer is not None), None)
            if final is not None:
                termination, answer = Termination.ANSWER, final
                break
            # Past the task's budget once the turn's calls (all of them) are paid: nothing more
            # runs, and the reward scores the episode over budget.
            budget = task_budget(self.task)
            if budget is not None and sum(turn.cost_usd for turn in turns) > budget:
                termination = Termination.BUDGET
                break
            if conversation is not None and (ended := conversation.agent_turn(record)):
                termination = ended
                break
            if not self._add_observations(history, parsed, results):
                termination = Termination.CONTEXT_LIMIT
                break
        if turns:  # a conversation the user ended at its opening has only the prompt
            self._check_agreement(history)
        return self.trajectory(
            history,
            turns,
            termination,
            answer,
            time.perf_counter() - started,
            None if conversation is None else conversation.usage,
        )

    def trajectory(
        self,
        history: TokenHistory,
        turns: list[TurnRecord],
        termination: Termination,
        answer: str | None,
        wall_seconds: float,
        user: UserUsage | None = None,
        **agent: Any,
    ) -> Trajectory:
        """The finished episode's record (``agent``: what an external agent loop reported)."""
        return Trajectory(
            task_id=self.task.id,
            sample=self.sample,
            messages=self.messages,
            tools=self.schemas,
            token_ids=history.ids,
            loss_mask=history.mask,
            decision_mask=history.decisions,
            logprobs=history.logprobs,
            prompt_length=history.prompt_length,
            turns=turns,
            termination=termination,
            answer=answer,
            wall_seconds=wall_seconds,
            user=user,
            seed=self.context.seed,
            tool_sources=self.toolbox.source_of,
            forced_mask=history.forced,
            **agent,
        )

    async def policy_turn(
        self, history: TokenHistory, turn_index: int, turns: list[TurnRecord]
    ) -> tuple[TurnRecord, str, ParsedTurn] | Termination:
        """The policy's turn ``turn_index``: sampled after ``history`` (which it extends), its
        record appended to ``turns``; its record, text and parse, or what ended the episode
        instead (no room left, an engine failure: its record says how)."""
        room = self.settings.max_context_tokens - len(history.ids)
        if room < 2:  # nothing useful fits: at least one token and the closing eos
            return Termination.CONTEXT_LIMIT
        forced = self.forced_ids if turn_index == 0 else []
        params = SamplingParams(
            max_new_tokens=max(1, min(self.max_new_tokens, room - 1)),
            temperature=self.settings.temperature,
            top_p=self.settings.top_p,
            top_k=self.settings.top_k,
            stop_token_ids=(self.eos_id,),
            seed=derive_seed(self.context.seed, "turn", turn_index),
        )
        generation_start = time.perf_counter()
        try:
            generation = await self._generate(history, forced, params)
            if not forced and (redrawn := self._redrawn_choice(generation, turn_index)):
                forced = self._decision_prefix(redrawn)
                generation = await self._generate(history, forced, params)
        except EndpointRefusal:
            raise  # the policy's endpoint refuses what it is asked: no episode can run
        except Exception as error:  # an engine failure ends this episode, not the batch
            turns.append(
                TurnRecord(
                    turn=turn_index,
                    input_tokens=len(history.ids),
                    output_tokens=0,
                    generation_seconds=0.0,
                    orchestrator_cost_usd=0.0,
                    finish_reason=f"error: {type(error).__name__}: {error}",
                )
            )
            return Termination.ENGINE_ERROR
        record = self._turn_record(
            turn_index,
            len(history.ids),
            generation,
            self._turn_seconds(generation, generation_start),
        )
        turns.append(record)
        turn_start = len(history.ids)
        text = self._add_generation(history, generation, len(forced))
        parsed = parse_turn(text, self.format)
        record.format_errors = list(parsed.format_errors)
        history.mark_decision(
            turn_start,
            self._decision_tokens(
                history.ids[turn_start:], text, decision_end(text, parsed, self.format)
            ),
        )
        return record, text, parsed

    async def _talk(
        self, history: TokenHistory, conversation: Conversation, record: TurnRecord, message: str
    ) -> Termination | None:
        """Send the turn's ``message`` to the user and append the reply as the next
        observation; what ended the conversation, if anything."""
        ended = conversation.agent_turn(record)
        if ended is None:
            reply, ended = await conversation.tell(message)
        if ended is None and not self.append_messages(
            history, [{"role": "user", "content": self.observation(reply)}]
        ):
            return Termination.CONTEXT_LIMIT
        return ended

    @staticmethod
    def _message_to_user(text: str, parsed: ParsedTurn) -> str | None:
        """What a turn says to the user: an ``<answer>``'s text, or the text of a turn with no
        call, thinking removed and otherwise as written (tau2 passes the agent's message on
        unchanged); None for a call, or a turn that says nothing."""
        if parsed.calls:
            return None
        if parsed.answer is not None:
            return parsed.answer
        message = without_thinking(text)
        return message if parsed.format_errors == ["no_call"] and message.strip() else None

    def _decision_prefix(self, choice: Choice) -> list[int]:
        """The decision tokens of the canonical call of ``choice``, cut at a token boundary of
        its own tokenization (so the policy continues as from a sampled prefix)."""
        text = call_text(choice)
        ids = self.encode(text)
        # Read as the valid call it starts (its other arguments are the policy's to write).
        end = decision_end(text, ParsedTurn(calls=[ToolCall(*choice)]), self.format)
        return ids[: self._decision_tokens(ids, text, end)]

    def _decision_tokens(self, turn_ids: list[int], text: str, end: int) -> int:
        """How many of the turn's tokens it takes to write its first ``end`` characters (all of
        them, the closing eos included, when the decision is the whole turn)."""
        if end >= len(text):
            return len(turn_ids)
        for count in range(1, len(turn_ids) + 1):
            if len(self.tokenizer.decode(turn_ids[:count], skip_special_tokens=False)) >= end:
                return count
        return len(turn_ids)

    def _turn_seconds(self, generation: Generation, started: float) -> float:
        """The turn's generation time: measured since ``started``, or under modeled time
        (``tools.timing=modeled``) its tokens at ``rollout.tokens_per_second``."""
        if self.toolbox.modeled_time:
            return len(generation.token_ids) / self.settings.tokens_per_second
        return time.perf_counter() - started

    def _turn_record(
        self, turn: int, context_tokens: int, generation: Generation, seconds: float
    ) -> TurnRecord:
        pricing = self.orchestrator_pricing
        cost = pricing.per_input_token * context_tokens + pricing.per_output_token * len(
            generation.token_ids
        )
        return TurnRecord(
            turn=turn,
            input_tokens=context_tokens,
            output_tokens=len(generation.token_ids),
            generation_seconds=seconds,
            orchestrator_cost_usd=cost,
            finish_reason=generation.finish_reason,
            policy_version=generation.policy_version,
        )

    async def _generate(
        self, history: TokenHistory, forced: list[int], params: SamplingParams
    ) -> Generation:
        """The turn's tokens: ``forced`` (logprob 0), then what the policy samples after them."""
        params = dataclasses.replace(
            params, max_new_tokens=max(1, params.max_new_tokens - len(forced))
        )
        prompt = history.ids + forced
        generation = await journal.generate(
            prompt, params, self.policy.version, lambda: self.policy.generate(prompt, params)
        )
        if not forced:
            return generation
        return dataclasses.replace(
            generation,
            token_ids=forced + list(generation.token_ids),
            logprobs=[0.0] * len(forced) + list(generation.logprobs),
        )

    def _redrawn_choice(self, generation: Generation, turn_index: int) -> Choice | None:
        """With chance ``explore_models``, the turn's first call with another value of its
        choice argument (None: the turn stands). One draw per (episode seed, turn)."""
        if not self.explore_models:
            return None
        rng = random.Random(derive_seed(self.context.seed, "explore_models", turn_index))
        if rng.random() >= self.explore_models:
            return None
        text = self._turn_text(generation.token_ids)
        call = next((call for call in parse_turn(text, self.format).calls if call.valid), None)
        if call is None:
            return None
        name, chosen = choice_of(call.name, call.arguments, self.format)
        others = [
            (tool, arguments)
            for tool, arguments in choices(self.format)
            if tool == name and arguments != chosen
        ]
        return rng.choice(others) if chosen and others else None

    def _turn_text(self, ids: Sequence[int]) -> str:
        """What a turn's tokens say, its closing eos left out."""
        ids = list(ids)
        return self.tokenizer.decode(
            ids[:-1] if ids and ids[-1] == self.eos_id else ids, skip_special_tokens=False
        )

    def _add_generation(
        self, history: TokenHistory, generation: Generation, forced: int = 0
    ) -> str:
        """Append the turn's tokens, the first ``forced`` of them exploration's (closing the
        turn with a template eos if the engine hit its length limit) and the assistant
        message; returns the turn's text."""
        ids = list(generation.token_ids)
        history.add_policy(ids, list(generation.logprobs), forced)
        if not ids or ids[-1] != self.eos_id:
            history.add_template([self.eos_id])
        text = self._turn_text(ids)
        self.messages.append({"role": "assistant", "content": text})
        return text

    async def run_calls(
        self, parsed: ParsedTurn, record: TurnRecord, text: str
    ) -> list[ToolResult]:
        valid = [call for call in parsed.calls if call.valid]
        context = dataclasses.replace(
            self.context,
            observations=tuple(
                message["content"] for message in self.messages if message["role"] == "tool"
            ),
            turn=record.turn,
            message=text_beside_calls(text),
        )
        results = await asyncio.gather(
            *(self.toolbox.call(call.name, call.arguments, context) for call in valid)
        )
        by_call = iter(results)
        for call in parsed.calls:
            if not call.valid:
                record.calls.append(
                    CallRecord(tool=call.name, arguments=call.arguments, error=call.error)
                )
                continue
            record.calls.append(CallRecord.of(call.name, call.arguments, next(by_call)))
        return list(results)

    def observation(self, text: str) -> str:
        return self._truncate_observation(escape_markup(text, self.tokenizer))

    def _add_observations(
        self, history: TokenHistory, parsed: ParsedTurn, results: list[ToolResult]
    ) -> bool:
        """One tool message per call (its output or its error), then the turn-level format
        error if any (see :meth:`_append_messages`)."""
        by_call = iter(results)
        observations = [
            next(by_call).observation if call.valid else f"Error: {call.error}"
            for call in parsed.calls
        ]
        if parsed.error is not None:
            observations.append(f"Error: {parsed.error}")
        return self.append_messages(
            history,
            [
                {"role": "tool", "content": self.observation(observation)}
                for observation in observations
            ],
        )

    def append_messages(self, history: TokenHistory, messages: list[dict[str, Any]]) -> bool:
        """Append observations (tool outputs, the user's reply) after the assistant's turn as
        template tokens cut from the template's own rendering. Returns False (appending
        nothing) when they would leave no room for another turn."""
        before = self.render(generation_prompt=False)
        self.messages.extend(messages)
        after = self.render(generation_prompt=True)
        # `before` ends with the "\n" that follows the assistant's eos; the kept tokens end at
        # the eos, so the delta starts with that newline.
        if not after.startswith(before) or not before.endswith("\n"):
            raise RolloutError(
                "the chat template does not render observations as an "
                "append-only continuation; they cannot be cut from it"
            )
        observation_ids = self.encode(after[len(before) - 1 :])
        if len(history.ids) + len(observation_ids) + 2 > self.settings.max_context_tokens:
            del self.messages[-len(messages) :]
            return False
        history.add_template(observation_ids)
        self._check_agreement(history)
        return True
