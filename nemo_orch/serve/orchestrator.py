"""``nemo-orch serve orchestrator``: the policy behind the OpenAI-compatible routes (function
calling and streaming included, see :mod:`nemo_orch.serve.openai_server`) and the orchestration
loop as one more route.

``POST /v1/orchestrate`` takes a question and runs one episode of the rollouts' own loop
(:func:`~nemo_orch.rollout.runner.run_rollouts`) with the configured tools and the server's engine,
so what it answers is what ``nemo-orch rollout`` would produce for the same task and seed::

    {"question": str, "id"?: str, "system"?: str, "tools"?: [names], "allowed_documents"?: [ids],
     "preference"?: {feature: weight}, "seed"?: int, "max_turns"?: int, "model"?: str}
    -> {"id", "object": "orchestration", "created", "model", "seed", "answer",
        "finish_reason": answer | max_turns | context_limit | engine_error, "turns", "messages",
        "ledger": {"cost_usd", "orchestrator_cost_usd", "latency_s", "generation_s", "tool_s",
                   "tokens": {"input", "output"}, "format_errors", "call_kinds",
                   "calls": [{"turn", "tool", "arguments", "cost_usd", "latency_s", "cached", "replayed",
                              "error", "kind", "input_tokens", "output_tokens",
                              "reasoning_tokens", "trajectory"}]}}

Each call has its kind (:mod:`nemo_orch.call_kinds`: ``ok``, ``truncated``, ``refused``,
``tool_error``, ``infra_error``, ``empty``) and its tokens by kind (``reasoning_tokens`` of the
``output_tokens``); ``call_kinds`` counts them by tool. An episode that a failure outside the
policy decided and that ended without an answer is not answered as one: an endpoint down (an
expert's ``infra_error``, the policy's engine) gets 503, an endpoint that refuses what it is
asked (its dialect) 502, each naming the endpoint and the reason; the server's log has the
episode.

A call's ``trajectory`` is null but for a call another orchestrator answered (see
:mod:`nemo_orch.tools.orchestrator`): then it is that orchestrator's answer of this same shape
(its messages and ledger), whose cost is in the call's ``cost_usd``.

The episode is answered as one JSON body, not streamed: its calls run on the server and an
OpenAI chunk stream has no place for its turns and ledger (``stream`` is an unknown field). A
client that runs the tools itself streams each turn from ``/v1/chat/completions``.

Without ``seed`` one is drawn and returned, so any answer can be replayed. A ``preference``
reaches the policy as the training tasks state it: its instruction after the question. Every route
is counted and timed (:class:`~nemo_orch.serve.metrics.ServeMetrics`, ``/metrics`` on
``serve.metrics_port``). Closing waits ``serve.shutdown_timeout_s`` for the episodes in flight;
those still running then are cancelled (their requests get a 503).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import secrets
import time
import uuid

from transformers import PreTrainedTokenizerBase

from nemo_orch.clients.openai import EndpointRefusal
from nemo_orch.config import Config, ConfigError, RolloutConfig, ServeConfig
from nemo_orch.data.jsonl import DataError
from nemo_orch.data.tasks import Task, task_from_json
from nemo_orch.loop_thread import LoopThread
from nemo_orch.reward.components import check_preference, preference_instruction
from nemo_orch.rollout import builders
from nemo_orch.rollout.engines.base import Engine
from nemo_orch.rollout.runner import run_rollouts
from nemo_orch.rollout.trajectory import Trajectory
from nemo_orch.serve.http_server import RequestError, ServerHandle, serve_json
from nemo_orch.serve.metrics import ServeMetrics
from nemo_orch.serve.openai_requests import request_field
from nemo_orch.serve.openai_server import OpenAIService
from nemo_orch.tools.registry import Toolbox

log = logging.getLogger(__name__)

# The request's fields: a task's (nemo_orch.data.tasks) and how to run it.
_TASK_FIELDS = ("question", "id", "system", "tools", "allowed_documents")
ORCHESTRATE_FIELDS = ("model", *_TASK_FIELDS, "preference", "seed", "max_turns")
MAX_SEED = 2**31 - 1


def _ledger(trajectory: Trajectory) -> dict:
    """An episode's bill: the total (the orchestrator's tokens at its price plus every call's
    cost), wall-clock seconds, the orchestrator's tokens summed over turns (each turn reads the
    whole context), the calls by tool and kind, and every call with its own cost, seconds,
    tokens by kind, error and kind."""
    turns = trajectory.turns
    return {
        "cost_usd": trajectory.cost_usd,
        "orchestrator_cost_usd": sum(turn.orchestrator_cost_usd for turn in turns),
        "latency_s": trajectory.wall_seconds,
        "generation_s": trajectory.generation_seconds,
        "tool_s": trajectory.tool_seconds,
        "tokens": {
            "input": sum(turn.input_tokens for turn in turns),
            "output": sum(turn.output_tokens for turn in turns),
        },
        "format_errors": trajectory.format_errors,
        "call_kinds": trajectory.call_kinds(),
        "calls": [
            {
                "turn": turn.turn,
                "tool": call.tool,
                "arguments": call.arguments,
                "cost_usd": call.cost_usd,
                "latency_s": call.seconds,
                "cached": call.cached,
                "replayed": call.replayed,
                "error": call.error,
                "kind": call.kind,
                "input_tokens": call.input_tokens,
                "output_tokens": call.output_tokens,
                "reasoning_tokens": call.reasoning_tokens,
                "trajectory": call.trajectory,
            }
            for turn in turns
            for call in turn.calls
        ],
    }


class Orchestration:
    """``POST /v1/orchestrate`` (and ``nemo-orch serve mcp``'s ``solve``,
    :mod:`nemo_orch.serve.mcp`): one episode per request through the rollouts' own runner, on
    one event loop in a background thread that owns the started toolbox, so its concurrency
    bounds, timeouts and cache hold across all requests."""

    def __init__(self, service: OpenAIService, toolbox: Toolbox, settings: RolloutConfig) -> None:
        if settings.max_context_tokens is None:
            raise ConfigError(
                "the orchestrator needs rollout.max_context_tokens resolved "
                "(Config.resolved_rollout)"
            )
        self.service, self.toolbox, self.settings = service, toolbox, settings
        self._episodes: set[asyncio.Task] = set()  # touched on the loop only
        self._loop = LoopThread("orchestrator-loop")
        try:
            self._loop.run(toolbox.start())
        except BaseException:
            self._loop.stop()
            raise

    def orchestrate(self, body: dict) -> dict:
        """One episode of the request's task (see the module docstring for both shapes)."""
        task, seed, settings = self._request(body)
        future = self._loop.submit(self._episode(task, seed, settings))
        try:
            trajectory = future.result()
        except concurrent.futures.CancelledError:
            raise RequestError(
                "the server stopped before the episode ended", 503, "server_error"
            ) from None
        except EndpointRefusal as error:
            raise RequestError(
                f"an endpoint refuses what it is asked: {error}", 502, "upstream_error"
            ) from None
        failure = trajectory.infra_failure()
        if failure is not None and trajectory.answer is None:
            log.warning(
                "orchestrate %s: no answer, %s; the episode: %s",
                task.id,
                failure,
                json.dumps(trajectory.messages, ensure_ascii=False)[:4000],
            )
            raise RequestError(
                f"no answer: the episode was decided by a failure outside the policy, {failure}",
                503,
                "upstream_unavailable",
            )
        return {
            "id": task.id,
            "object": "orchestration",
            "created": int(time.time()),
            "model": self.service.model_name,
            "seed": seed,
            "answer": trajectory.answer,
            "finish_reason": trajectory.termination,
            "turns": len(trajectory.turns),
            "messages": trajectory.messages,
            "ledger": _ledger(trajectory),
        }

    def _request(self, body: dict) -> tuple[Task, int, RolloutConfig]:
        """The task, seed and settings of a request. ``preference`` (feature weights, see
        :mod:`nemo_orch.reward.components`) is told to the policy as the training data tells
        it: its instruction after the question."""
        self.service.check_model(body)
        unknown = sorted(set(body) - set(ORCHESTRATE_FIELDS))
        if unknown:
            raise RequestError(f"unknown fields {unknown}; known: {', '.join(ORCHESTRATE_FIELDS)}")
        record = {key: body[key] for key in _TASK_FIELDS if body.get(key) is not None}
        record.setdefault("id", f"orchestrate-{uuid.uuid4().hex}")
        try:
            task = task_from_json(record, "the request")
            preference = check_preference(body["preference"]) if "preference" in body else None
        except (DataError, ValueError) as error:
            raise RequestError(str(error)) from None
        unknown_tools = [name for name in task.tools or () if name not in self.toolbox.tools]
        if unknown_tools:
            raise RequestError(
                f"unknown tools {unknown_tools}; served: {', '.join(self.toolbox.tools)}"
            )
        if preference is not None:
            instruction = preference_instruction(preference)
            task = dataclasses.replace(
                task,
                question=f"{task.question}\n{instruction}" if instruction else task.question,
                metadata={"preference": preference, "instruction": instruction},
            )
        seed = request_field(body, "seed", int)
        if seed is None:
            seed = secrets.randbelow(MAX_SEED + 1)
        elif not 0 <= seed <= MAX_SEED:
            raise RequestError(f"'seed' must be in [0, {MAX_SEED}]")
        max_turns = request_field(body, "max_turns", int, self.settings.max_turns)
        if not 1 <= max_turns <= self.settings.max_turns:
            raise RequestError(
                f"'max_turns' must be in [1, {self.settings.max_turns}] (rollout.max_turns)"
            )
        return task, seed, dataclasses.replace(self.settings, max_turns=max_turns)

    async def _episode(self, task: Task, seed: int, settings: RolloutConfig) -> Trajectory:
        self._episodes.add(asyncio.current_task())
        try:
            (trajectory,) = await run_rollouts(
                [task],
                1,
                self.service.engine,
                self.toolbox,
                self.service.tokenizer,
                settings,
                seed=seed,
            )
            return trajectory
        finally:
            self._episodes.discard(asyncio.current_task())

    def close(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` for the episodes in flight, cancel the rest, close the
        toolbox and stop the loop."""
        self._loop.run(self._shutdown(timeout_s))
        self._loop.stop()

    async def _shutdown(self, timeout_s: float) -> None:
        if self._episodes:
            _, late = await asyncio.wait(set(self._episodes), timeout=timeout_s)
            for episode in late:
                episode.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self.toolbox.close()


class OrchestratorServer:
    """A running orchestrator (see :func:`serve_orchestrator`): ``url`` ends in ``/v1``;
    ``metrics_port`` is where ``/metrics`` is exported (None: not exported). Closing stops the
    HTTP server, waits for the episodes in flight, closes the tools and stops the metrics."""

    def __init__(
        self,
        http: ServerHandle,
        orchestration: Orchestration,
        metrics_port: int | None,
        shutdown_timeout_s: float,
    ) -> None:
        self.http, self._orchestration = http, orchestration
        self.host, self.port, self.url = http.host, http.port, http.url
        self.metrics_port, self._shutdown_timeout_s = metrics_port, shutdown_timeout_s

    def wait(self) -> None:
        self.http.wait()

    def close(self) -> None:
        self.http.close()
        self._orchestration.close(self._shutdown_timeout_s)

    def __enter__(self) -> OrchestratorServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_orchestrator(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    toolbox: Toolbox,
    settings: RolloutConfig,
    serve: ServeConfig,
    model_name: str,
    *,
    api_key: str | None = None,
) -> OrchestratorServer:
    """Start ``toolbox`` and serve the OpenAI routes of ``engine`` plus ``POST /v1/orchestrate``
    (episodes under ``settings``) on ``serve.host:serve.http_port``, every route counted and
    timed in metrics exported on ``serve.metrics_port`` (null: not exported; 0: a free port).
    With ``api_key``, clients must send it as a bearer token."""
    service = OpenAIService(engine, tokenizer, model_name)
    orchestration = Orchestration(service, toolbox, settings)
    metrics = ServeMetrics("orchestrator")
    http = None
    try:
        http = serve_json(
            {**service.routes(), ("POST", "/v1/orchestrate"): orchestration.orchestrate},
            serve.host,
            serve.http_port,
            api_key=api_key,
            url_path="/v1",
            name="orchestrator",
            metrics=metrics,
        )
        metrics_port = (
            None if serve.metrics_port is None else metrics.serve(serve.host, serve.metrics_port)
        )
    except BaseException:
        if http is not None:
            http.close()
        orchestration.close(0)
        raise
    return OrchestratorServer(http, orchestration, metrics_port, serve.shutdown_timeout_s)


def api_key_of(variable: str | None) -> str | None:
    """The key named by ``serve.api_key_env`` (None: no key); never logged."""
    if variable is None:
        return None
    key = os.environ.get(variable)
    if not key:
        raise ConfigError(
            f"serve.api_key_env={variable}, but the environment variable "
            f"{variable} is not set (or empty)"
        )
    return key


def served_policy(config: Config) -> tuple[Engine, PreTrainedTokenizerBase, Toolbox, RolloutConfig]:
    """What an orchestrator server serves: the policy's engine and tokenizer as ``nemo-orch
    rollout`` builds them (``rollout.*``: a checkpoint, an HF directory, an OpenAI endpoint or
    a GPU engine), the configured tools (not started) and the episodes' settings."""
    engine, tokenizer = builders.build_engine(config)
    return (
        engine,
        tokenizer,
        builders.build_toolbox(config.tools),
        builders.rollout_settings(config, engine),
    )


def start_orchestrator(config: Config) -> OrchestratorServer:
    """``nemo-orch serve orchestrator``: the :func:`served_policy` of ``config``, served as
    ``run.name`` under ``serve.*``."""
    api_key = api_key_of(config.serve.api_key_env)  # before the (slow) engine
    return serve_orchestrator(
        *served_policy(config), config.serve, config.run.name, api_key=api_key
    )
