"""Many episodes at once on one asyncio loop.

Episodes that wait on the policy are served together: :class:`GenerationBatcher` hands every
prompt queued while the engine was busy to the next single ``generate`` call, so concurrency turns
into batch size. Tool calls of different episodes overlap freely (bounded per tool by the
toolbox), so a slow tool only delays the episodes that called it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from nemo_orch.config import RolloutConfig
from nemo_orch.data.tasks import Task
from nemo_orch.rollout.conversation import UserFactory
from nemo_orch.rollout.engines.base import (
    Engine,
    Generation,
    SamplingParams,
    WeightUpdate,
    prompt_seeds,
)
from nemo_orch.rollout.episode import Episode, PolicyClient
from nemo_orch.rollout.format import Choice
from nemo_orch.rollout.trajectory import Trajectory
from nemo_orch.tools.registry import Toolbox


class AgentLoop(Protocol):
    """Who runs an episode other than the built-in loop: an agent loop of the user's own
    through the training endpoint (:class:`~nemo_orch.rollout.external.ExternalAgents`)."""

    async def run(self, episode: Episode) -> Trajectory: ...


@dataclass
class BatchStats:
    calls: int = 0
    prompts: int = 0
    sizes: list[int] = field(default_factory=list)

    @property
    def mean_batch_size(self) -> float:
        return self.prompts / self.calls if self.calls else 0.0


class GenerationBatcher:
    """Turns concurrent single-prompt requests into batched engine calls.

    Requests with equal sampling parameters but for their seeds share a call (at most
    ``max_batch_size`` prompts), each prompt with its own seed, so what a request gets does not
    depend on what it was batched with (an unseeded request gets a random seed). The engine runs
    in a worker thread (or natively async via ``agenerate``) so tools and other episodes keep
    running meanwhile; ``engine_threads`` sets torch's intra-op threads there (None: torch's
    default; see ``rollout.engine_threads``).

    :meth:`update_weights` swaps the engine's weights between two engine calls, while episodes
    are in flight (they continue on the new weights from their next turn); each generation is
    stamped with the ``version`` of the weights that wrote it (None: not versioned).
    """

    def __init__(
        self,
        engine: Engine,
        max_batch_size: int = 64,
        version: int | None = None,
        engine_threads: int | None = None,
    ) -> None:
        self.engine, self.max_batch_size, self.version = engine, max_batch_size, version
        # None: the loop's default executor
        self._engine_thread = (
            None
            if engine_threads is None
            else (
                concurrent.futures.ThreadPoolExecutor(
                    1,
                    thread_name_prefix="engine",
                    initializer=torch.set_num_threads,
                    initargs=(engine_threads,),
                )
            )
        )
        self._pending: list[tuple[list[int], SamplingParams, asyncio.Future]] = []
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._engine_lock = asyncio.Lock()  # one engine call or weight update at a time
        self.stats = BatchStats()

    async def update_weights(self, weights: WeightUpdate, version: int | None) -> None:
        """The engine's weights become ``weights`` (version ``version``; whole, or streamed
        bucket by bucket) once its current call, if any, has returned."""
        async with self._engine_lock:
            await self._in_engine_thread(self.engine.update_weights, weights)
            self.version = version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._worker = asyncio.create_task(self._serve())
        future = asyncio.get_running_loop().create_future()
        self._pending.append((prompt_ids, params, future))
        self._wakeup.set()
        return await future

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None

    def _take_batch(self) -> tuple[SamplingParams, list[tuple[list[int], int, asyncio.Future]]]:
        """The first pending request's parameters (seed aside) and up to ``max_batch_size``
        requests that share them, each with its seed."""
        params = replace(self._pending[0][1], seed=None)
        batch, rest = [], []
        for prompt, p, future in self._pending:
            if replace(p, seed=None) == params and len(batch) < self.max_batch_size:
                batch.append((prompt, prompt_seeds(p, 1)[0], future))
            else:
                rest.append((prompt, p, future))
        self._pending = rest
        return params, batch

    async def _serve(self) -> None:
        while True:
            await self._wakeup.wait()
            # One loop pass lets episodes that are ready in the same tick join this batch.
            await asyncio.sleep(0)
            while self._pending:
                params, batch = self._take_batch()
                try:
                    await self._answer(batch, params)
                except Exception:
                    # A call fails as a whole (e.g. one prompt too long for the engine): each
                    # prompt alone again (its own seed: the same sample), so only the episodes
                    # at fault get the error.
                    await asyncio.gather(*(self._answer([request], params) for request in batch))
            self._wakeup.clear()

    async def _answer(
        self, batch: list[tuple[list[int], int, asyncio.Future]], params: SamplingParams
    ) -> None:
        """One engine call for ``batch``; its futures get the generations. A failed call
        raises, but for a single request, whose episode gets the error (and decides what it
        means)."""
        prompts = [prompt for prompt, _, _ in batch]
        try:
            async with self._engine_lock:
                generations = [
                    replace(generation, policy_version=self.version)
                    for generation in await self._call_engine(
                        prompts, params, [seed for _, seed, _ in batch]
                    )
                ]
        except Exception as error:
            if len(batch) > 1:
                raise
            if not batch[0][2].done():
                batch[0][2].set_exception(error)
            return
        self.stats.calls += 1
        self.stats.prompts += len(prompts)
        self.stats.sizes.append(len(prompts))
        for (_, _, future), generation in zip(batch, generations):
            if not future.done():
                future.set_result(generation)

    async def _call_engine(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]
    ) -> list[Generation]:
        agenerate = getattr(self.engine, "agenerate", None)
        if agenerate is not None:
            return await agenerate(prompts, params, seeds)
        return await self._in_engine_thread(self.engine.generate, prompts, params, seeds)

    async def _in_engine_thread(self, call: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, call, *args)


class DirectPolicy:
    """The engine called with one prompt at a time, in the loop's thread: no batching and no
    overlap. What a strictly sequential runner does, and all a scripted demonstrator needs."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.version = engine, None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        return self.engine.generate([prompt_ids], params)[0]


@dataclass(frozen=True)
class EpisodeJob:
    """One episode of a rollout: its place in (task, sample) order, its seed, the choice its
    first turn is forced to start with (None: the policy's own) and the chance that another
    call's choice (its model) is redrawn (see :class:`~nemo_orch.rollout.episode.Episode`)."""

    index: int
    task: Task
    sample: int
    seed: int
    forced_choice: Choice | None = None
    explore_models: float = 0.0


def episode_jobs(
    tasks: Sequence[Task],
    samples_per_task: int,
    seed: int = 0,
    forced_choices: Mapping[tuple[int, int], Choice] | None = None,
    explore_models: float = 0.0,
) -> list[EpisodeJob]:
    """Every task ``samples_per_task`` times, in (task, sample) order; episode ``i`` gets seed
    ``seed + i`` whoever runs it (a Ray worker gets the same seeds as this process), and its
    turns sample with seeds derived from it (:class:`~nemo_orch.rollout.episode.Episode`)."""
    forced_choices = forced_choices or {}
    pairs = [
        (task_index, sample)
        for task_index in range(len(tasks))
        for sample in range(samples_per_task)
    ]
    return [
        EpisodeJob(
            index,
            tasks[task_index],
            sample,
            seed + index,
            forced_choices.get((task_index, sample)),
            explore_models,
        )
        for index, (task_index, sample) in enumerate(pairs)
    ]


async def run_episodes(
    jobs: Sequence[EpisodeJob],
    policy: PolicyClient,
    toolbox: Toolbox,
    tokenizer: PreTrainedTokenizerBase,
    settings: RolloutConfig,
    users: UserFactory | None = None,
    agent: AgentLoop | None = None,
) -> list[Trajectory]:
    """Run ``jobs``, at most ``settings.max_concurrent_episodes`` at once (each with its user,
    where ``users`` makes one; by ``agent`` where given, else the built-in loop); trajectories
    come back in the jobs' order. The toolbox's
    sources are listed again first where they changed, once: every episode of a rollout (every
    sample of a GRPO group) is offered the same tools."""
    await toolbox.refresh()
    slots = asyncio.Semaphore(settings.max_concurrent_episodes)

    async def one(job: EpisodeJob) -> Trajectory:
        async with slots:
            episode = Episode(
                job.task,
                job.sample,
                policy,
                toolbox,
                tokenizer,
                settings,
                seed=job.seed,
                forced_choice=job.forced_choice,
                explore_models=job.explore_models,
                users=users,
            )
            return await (episode.run() if agent is None else agent.run(episode))

    return list(await asyncio.gather(*(one(job) for job in jobs)))


async def run_rollouts(
    tasks: Sequence[Task],
    samples_per_task: int,
    engine: Engine,
    toolbox: Toolbox,
    tokenizer: PreTrainedTokenizerBase,
    settings: RolloutConfig,
    *,
    seed: int = 0,
    batcher: GenerationBatcher | None = None,
    forced_choices: Mapping[tuple[int, int], Choice] | None = None,
    explore_models: float = 0.0,
    users: UserFactory | None = None,
    agent: AgentLoop | None = None,
) -> list[Trajectory]:
    """Run every task ``samples_per_task`` times (a GRPO group each), at most
    ``settings.max_concurrent_episodes`` at once; trajectories come back in (task, sample)
    order. ``forced_choices`` maps (task index, sample) to the choice its first turn starts
    with and ``explore_models`` the chance any other call's model is redrawn (directed
    exploration); ``users``: the environment's user (tau2's customer); ``agent``: who runs the
    episodes, where not the built-in loop."""
    own_batcher = batcher is None
    batcher = batcher or GenerationBatcher(engine, settings.max_batch_size)
    try:
        return await run_episodes(
            episode_jobs(tasks, samples_per_task, seed, forced_choices, explore_models),
            batcher,
            toolbox,
            tokenizer,
            settings,
            users,
            agent,
        )
    finally:
        if own_batcher:
            await batcher.close()
