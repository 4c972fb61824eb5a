"""The systems an evaluation compares. Each is an :class:`Agent`: one episode of a task at a
seed, returned as a :class:`~nemo_orch.rollout.episode.Trajectory` whose ledger prices every
token and call, so all systems are scored and reported the same way.

* ``orchestrator``: the policy of ``rollout.*`` (a checkpoint or HF directory on the CPU engine,
  or any OpenAI-compatible endpoint) through the episode runner, as in training.
* ``fixed:cheapest``, ``fixed:strongest``, ``random``: hand every task to one model of the
  expert tool: its cheapest, its most expensive (the "always the frontier model" baseline), or
  one drawn per task; then answer with the expert's reply. Routers are rules, not models: their
  own turns cost nothing.
* ``monolith``: one chat model with the basic tools (:class:`~nemo_orch.eval.chat_agent.ChatAgent`).
* ``gold-replay``: the task's gold actions, each by its requestor, then every fact the user must
  be told. It checks tools and scorer, not a model: every task should pass.
"""

from __future__ import annotations

import dataclasses
import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from nemo_orch.config import ConfigError, RolloutConfig
from nemo_orch.envs.offline.world import EXPERT_TOOL, RouterReplies
from nemo_orch.data.tasks import Task
from nemo_orch.envs.interfaces import GoldPlan
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.rollout.episode import (CallRecord, Episode, Trajectory, TurnRecord,
                                       episode_id)
from nemo_orch.rollout.runner import DirectPolicy, GenerationBatcher
from nemo_orch.tools.base import ToolContext
from nemo_orch.tools.registry import Toolbox

ORCHESTRATOR, MONOLITH, GOLD_REPLAY = "orchestrator", "monolith", "gold-replay"
ROUTERS = ("fixed:cheapest", "fixed:strongest", "random")
AGENT_KINDS = (ORCHESTRATOR, MONOLITH, *ROUTERS, GOLD_REPLAY)


class Agent(Protocol):
    async def episode(self, task: Task, seed: int) -> Trajectory: ...


class PolicyAgent:
    """The policy through the episode runner; concurrent episodes share ``batcher``, so their
    prompts are generated in batches."""

    def __init__(self, batcher: GenerationBatcher, toolbox: Toolbox,
                 tokenizer: PreTrainedTokenizerBase, settings: RolloutConfig) -> None:
        self.batcher, self.toolbox, self.tokenizer, self.settings = (batcher, toolbox, tokenizer,
                                                                     settings)

    async def episode(self, task: Task, seed: int) -> Trajectory:
        return await Episode(task, 0, self.batcher, self.toolbox, self.tokenizer, self.settings,
                             seed=seed).run()


def expert_prices(toolbox: Toolbox) -> dict[str, float]:
    """The expert tool's models by output-token price (USD per token), which ranks them."""
    expert = toolbox.tools.get(EXPERT_TOOL)
    pricing = getattr(expert, "pricing", None)
    if not pricing:
        raise ConfigError(f"the fixed routers hand tasks to the models of the tool "
                          f"{EXPERT_TOOL!r}, which these tools lack (tools: "
                          f"{', '.join(toolbox.tools)})")
    return {alias: price.per_output_token for alias, price in pricing.items()}


def choose_expert(kind: str, prices: dict[str, float], task: Task, seed: int) -> str:
    """The model the router ``kind`` hands ``task`` to; ties go to the first alias declared."""
    if kind == "fixed:cheapest":
        return min(prices, key=prices.__getitem__)
    if kind == "fixed:strongest":
        return max(prices, key=prices.__getitem__)
    # Drawn from the seed and the task alone: the same for a task however the run is split.
    return random.Random(zlib.crc32(f"{seed}|{task.id}".encode())).choice(sorted(prices))


class RouterAgent:
    """A fixed router (``kind`` of :data:`ROUTERS`) played by a scripted engine through the
    episode runner, with the orchestrator's own tokens free."""

    def __init__(self, kind: str, toolbox: Toolbox, tokenizer: PreTrainedTokenizerBase,
                 settings: RolloutConfig) -> None:
        self.kind, self.toolbox, self.tokenizer = kind, toolbox, tokenizer
        self.prices = expert_prices(toolbox)
        # A rule's replies are neither priced nor cut by the policy's per-turn token limit.
        self.settings = dataclasses.replace(settings, input_usd_per_million=0.0,
                                            output_usd_per_million=0.0,
                                            max_new_tokens=settings.max_context_tokens)
        required = toolbox.tools[EXPERT_TOOL].spec.parameters.get("required", [])
        self.asks_question = "question" in required

    async def episode(self, task: Task, seed: int) -> Trajectory:
        arguments: dict[str, Any] = {"model": choose_expert(self.kind, self.prices, task, seed)}
        if self.asks_question:
            arguments["question"] = task.question
        replies = RouterReplies(((EXPERT_TOOL, arguments),))
        policy = DirectPolicy(ScriptedEngine(self.tokenizer, replies))
        return await Episode(task, 0, policy, self.toolbox, self.tokenizer, self.settings,
                             seed=seed).run()


class GoldReplayAgent:
    """Each gold action through the toolbox of its requestor (``user_toolbox`` for tau2's
    user-side tools), one turn each, then the closing message."""

    def __init__(self, plan: Callable[[Task], GoldPlan], toolbox: Toolbox,
                 user_toolbox: Toolbox | None = None) -> None:
        self.plan, self.toolbox, self.user_toolbox = plan, toolbox, user_toolbox

    async def episode(self, task: Task, seed: int) -> Trajectory:
        started = time.perf_counter()
        plan = self.plan(task)
        context = ToolContext(task_id=task.id, episode_id=episode_id(task.id), seed=seed,
                              task=task)
        turns = []
        for index, action in enumerate(plan.actions):
            toolbox = self.toolbox if action.requestor == "assistant" else self.user_toolbox
            if toolbox is None:
                raise ConfigError(f"task {task.id}: a gold action of the {action.requestor} "
                                  "but no toolbox for it")
            result = await toolbox.call(action.name, action.arguments, context)
            turns.append(TurnRecord(index, 0, 0, 0.0, 0.0, "stop", calls=[CallRecord(
                action.name, action.arguments, result.cost_usd, result.latency_s, result.cached,
                result.error, result.usage.input_tokens, result.usage.output_tokens)]))
        turns.append(TurnRecord(len(turns), 0, 0, 0.0, 0.0, "stop"))
        messages = [{"role": "user", "content": task.question},
                    {"role": "assistant", "content": plan.final_message}]
        return Trajectory.without_tokens(task.id, messages, [], turns, "answer",
                                         plan.final_message, time.perf_counter() - started)
