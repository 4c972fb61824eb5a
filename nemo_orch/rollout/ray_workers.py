"""Rollouts on Ray (``rollout.backend=ray``): rollout workers, tool executors and reward scorers
as actors.

The rollout side of NeMo-RL and verl, small. The driver cuts a rollout's episodes into one chunk
of whole groups per worker, so an episode and the rest of its group run on one worker's engine
from their first turn to their last: sticky routing, which lets the engine's prefix cache
(``rollout.prefix_caching``) serve an episode's later turns and its group's shared prompt. A
*rollout worker* runs its chunk with the local backend's episode
loop (:func:`~nemo_orch.rollout.runner.run_episodes`, with its own engine and batcher); its tool
calls go to a *tool executor* of its own (:mod:`nemo_orch.tools.executor`), an actor serving the
configured :class:`~nemo_orch.tools.registry.Toolbox`; answers are scored by *scorer* actors
behind the :class:`~nemo_orch.reward.outcome.AnswerScorer` protocol.

Seeds do not depend on who runs an episode: episode ``i`` gets seed ``seed + i`` as it does
locally (:func:`~nemo_orch.rollout.runner.episode_jobs`), and each of its turns samples with a
seed derived from it, carried with the prompt into the engine. So the two backends sample the
same tokens, however the workers and their batchers grouped the episodes.

Faults: a worker and its tool executor are one unit. When either dies, the driver stops both,
starts a fresh pair and runs the whole chunk again: the per-episode tool state (a domain's
databases) lived in the old executor, so the re-run starts from the state the first run did.
Results are taken per episode index from chunks that finished, so none is lost or counted
twice. Scorers keep no state that matters and scoring is idempotent: Ray restarts them and
retries their calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import ray
import torch
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError
from transformers import PreTrainedTokenizerBase

from nemo_orch.clients import call_store
from nemo_orch.config import CallsConfig, Config, ConfigError, RayConfig, RolloutConfig
from nemo_orch.data.tasks import Task
from nemo_orch.reward.builders import build_scorer
from nemo_orch.reward.outcome import AnswerScorer, OutcomeResult
from nemo_orch.rollout.builders import build_engine, build_rollout_engine, build_toolbox
from nemo_orch.rollout.engines.base import Engine
from nemo_orch.rollout.episode import RolloutError
from nemo_orch.rollout.format import Choice
from nemo_orch.rollout.runner import EpisodeJob, GenerationBatcher, episode_jobs, run_episodes
from nemo_orch.rollout.trajectory import Trajectory
from nemo_orch.tools.base import ToolSpec
from nemo_orch.tools.executor import ToolExecutor, executor_toolbox
from nemo_orch.tools.registry import Toolbox

log = logging.getLogger(__name__)

# A worker's engine and tokenizer, built inside the worker from the weights the pool holds
# (None: the pool holds none and the engine loads its own).
EngineFactory = Callable[
    [Mapping[str, torch.Tensor] | None], tuple[Engine, PreTrainedTokenizerBase]
]
LOOPBACK = "127.0.0.1"


class ToolExecutorLost(RolloutError):
    """A worker's tool executor died during its chunk: the chunk's observations are unusable."""


def policy_engine(config: Config) -> EngineFactory:
    """Workers load ``rollout.policy`` as ``nemo-orch rollout`` does locally
    (:func:`~nemo_orch.rollout.builders.build_engine`)."""
    return lambda weights: build_engine(config)


def weights_engine(config: Config, tokenizer: PreTrainedTokenizerBase) -> EngineFactory:
    """Workers build GRPO's engine from the pool's weights (one copy in the object store,
    replaced by :meth:`RayRolloutPool.update_weights`)."""
    return lambda weights: (build_rollout_engine(config, weights, tokenizer), tokenizer)


# ----------------------------------------------------------------------------- Ray itself


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """Ray takes this machine's routable address as the node's and binds its servers to it;
    with this switch (Ray's own, for laptops) it takes the loopback address, so a Ray started
    here serves and talks on 127.0.0.1 only. Ray's processes started meanwhile inherit it."""
    from ray._private import ray_constants

    name = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    saved_env, saved_flag = os.environ.get(name), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[name], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            del os.environ[name]
        else:
            os.environ[name] = saved_env


def connect(settings: RayConfig) -> bool:
    """Join ``settings.address``, or start a Ray here on 127.0.0.1 with the object store capped
    at ``settings.object_store_mb``; returns whether this call connected (and so its caller
    disconnects), False when this process already was."""
    if ray.is_initialized():
        return False
    if settings.address is not None:
        ray.init(address=settings.address)
        return True
    with _loopback_node():
        ray.init(
            address="local",
            object_store_memory=settings.object_store_mb << 20,
            include_dashboard=False,
            _node_ip_address=LOOPBACK,
        )
    return True


# ----------------------------------------------------------------------------- the actors


@ray.remote
class RolloutWorker:
    """An engine and the episode loop. The engine is built by :meth:`start`, so a bad policy or
    config reaches the driver as its own error (see :meth:`RayRolloutPool._start_unit`) rather
    than as a dead actor. One batcher serves every run: a refit (:meth:`update_weights`) waits
    for its engine call to return and reaches the episodes in flight, whose turns record the
    weights' version."""

    def __init__(self, settings: RolloutConfig, num_threads: int) -> None:
        torch.set_num_threads(num_threads)  # the worker's CPUs, not the machine's
        self.settings, self.num_threads = settings, num_threads
        self.lost: list[str] = []

    def start(
        self,
        make_engine: EngineFactory,
        weights: Mapping[str, torch.Tensor] | None,
        executor: ActorHandle,
        offered: tuple[list[ToolSpec], dict[str, str]],
        version: int | None = None,
    ) -> None:
        self.executor, self.offered = executor, offered
        self.toolbox = executor_toolbox(executor, offered, self.lost)
        self.engine, self.tokenizer = make_engine(weights)
        # torch's thread count is per thread: the engine's is set where it runs
        self.batcher = GenerationBatcher(
            self.engine, self.settings.max_batch_size, version, self.num_threads
        )

    async def run(self, jobs: list[EpisodeJob]) -> list[Trajectory]:
        # A chunk is offered the tools on offer when it starts (an MCP server may have
        # changed its list since the last one).
        try:
            offered = await self.executor.offered.remote()
        except RayActorError as error:
            raise ToolExecutorLost(f"{type(error).__name__}: {error}") from error
        if offered != self.offered:
            self.offered = offered
            self.toolbox = executor_toolbox(self.executor, offered, self.lost)
        trajectories = await run_episodes(
            jobs, self.batcher, self.toolbox, self.tokenizer, self.settings
        )
        if self.lost:
            raise ToolExecutorLost(self.lost[0])
        return trajectories

    async def update_weights(
        self, weights: Mapping[str, torch.Tensor], version: int | None = None
    ) -> None:
        await self.batcher.update_weights(weights, version)


@ray.remote(num_cpus=0)
class ScorerActor:
    """An answer scorer (the reward protocol, its judge client and cache) in an actor."""

    def __init__(self, make_scorer: Callable[[], AnswerScorer]) -> None:
        self.scorer = make_scorer()

    async def score(
        self, task: Task, answer: str | None, calls: list[tuple[str, dict[str, Any]]]
    ) -> OutcomeResult:
        return await self.scorer.score(task, answer, calls)


class ActorScorer:
    """:class:`~nemo_orch.reward.outcome.AnswerScorer` over scorer actors; a task always goes to
    the same actor, so a group's repeated answers share its judge cache."""

    def __init__(self, actors: Sequence[ActorHandle]) -> None:
        self.actors = list(actors)

    async def score(
        self, task: Task, answer: str | None, calls: Sequence[tuple[str, dict[str, Any]]] = ()
    ) -> OutcomeResult:
        actor = self.actors[zlib.crc32(task.id.encode()) % len(self.actors)]
        try:
            return await actor.score.remote(task, answer, list(calls))
        except RayTaskError as error:
            if error.cause is None:
                raise
            raise error.cause from error  # e.g. a reward server gone: the scorer's own error


# ----------------------------------------------------------------------------- the pool


@dataclass
class _Unit:
    worker: ActorHandle
    executor: ActorHandle


def _chunks(jobs: list[EpisodeJob], samples_per_task: int, parts: int) -> list[list[EpisodeJob]]:
    """``jobs`` cut into at most ``parts`` runs of whole groups, as even as they go (a group
    split over two engines would compute its shared prompt twice)."""
    size = max(1, math.ceil(len(jobs) // samples_per_task / parts)) * samples_per_task
    return [jobs[start : start + size] for start in range(0, len(jobs), size)]


class RayRolloutPool:
    """``rollout.ray.num_workers`` units (a rollout worker and its tool executor) and, given
    ``make_scorer``, ``num_scorers`` scorer actors (:attr:`scorer`). ``async with`` starts them
    (and Ray, see :func:`connect`) and stops them. ``weights``: the policy's HF-named tensors, put
    in the object store once and handed to every worker's ``make_engine``; ``version``: the
    update count behind them (which stamps the turns written with them; None: unversioned)."""

    def __init__(
        self,
        settings: RolloutConfig,
        make_engine: EngineFactory,
        make_toolbox: Callable[[], Toolbox],
        make_scorer: Callable[[], AnswerScorer] | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
        version: int | None = None,
    ) -> None:
        self.settings, self.ray = settings, settings.ray
        self._make_engine, self._make_toolbox = make_engine, make_toolbox
        self._make_scorer, self._initial_weights = make_scorer, weights
        self.version = version
        self._weights: ray.ObjectRef | None = None
        self._owns_ray = False
        self.units: list[_Unit] = []
        self.scorer: ActorScorer | None = None
        self.replacements = 0  # units replaced over the pool's life

    async def __aenter__(self) -> RayRolloutPool:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        self._owns_ray = connect(self.ray)
        needed = self.ray.num_workers * self.ray.num_cpus_per_worker
        available = ray.cluster_resources().get("CPU", 0.0)
        if needed > available:
            raise ConfigError(
                f"rollout.ray: {self.ray.num_workers} workers x "
                f"{self.ray.num_cpus_per_worker:g} CPUs need {needed:g} CPUs; the "
                f"Ray cluster has {available:g}"
            )
        log.info(
            "rollout workers: %d on the Ray cluster at %s (%g CPUs)",
            self.ray.num_workers,
            ray.get_runtime_context().gcs_address,
            available,
        )
        if self._initial_weights is not None:
            self._weights = ray.put(self._initial_weights)
        started = await asyncio.gather(
            *(self._start_unit() for _ in range(self.ray.num_workers)), return_exceptions=True
        )
        self.units = [unit for unit in started if isinstance(unit, _Unit)]
        for error in started:
            if not isinstance(error, _Unit):
                raise error
        if self._make_scorer is not None:
            self.scorer = ActorScorer(
                [
                    ScorerActor.options(
                        max_restarts=self.ray.max_replacements,
                        max_task_retries=self.ray.max_replacements,
                    ).remote(self._make_scorer)
                    for _ in range(self.ray.num_scorers)
                ]
            )

    async def close(self) -> None:
        await asyncio.gather(*(self._stop_unit(unit) for unit in self.units))
        for actor in self.scorer.actors if self.scorer is not None else []:
            ray.kill(actor)
        self.units, self.scorer = [], None
        if self._owns_ray:
            ray.shutdown()

    async def _start_unit(self) -> _Unit:
        unit = _Unit(
            RolloutWorker.options(num_cpus=self.ray.num_cpus_per_worker).remote(
                self.settings, max(1, int(self.ray.num_cpus_per_worker))
            ),
            ToolExecutor.remote(self._make_toolbox),
        )
        try:
            offered = await unit.executor.start.remote()
            await unit.worker.start.remote(
                self._make_engine, self._weights, unit.executor, offered, self.version
            )
        except BaseException as error:
            await self._stop_unit(unit)
            if isinstance(error, RayTaskError) and error.cause is not None:
                raise error.cause from error  # a bad policy, config or tool: its own error
            raise
        return unit

    @staticmethod
    async def _stop_unit(unit: _Unit) -> None:
        """Close the tools (sandbox workers, their cgroups) when the executor still lives."""
        with contextlib.suppress(RayActorError):
            await unit.executor.close.remote()
        ray.kill(unit.worker)
        ray.kill(unit.executor)

    async def run(
        self,
        tasks: Sequence[Task],
        samples_per_task: int,
        *,
        seed: int = 0,
        forced_choices: Mapping[tuple[int, int], Choice] | None = None,
        explore_models: float = 0.0,
    ) -> list[Trajectory]:
        """What :func:`~nemo_orch.rollout.runner.run_rollouts` returns for the same arguments,
        with the episodes spread over the workers. A dead unit is replaced and its chunk run
        again, at most ``rollout.ray.max_replacements`` times in this call."""
        jobs = episode_jobs(tasks, samples_per_task, seed, forced_choices, explore_models)
        queue = deque(_chunks(jobs, samples_per_task, len(self.units)))
        idle = deque(range(len(self.units)))
        running: dict[asyncio.Future, tuple[int, list[EpisodeJob]]] = {}
        finished: dict[int, Trajectory] = {}
        replaced = 0
        try:
            while queue or running:
                while queue and idle:
                    index, chunk = idle.popleft(), queue.popleft()
                    call = self.units[index].worker.run.remote(chunk)
                    running[asyncio.ensure_future(call)] = (index, chunk)
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    index, chunk = running.pop(future)
                    try:
                        trajectories = future.result()
                    except (RayActorError, ToolExecutorLost) as error:
                        replaced += 1
                        if replaced > self.ray.max_replacements:
                            raise RolloutError(
                                f"rollout workers or their tool executors died "
                                f"{replaced} times in one rollout (rollout.ray."
                                f"max_replacements={self.ray.max_replacements}):"
                                f" {error}"
                            ) from error
                        log.warning(
                            "rollout worker %d lost (%s): replacing it and running its "
                            "%d episodes again",
                            index,
                            error,
                            len(chunk),
                        )
                        await self._replace(index)
                        queue.appendleft(chunk)
                    else:
                        finished.update(
                            (job.index, trajectory)
                            for job, trajectory in zip(chunk, trajectories, strict=True)
                        )
                    idle.append(index)
        finally:
            for future in running:
                future.cancel()
        return [finished[job.index] for job in jobs]

    async def _replace(self, index: int) -> None:
        await self._stop_unit(self.units[index])
        self.units[index] = await self._start_unit()
        self.replacements += 1

    def update_weights(
        self, weights: Mapping[str, torch.Tensor], version: int | None = None
    ) -> None:
        """Refit every worker from one object-store copy of ``weights`` (after ``version``
        updates), into the episodes in flight; a worker that died meanwhile is replaced by the
        next :meth:`run`, built from these weights."""
        self._weights, self.version = ray.put(weights), version
        for call in [
            unit.worker.update_weights.remote(self._weights, version) for unit in self.units
        ]:
            try:
                ray.get(call)
            except RayActorError as error:
                log.warning("a rollout worker died before its refit: %s", error)


def build_ray_pool(
    config: Config,
    make_engine: EngineFactory,
    weights: Mapping[str, torch.Tensor] | None = None,
    *,
    scoring: bool = True,
    version: int | None = None,
) -> RayRolloutPool:
    """The pool of ``rollout.ray`` with the configured tools and (``scoring``) reward, not yet
    started."""
    return RayRolloutPool(
        config.resolved_rollout(),
        make_engine,
        partial(_recording, config.calls, build_toolbox, config.tools),
        partial(_recording, config.calls, build_scorer, config) if scoring else None,
        weights,
        version,
    )


def _recording(calls: CallsConfig, build: Callable[..., Any], *args: Any) -> Any:
    """``build(*args)`` in an actor's process, whose calls go through ``calls``' store (the
    driver's :func:`~nemo_orch.clients.call_store.recording` does not reach it)."""
    call_store.activate(calls)
    return build(*args)
