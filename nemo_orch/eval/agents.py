"""The systems an evaluation compares. Each is an :class:`Agent`: one episode of a task at a
seed, returned as a :class:`~nemo_orch.rollout.trajectory.Trajectory` whose ledger prices every
token and call, so all systems are scored and reported the same way.

* ``orchestrator``: the policy of ``rollout.*`` (a checkpoint or HF directory on the CPU engine,
  or any OpenAI-compatible endpoint) through the episode runner, as in training.
* ``fixed:cheapest``, ``fixed:strongest``, ``random``: hand every task to one model of the
  expert tool: its cheapest, its most expensive (the "always the frontier model" baseline), or
  one drawn per task; then answer with the expert's reply. On ToolOrchestra's interface they
  call the tools the environment routes the task through
  (:meth:`~nemo_orch.envs.Environment.routed_tools`: ``answer`` alone, or the offline world's
  family's tools). Routers are rules, not models: their own turns cost nothing.
* ``monolith``: one chat model with the basic tools (:class:`~nemo_orch.eval.chat_agent.ChatAgent`).
* ``gold-replay``: the task's gold actions, each by its requestor, then every fact the user must
  be told. It checks tools and scorer, not a model: every task should pass. An action that
  fails (any call kind but ``ok``) makes its episode ``gold_error``: counted and listed by the
  report, left out of accuracy, never a demonstration.
* an environment's own baselines (:attr:`~nemo_orch.envs.Environment.baselines`, built by
  :meth:`~nemo_orch.envs.Environment.baseline`), such as the offline world's
  ``naive-routers``.
"""

from __future__ import annotations

import dataclasses
import random
import time
import zlib
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_orch.config import ConfigError, RolloutConfig
from nemo_orch.data.tasks import Task
from nemo_orch.envs.interfaces import GoldPlan
from nemo_orch.rollout.conversation import UserFactory
from nemo_orch.rollout.engines.scripted import RouterReplies, ScriptedEngine, scripted_settings
from nemo_orch.rollout.episode import Episode
from nemo_orch.rollout.format import call_text
from nemo_orch.rollout.opening import episode_id
from nemo_orch.rollout.runner import DirectPolicy, GenerationBatcher
from nemo_orch.rollout.trajectory import CallRecord, Termination, Trajectory, TurnRecord
from nemo_orch.tools.base import ToolContext
from nemo_orch.tools.interfaces import EXPERT_TOOL, ORCHESTRA_TOOLS, offers_orchestra
from nemo_orch.tools.registry import Toolbox


class PolicyAgent:
    """The policy through the episode runner; concurrent episodes share ``batcher``, so their
    prompts are generated in batches. ``users``: the environment's user, where one answers."""

    def __init__(
        self,
        batcher: GenerationBatcher,
        toolbox: Toolbox,
        tokenizer: PreTrainedTokenizerBase,
        settings: RolloutConfig,
        users: UserFactory | None = None,
    ) -> None:
        self.batcher, self.toolbox, self.tokenizer, self.settings = (
            batcher,
            toolbox,
            tokenizer,
            settings,
        )
        self.users = users

    async def episode(self, task: Task, sample: int, seed: int) -> Trajectory:
        return await Episode(
            task,
            sample,
            self.batcher,
            self.toolbox,
            self.tokenizer,
            self.settings,
            seed=seed,
            users=self.users,
        ).run()


def expert_prices(toolbox: Toolbox) -> dict[str, dict[str, float]]:
    """The models a fixed router chooses from, by tool, each by its output-token price (USD per
    token, which ranks them): on ToolOrchestra's interface, the aliases of ``search``,
    ``enhance_reasoning`` and ``answer`` (simulated experts or served ones alike); else the
    expert tool's."""
    tools = ORCHESTRA_TOOLS if offers_orchestra(toolbox.tools) else (EXPERT_TOOL,)
    pricing = {tool: getattr(toolbox.tools.get(tool), "pricing", None) for tool in tools}
    if not all(pricing.values()):
        raise ConfigError(
            f"the fixed routers hand tasks to the models of the tool "
            f"{EXPERT_TOOL!r} or of the answer tool, which these tools lack "
            f"(tools: {', '.join(toolbox.tools)})"
        )
    return {
        tool: {alias: price.per_output_token for alias, price in models.items()}
        for tool, models in pricing.items()
    }


def choose_expert(
    kind: str, prices: dict[str, float], task: Task, seed: int, tool: str = ""
) -> str:
    """The model the router ``kind`` chooses for ``task`` among ``prices`` (one tool's
    models); ties go to the first alias declared."""
    if kind == "fixed:cheapest":
        return min(prices, key=prices.__getitem__)
    if kind == "fixed:strongest":
        return max(prices, key=prices.__getitem__)
    # Drawn from the seed and the task alone: the same for a task however the run is split.
    return random.Random(zlib.crc32(f"{seed}|{task.id}{tool}".encode())).choice(sorted(prices))


class RouterAgent:
    """A fixed router (``kind`` of :data:`ROUTERS`) played by a scripted engine through the
    episode runner, with the orchestrator's own tokens free. It hands the task to one model of
    the expert tool; on ToolOrchestra's interface it calls the tools ``routed_tools`` names for
    the task (the environment's :meth:`~nemo_orch.envs.Environment.routed_tools`), choosing
    the model of each."""

    def __init__(
        self,
        kind: str,
        toolbox: Toolbox,
        tokenizer: PreTrainedTokenizerBase,
        settings: RolloutConfig,
        routed_tools: Callable[[Task], tuple[str, ...]],
    ) -> None:
        self.kind, self.toolbox, self.tokenizer = kind, toolbox, tokenizer
        self.routed_tools = routed_tools
        self.prices = expert_prices(toolbox)
        self.settings = scripted_settings(settings)
        required = toolbox.tools[next(iter(self.prices))].spec.parameters.get("required", [])
        self.asks_question = "question" in required

    def route(self, task: Task, seed: int) -> tuple[tuple[str, dict[str, Any]], ...]:
        tools = (EXPERT_TOOL,) if EXPERT_TOOL in self.prices else self.routed_tools(task)
        calls = []
        for tool in tools:
            arguments: dict[str, Any] = {
                "model": choose_expert(self.kind, self.prices[tool], task, seed, tool)
            }
            if self.asks_question:
                arguments["question"] = task.question
            calls.append((tool, arguments))
        return tuple(calls)

    async def episode(self, task: Task, sample: int, seed: int) -> Trajectory:
        replies = RouterReplies(self.route(task, seed))
        policy = DirectPolicy(ScriptedEngine(self.tokenizer, replies))
        return await Episode(
            task, sample, policy, self.toolbox, self.tokenizer, self.settings, seed=seed
        ).run()


class GoldReplayAgent:
    """Each gold action through the toolbox of its requestor (``user_toolbox`` for tau2's
    user-side tools), one turn each, then the closing message. Its messages are the
    conversation an assistant would have had (each of its calls as the policy writes one, the
    tool's output, then the closing message as the answer), so its correct episodes can be SFT
    demonstrations; the user's own actions are not the assistant's to write, and stay out.
    Every action runs; one that fails ends the episode as ``gold_error`` (the gold plan and
    the tools disagree: nothing to score or to learn from)."""

    def __init__(
        self,
        plan: Callable[[Task], GoldPlan],
        toolbox: Toolbox,
        user_toolbox: Toolbox | None = None,
    ) -> None:
        self.plan, self.toolbox, self.user_toolbox = plan, toolbox, user_toolbox

    async def episode(self, task: Task, sample: int, seed: int) -> Trajectory:
        started = time.perf_counter()
        plan = self.plan(task)
        context = ToolContext(
            task_id=task.id, episode_id=episode_id(task.id, sample), seed=seed, task=task
        )
        turns = []
        messages = ([{"role": "system", "content": task.system}] if task.system else []) + [
            {"role": "user", "content": task.question}
        ]
        for index, action in enumerate(plan.actions):
            toolbox = self.toolbox if action.requestor == "assistant" else self.user_toolbox
            if toolbox is None:
                raise ConfigError(
                    f"task {task.id}: a gold action of the {action.requestor} but no toolbox for it"
                )
            # One action per message, as the episode runner's turns.
            result = await toolbox.call(
                action.name, action.arguments, dataclasses.replace(context, turn=index)
            )
            turns.append(
                TurnRecord(
                    turn=index,
                    input_tokens=0,
                    output_tokens=0,
                    generation_seconds=0.0,
                    orchestrator_cost_usd=0.0,
                    finish_reason="stop",
                    calls=[CallRecord.of(action.name, action.arguments, result)],
                )
            )
            if action.requestor == "assistant":
                messages += [
                    {"role": "assistant", "content": call_text((action.name, action.arguments))},
                    {"role": "tool", "content": result.observation},
                ]
        turns.append(
            TurnRecord(
                turn=len(turns),
                input_tokens=0,
                output_tokens=0,
                generation_seconds=0.0,
                orchestrator_cost_usd=0.0,
                finish_reason="stop",
            )
        )
        messages.append({"role": "assistant", "content": f"<answer>{plan.final_message}</answer>"})
        offered = self.toolbox if task.tools is None else self.toolbox.subset(task.tools)
        failed = any(call.error is not None for turn in turns for call in turn.calls)
        return Trajectory.without_tokens(
            task_id=task.id,
            sample=sample,
            seed=seed,
            messages=messages,
            tools=offered.schemas(),
            turns=turns,
            termination=Termination.GOLD_ERROR if failed else Termination.ANSWER,
            answer=plan.final_message,
            wall_seconds=time.perf_counter() - started,
        )
