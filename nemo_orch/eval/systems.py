"""The systems an evaluation runs and the agents that play them: a :class:`System` (its name,
agent kind and, for an orchestrator, its policy's engine), what the agents of one evaluation
share (:class:`Resources`), the agent of each kind (:func:`build_agent`: the orchestrator, a
fixed router, gold replay, an environment's baseline, or the monolith behind an
OpenAI-compatible endpoint, the offline benchmark's simulated one included) and the oracle that
judges a routing agent's preference adherence (:func:`preference_oracle`). The harness
(:mod:`nemo_orch.eval.harness`) runs them on an environment's tasks, caches and reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nemo_orch.config import GOLD_REPLAY, ORCHESTRATOR, ROUTERS, Config, ConfigError
from nemo_orch.data.tasks import Task
from nemo_orch.envs import Environment
from nemo_orch.envs.interfaces import Agent, Oracle
from nemo_orch.eval.agents import GoldReplayAgent, PolicyAgent, RouterAgent
from nemo_orch.rollout.builders import build_toolbox, rollout_settings
from nemo_orch.tools.interfaces import offers_orchestra
from nemo_orch.tools.registry import Toolbox


@dataclass(frozen=True)
class System:
    """A system to evaluate: its name in the report, its agent kind
    (:data:`~nemo_orch.config.AGENT_KINDS`) and, for an orchestrator, the engine that writes its
    turns (``nemo-orch eval``: the policy of ``rollout.*``; the main job: each trained policy's
    weights, in memory) and what identifies those weights in the cache's fingerprint
    (``weights``: e.g. the checkpoint they came from; ``rollout.policy`` is in it already)."""

    name: str
    kind: str
    engine: Any = None
    weights: str | None = None


@dataclass
class Resources:
    """What agents share across one evaluation: the environment and its test tasks, the
    policy's tokenizer (built once) and the seed."""

    config: Config
    benchmark: Environment
    tasks: list[Task]
    seed: int
    tokenizer: Any = None


def _tokenizer(resources: Resources) -> Any:
    """The policy's tokenizer: the one given, else ``tokenizer.path``, else the run's."""
    if resources.tokenizer is None:
        from nemo_orch.models.tokenizer import load_tokenizer

        config = resources.config
        directory = config.tokenizer_dir
        if not (directory / "tokenizer.json").is_file():
            raise ConfigError(
                f"no tokenizer at {directory}: the episode runner needs the "
                "policy's (set tokenizer.path, or run `make train` first)"
            )
        resources.tokenizer = load_tokenizer(directory)
    return resources.tokenizer


@contextlib.asynccontextmanager
async def build_agent(
    system: System, resources: Resources, toolbox: Toolbox
) -> AsyncIterator[Agent]:
    """The agent of ``system`` with ``toolbox``, for the evaluation ``resources`` describe,
    decoding at ``eval.temperature``; what it holds (a generation batcher, the monolith's
    client and tools) is closed on exit."""
    config, benchmark, kind = resources.config, resources.benchmark, system.kind
    # An orchestrator's context is its policy's (see rollout_settings).
    settings = dataclasses.replace(
        rollout_settings(config, system.engine), temperature=config.eval.temperature
    )
    if kind == ORCHESTRATOR:
        from nemo_orch.rollout.runner import GenerationBatcher

        batcher = GenerationBatcher(system.engine, settings.max_batch_size)
        try:
            yield PolicyAgent(batcher, toolbox, _tokenizer(resources), settings, benchmark.users())
        finally:
            await batcher.close()
    elif kind in ROUTERS:
        yield RouterAgent(kind, toolbox, _tokenizer(resources), settings, benchmark.routed_tools)
    elif kind == GOLD_REPLAY:
        yield GoldReplayAgent(benchmark.gold_plan, toolbox, benchmark.user_toolbox())
    elif kind in benchmark.baselines:
        yield benchmark.baseline(
            kind, resources.tasks, toolbox, _tokenizer(resources), settings, resources.seed
        )
    else:
        async with _monolith(config, resources, toolbox) as agent:
            yield agent


@contextlib.asynccontextmanager
async def _monolith(config: Config, resources: Resources, toolbox: Toolbox) -> AsyncIterator[Agent]:
    from nemo_orch.clients.openai import OpenAIClient
    from nemo_orch.eval.chat_agent import ChatAgent
    from nemo_orch.tools.base import Pricing, ToolError
    from nemo_orch.tools.pricing import model_pricing

    monolith = config.eval.monolith
    if monolith.usd_per_million is not None:
        pricing = Pricing.per_million_tokens(*monolith.usd_per_million)
    else:
        try:
            pricing = model_pricing(monolith.model, config.tools.prices)
        except ToolError:  # its remedy names a tool's option, not the monolith's
            raise ConfigError(
                f"eval.monolith.model={monolith.model} has no price in the price "
                "table: set eval.monolith.usd_per_million=[INPUT,OUTPUT] (USD per "
                "million tokens), or add the model to tools.prices"
            ) from None
    async with contextlib.AsyncExitStack() as stack:
        if monolith.tools is not None:
            tools = await stack.enter_async_context(
                build_toolbox(
                    dataclasses.replace(config.tools, declarations=list(monolith.tools), domains=[])
                )
            )
        else:
            # Tools a benchmark lacks (tau2 and toolscale have no experts) are simply not there.
            tools = toolbox.subset(
                [name for name in toolbox.tools if name not in monolith.drop_tools]
            )
        if offers_orchestra(tools.tools):
            raise ConfigError(
                "the monolith would get ToolOrchestra's composite tools, which "
                "hand the task to experts: give it basic tools with "
                "eval.monolith.tools (e.g. [tools/offline/search.yaml, "
                "tools/offline/python_sandbox.yaml])"
            )
        base_url = monolith.base_url
        if base_url is None:
            base_url = stack.enter_context(_simulated_monolith(config, resources, toolbox)).url
        client = OpenAIClient(
            base_url,
            monolith.model,
            dialect=monolith.dialect,
            name="eval.monolith",
            api_key_env=monolith.api_key_env,
            timeout_s=monolith.timeout_s,
            max_retries=monolith.max_retries,
            max_in_flight=config.eval.max_requests_per_endpoint,
        )
        stack.push_async_callback(client.aclose)
        yield ChatAgent(
            client,
            tools,
            pricing,
            max_turns=config.rollout.max_turns,
            max_tokens=monolith.max_tokens,
            temperature=monolith.temperature,
        )


def _simulated_monolith(config: Config, resources: Resources, toolbox: Toolbox) -> Any:
    """The offline benchmark's monolith: a SIMULATED frontier model (an alias of the simulated
    experts) served over real HTTP on 127.0.0.1 for this evaluation."""
    from nemo_orch.eval.simulated_chat import start_simulated_chat_server
    from nemo_orch.tools.simulated_expert import SimulatedExpert

    monolith = config.eval.monolith
    # The answering experts: the expert tool itself, or the part behind `answer`.
    expert = next(
        (
            tool
            for tool in [*toolbox.tools.values(), *toolbox.parts]
            if isinstance(tool, SimulatedExpert) and tool.writes == "answer"
        ),
        None,
    )
    if not resources.benchmark.simulated_monolith or expert is None:
        raise ConfigError(
            "eval.monolith.base_url is required: only the offline benchmark "
            "(with its simulated experts) has a simulated monolith"
        )
    if monolith.simulate not in expert.models:
        raise ConfigError(
            f"eval.monolith.simulate: no simulated expert {monolith.simulate!r} "
            f"(experts: {', '.join(expert.models)})"
        )
    return start_simulated_chat_server(
        resources.tasks,
        expert.models[monolith.simulate],
        monolith.model,
        time_scale=monolith.time_scale,
    )


def preference_oracle(
    kind: str, benchmark: Environment, toolbox: Toolbox, resources: Resources
) -> Oracle | None:
    """The oracle that judges a routing agent's preference adherence, where the environment's
    tasks carry preferences and it knows their best routes. A monolith does not route."""
    if not benchmark.preferences or kind not in (ORCHESTRATOR, *ROUTERS, *benchmark.baselines):
        return None
    return benchmark.oracle(toolbox, _tokenizer(resources))
