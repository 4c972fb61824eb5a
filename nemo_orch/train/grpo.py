"""GRPO recipe: the RL stage of ``nemo-orch train``, on the Megatron policy.

Read top to bottom. Each step: rank 0 rolls out ``grpo.prompts_per_step`` tasks x
``rollout.group_size`` episodes with the rollout engine (``rollout.engine``; on Ray's workers
with ``rollout.backend=ray``) and the real tools, scores the groups
(:mod:`nemo_orch.reward`), filters them and, with dynamic sampling, rolls out more until the batch
is full; the samples go to every rank; the trainer recomputes the old log-probabilities (and
logs their mismatch with the engine's), the frozen reference's, and runs ``updates_per_step``
passes over ``mini_batches`` optimizer steps; then the new weights are synced into the engine and,
every ``save_interval`` steps, checkpointed. A resumed run continues from its last checkpoint;
tasks and sampling seeds depend on the step only.

With ``grpo.async_grpo.enabled`` the rollouts of the next steps run ahead on the rollout loop's
thread while the trainer trains (at most ``max_trajectory_age_steps`` updates behind); the
refit reaches episodes in flight, every turn records the weights' version, groups too old for
the trainer are dropped, and a killed run resumes from its checkpoint with nothing in flight
(``trained.jsonl`` lists each step's samples).

With ``grpo.algo=ppo`` (``grpo=ppo``) the advantages come from a critic instead of the group:
GAE over the policy's tokens, the critic trained beside the policy on the same micro-batches and
checkpointed with it (:mod:`nemo_orch.train.ppo`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import random
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nemo_orch import config as config_lib
from nemo_orch import distributed, faults
from nemo_orch.clients.http import HTTPError
from nemo_orch.config import Config, ConfigError
from nemo_orch.data.sft import padded_length
from nemo_orch.data.tasks import Task
from nemo_orch.distributed import ParallelContext
from nemo_orch.envs import Environment, Mixture, build_mixture
from nemo_orch.envs.mixture import Draw
from nemo_orch.envs.offline.oracle import group_key, route_of, route_shares
from nemo_orch.loop_thread import LoopThread
from nemo_orch.models import checkpoint, weights
from nemo_orch.models.tokenizer import load_tokenizer
from nemo_orch.reward.advantages import (SamplingStats, fill_batch, group_advantages,
                                         group_drop_reason, trajectory_drop_reason)
from nemo_orch.reward.combine import RewardBreakdown
from nemo_orch.reward.outcome import OutcomeResult
from nemo_orch.reward.scoring import OutcomeFn, by_answer, score_groups
from nemo_orch.rollout.builders import build_rollout_engine
from nemo_orch.rollout.engines.base import Sleepable, WeightUpdate
from nemo_orch.rollout.episode import Trajectory, prompt_length
from nemo_orch.rollout.format import Choice, TurnFormat, choice_of, choices
from nemo_orch.rollout.runner import GenerationBatcher, run_rollouts
from nemo_orch.seeding import derive_seed
from nemo_orch.train import curriculum, ppo, preemption
from nemo_orch.train.grpo_loss import grpo_token_loss, kl_penalty
from nemo_orch.train.metrics import MetricsLogger, TrainedLog, logged_steps
from nemo_orch.train.policy import (Batch, Critic, Policy, ReferenceModel, load_start_weights,
                                    start_architecture)

if TYPE_CHECKING:  # Ray loads only for rollout.backend=ray
    from nemo_orch.rollout.ray_workers import RayRolloutPool

log = logging.getLogger(__name__)

# Training tasks per source whose prompts are measured before the first step: a source none of
# whose prompts fits the policy's context is an error, not a run that trains on nothing.
PROBE_TASKS = 64
# <run>/notes.json: each source's notes; those of a prompt too long for the context name at most
# NOTED_TASKS task ids.
NOTES, SKIPPED_CONTEXT, NOTED_TASKS = "notes.json", "skipped_context", 10


@dataclass
class Group:
    task: Task
    trajectories: list[Trajectory]
    breakdowns: list[RewardBreakdown]
    source: str = ""  # the environment it came from (env.*)

    def age(self, version: int) -> int:
        """How many updates the oldest weights that wrote a turn of it are behind ``version``
        (0 where the engine's weights are not versioned)."""
        versions = [v for t in self.trajectories if (v := t.oldest_policy_version) is not None]
        return version - min(versions) if versions else 0


@dataclass
class Sample:
    """One training sequence: token ids, which of them the loss covers, the engine's logprobs,
    the group advantage (GRPO's) and the tokens an advantage applies to (``advantage_mask``,
    within ``loss_mask``), and the trajectory's reward (PPO's GAE starts from it)."""

    token_ids: list[int]
    loss_mask: list[int]
    engine_logprobs: list[float]
    advantage: float
    advantage_mask: list[int]
    sample_id: str = ""  # <task id>/<sample>, and /<turn> with grpo.sample_mode=turn
    reward: float = 0.0


@dataclass
class GRPOSummary:
    start_step: int
    end_step: int
    first_reward: float | None
    last_reward: float | None
    checkpoint: Path | None
    run_dir: Path


def policy_config(config: Config) -> Config:
    """The config the Megatron policy is built from for this stage: the optimizer of
    ``grpo.optim``, its schedule over GRPO's optimizer steps."""
    grpo = config.grpo
    trainer = dataclasses.replace(
        config.trainer, optim=grpo.optim,
        max_steps=grpo.max_steps * grpo.updates_per_step * grpo.mini_batches,
        micro_batch_size=grpo.micro_batch_size, global_batch_size=grpo.micro_batch_size
        * config.parallel.dp, save_interval=grpo.save_interval)
    return dataclasses.replace(config, trainer=trainer)


# ----------------------------------------------------------------------------- rollouts

def _note_skipped(environment: Environment, task_id: str) -> None:
    """Count a task whose prompt does not fit the policy's context in its environment's notes
    (with the first few ids)."""
    skipped = environment.notes.setdefault(SKIPPED_CONTEXT, {"count": 0, "tasks": []})
    skipped["count"] += 1
    if len(skipped["tasks"]) < NOTED_TASKS:
        skipped["tasks"].append(task_id)


@dataclass
class StepBatch:
    """What rank 0's rollouts made of one step: the groups kept for training, every group
    generated (what the step's metrics describe), the sampling stats, the routing choices the
    policy made itself, the episodes whose first choice was forced, the tasks left out because
    their prompt does not fit the context, the episodes a failing user endpoint ended (left
    out of their groups), and the validation metrics (empty between ``grpo.val_interval``
    steps). Rolled out ahead (asynchronous GRPO): the groups dropped as too old for the
    trainer, the trained groups' ages, how long no step was rolling out since the last batch
    was taken, and how long the trainer waited for this one."""

    kept: list[Group]
    generated: list[Group]
    stats: SamplingStats
    choices: Counter
    forced_episodes: int
    skipped_context: int
    user_errors: int
    validation: dict[str, float] = field(default_factory=dict)
    dropped_stale: list[Group] = field(default_factory=list)
    ages: Counter = field(default_factory=Counter)
    rollout_idle_seconds: float | None = None
    trainer_idle_seconds: float | None = None

    def metrics(self) -> dict[str, float]:
        ahead = {} if self.trainer_idle_seconds is None else {
            "async/dropped_groups": len(self.dropped_stale),
            "async/rollout_idle_s": self.rollout_idle_seconds,
            "async/trainer_idle_s": self.trainer_idle_seconds,
            **{f"async/age_{age}": count for age, count in sorted(self.ages.items())}}
        return {**rollout_metrics(self.generated, self.stats),
                "explore/forced_episodes": self.forced_episodes,
                "sampling/skipped_context": self.skipped_context,
                "sampling/user_errors": self.user_errors, **self.validation, **ahead,
                **{f"choices/{key}": count for key, count in self.choices.items()}}


@dataclass
class _Round:
    """One sampling round of a step (see :meth:`Rollouts.groups`)."""

    groups: list[Group]
    choices: Counter
    forced_episodes: int
    skipped_context: int
    user_errors: int


class _IdleClock:
    """Seconds during which nothing was busy (``busy(+1)`` / ``busy(-1)`` bracket the work),
    handed out since the last :meth:`take`."""

    def __init__(self) -> None:
        self.running, self.since, self.idle = 0, time.perf_counter(), 0.0

    def busy(self, change: int) -> None:
        now = time.perf_counter()
        if self.running == 0:
            self.idle += now - self.since
        self.running += change
        self.since = now

    def take(self) -> float:
        self.busy(0)
        idle, self.idle = self.idle, 0.0
        return idle


class Rollouts:
    """Rank 0's side of GRPO: the engine (or, with ``rollout.backend=ray``, the ``pool`` whose
    actors run the episodes and their scoring; ``engine`` is then None and the toolboxes only
    name the tools), the environments (``mixture``, each source with its toolbox in
    ``toolboxes``), the reward, the tasks of each step and the choices directed exploration
    forces. A context manager: entering starts an event loop on a thread of its own and the
    tools (or the pool) on it, leaving writes the sources' notes and closes them and the loop.

    Synchronous GRPO asks for each step's :class:`StepBatch` with :meth:`step`; asynchronous
    GRPO starts :meth:`run_ahead`, which rolls the steps out on the loop while the trainer
    trains, and takes each with :meth:`take`. ``previous_choices`` are the choices the policy
    made in the step before the first one (a resumed run's, from its log); ``version`` is the
    number of updates behind the engine's weights, which stamps every turn it writes."""

    def __init__(self, config: Config, engine: Any, tokenizer: Any, mixture: Mixture,
                 toolboxes: list[Any], pool: "RayRolloutPool | None" = None,
                 previous_choices: Counter | None = None, version: int = 0) -> None:
        self.config, self.engine, self.tokenizer, self.pool = config, engine, tokenizer, pool
        self.mixture, self.toolboxes = mixture, dict(zip(
            (environment.name for environment in mixture.environments), toolboxes))
        self.settings = config.resolved_rollout()
        self.format = TurnFormat.for_tools(toolboxes[0].schemas())
        self.previous_choices = previous_choices or Counter()
        # A colocated GPU engine gives the GPUs back while the policy trains (RolloutConfig).
        self.colocated = config.rollout.colocate and isinstance(engine, Sleepable)
        # One batcher for the run: its engine calls and weight updates take turns.
        self.batcher = None if pool is not None else GenerationBatcher(
            engine, self.settings.max_batch_size, version, config.rollout.engine_threads)
        self._loop: LoopThread | None = None  # started on entering
        self._refitted = asyncio.Condition()  # run_ahead waits on it for fresh enough weights
        self._ahead: dict[int, asyncio.Task] = {}  # run_ahead's rollouts by step
        self._idle = _IdleClock()  # when no step of run_ahead's is rolling out

    def __enter__(self) -> "Rollouts":
        self._loop = LoopThread("rollouts")
        self._call(self._each("start"))
        return self

    def __exit__(self, *exc: object) -> None:
        (self.config.run.dir / NOTES).write_text(json.dumps(
            {environment.name: environment.notes for environment in self.mixture.environments},
            indent=1, default=str) + "\n")
        try:
            self._call(self._each("close"))
        finally:
            # Also cancels what is still running: batches rolled out ahead, the scoring
            # requests of a batch whose first one failed for good.
            self._call(_cancel_others())
            self._loop.stop()

    def _call(self, coroutine: Any) -> Any:
        """Run ``coroutine`` on the rollout loop and wait for its result."""
        return self._loop.run(coroutine)

    async def _each(self, method: str) -> None:
        """``start`` or ``close`` the pool, else every toolbox (on Ray the tools run in the
        workers' executors) and, when closing, the batcher."""
        if self.pool is not None:
            await getattr(self.pool, method)()
            return
        await asyncio.gather(*(getattr(toolbox, method)()
                               for toolbox in self.toolboxes.values()))
        if method == "close":
            await self.batcher.close()

    @property
    def version(self) -> int | None:
        """The update count behind the engine's (or the pool's) weights."""
        return self.pool.version if self.batcher is None else self.batcher.version

    def step(self, step: int, tools: list[str] | None) -> StepBatch:
        """Roll out, score and filter ``step``'s batch offering ``tools`` (None: all), and
        validate every ``grpo.val_interval`` steps. A reward server gone past its retries stops
        the run with an :class:`HTTPError` saying where it resumes."""
        try:
            return self._call(self._step(step, tools))
        except HTTPError as error:
            raise HTTPError(_stopped(self.config, step, error), error.status) from None

    async def _step(self, step: int, tools: list[str] | None) -> StepBatch:
        batch = await self.batch(step, tools)
        interval = self.config.grpo.val_interval
        if interval and step % interval == 0:
            batch.validation = await self.validate()
        return batch

    def run_ahead(self, first_step: int, last_step: int,
                  tools: Callable[[], list[str] | None]) -> None:
        """Roll out steps ``first_step``..``last_step`` on the loop, each as soon as the
        engine's weights are at most ``max_trajectory_age_steps`` updates older than those
        that will train on it (so up to ``max_trajectory_age_steps + 1`` steps' episodes are in
        flight at once; ``tools()``: what its tasks offer, read as it starts)."""
        max_age = self.config.grpo.async_grpo.max_trajectory_age_steps

        async def produce(step: int) -> StepBatch:
            async with self._refitted:
                await self._refitted.wait_for(lambda: self.version >= step - 1 - max_age)
            self._idle.busy(+1)
            try:
                return await self._step(step, tools())
            finally:
                self._idle.busy(-1)

        async def start() -> None:
            for step in range(first_step, last_step + 1):
                self._ahead[step] = asyncio.create_task(produce(step))

        self._call(start())

    def take(self, step: int) -> StepBatch:
        """The batch :meth:`run_ahead` rolled out for ``step``, without the groups written by
        weights more than ``max_trajectory_age_steps`` updates older than the trainer's (which
        are those of step ``step - 1``); the trainer's wait is its ``trainer_idle_seconds``."""
        waited = time.perf_counter()
        rollout = self._ahead.pop(step)

        async def finished() -> StepBatch:
            batch = await rollout
            batch.rollout_idle_seconds = self._idle.take()
            return batch

        try:
            batch = self._call(finished())
        except HTTPError as error:
            raise HTTPError(_stopped(self.config, step, error), error.status) from None
        batch.trainer_idle_seconds = time.perf_counter() - waited
        max_age = self.config.grpo.async_grpo.max_trajectory_age_steps
        ages = [group.age(step - 1) for group in batch.kept]
        batch.dropped_stale = [g for g, age in zip(batch.kept, ages) if age > max_age]
        batch.kept = [g for g, age in zip(batch.kept, ages) if age <= max_age]
        batch.ages = Counter(age for age in ages if age <= max_age)
        return batch

    def sleep(self) -> None:
        """Give the GPUs back while the policy trains (a colocated engine only)."""
        if self.colocated:
            self.engine.sleep()

    def refit(self, weights: WeightUpdate, version: int) -> None:
        """The policy's new weights (after ``version`` updates) into the engine, woken up
        first, between two of its calls (episodes in flight continue on them), streamed bucket
        by bucket; or into the pool's workers, which share one object-store copy of them
        whole."""
        if self.colocated:
            self.engine.wake_up()
        if self.pool is not None:
            self.pool.update_weights(
                {name: tensor for bucket in weights for name, tensor in bucket.items()}
                if not isinstance(weights, Mapping) else weights, version)
        self._call(self._refit(weights, version))

    async def _refit(self, weights: WeightUpdate, version: int) -> None:
        if self.batcher is not None:
            await self.batcher.update_weights(weights, version)
        async with self._refitted:
            self._refitted.notify_all()

    def fits(self, task: Task, source: str) -> bool:
        """Whether the task's first prompt leaves the policy room to write a turn."""
        length = prompt_length(task, self.toolboxes[source], self.tokenizer)
        return length + self.settings.max_new_tokens <= self.settings.max_context_tokens

    def check_sources(self) -> None:
        """Every source must have tasks whose prompt fits the policy's context (a probe of its
        training split); else a :class:`ConfigError` naming the source and the context."""
        for environment in self.mixture.environments:
            probe = environment.tasks("train", PROBE_TASKS, self.config.run.seed)
            if not probe:
                raise ConfigError(f"env {environment.name}: no training tasks (its train split "
                                  "is empty: see env.val_fraction and env.limit)")
            shortest = min(prompt_length(task, self.toolboxes[environment.name],
                                         self.tokenizer) for task in probe)
            if shortest + self.settings.max_new_tokens > self.settings.max_context_tokens:
                raise ConfigError(
                    f"env {environment.name}: no task's prompt fits the policy's context of "
                    f"{self.settings.max_context_tokens} tokens with rollout.max_new_tokens="
                    f"{self.settings.max_new_tokens} (the shortest of {len(probe)} takes "
                    f"{shortest} tokens: system prompt, tools and question); use a policy with "
                    "more positions (model.max_position_embeddings) or shorter tasks")

    def tasks(self, step: int, round_index: int, count: int,
              tools: list[str] | None = None) -> list[Draw]:
        """The step's tasks by source, each renamed ``s<step>r<round>-<index>`` (per-episode
        state is keyed by task id: a task drawn again later is a new episode) and offering
        ``tools`` (None: all), without those whose prompt does not fit the context (noted in
        their source's notes)."""
        seed = derive_seed(self.config.run.seed, "tasks", step, round_index)
        draws, index = [], 0
        for drawn in self.mixture.draw("train", count, seed):
            tasks = []
            for drawn_task in drawn.tasks:
                task = dataclasses.replace(drawn_task, id=f"s{step}r{round_index}-{index:05d}")
                index += 1
                if tools is not None:
                    task = dataclasses.replace(task, tools=tuple(tools))
                if self.fits(task, drawn.environment.name):
                    tasks.append(task)
                else:
                    _note_skipped(drawn.environment, drawn_task.id)
            draws.append(Draw(drawn.environment, tasks))
        return draws

    def forced_choices(self, num_tasks: int, previous: Counter) -> dict[tuple[int, int], Choice]:
        """The last ``explore_share`` of each group's samples start with the choice the policy
        made least in the ``previous`` step; each assignment counts, so they rotate."""
        size = self.settings.group_size
        per_group = round(self.config.grpo.explore_share * size)
        counts = Counter(previous)
        options = choices(self.format)
        forced = {}
        for task_index in range(num_tasks):
            for sample in range(size - per_group, size):
                choice = min(options, key=lambda option: counts[_choice_key(option)])
                counts[_choice_key(choice)] += 1
                forced[(task_index, sample)] = choice
        return forced

    def first_choice(self, trajectory: Trajectory) -> Choice | None:
        """The routing choice of the episode's first turn (None: it answered, or no call ran)."""
        if not trajectory.turns:
            return None
        calls = [call for call in trajectory.turns[0].calls if call.error is None]
        return choice_of(calls[0].tool, calls[0].arguments, self.format) if calls else None

    async def _run(self, draws: list[Draw], seed: int,
                   forced: dict[tuple[int, int], Choice]) -> list[Trajectory]:
        """Every draw's groups, each source on its toolbox, the episodes numbered across the
        step as one call would (episode ``i`` gets seed ``seed + i``)."""
        size = self.settings.group_size
        if self.pool is not None:
            return await self.pool.run(draws[0].tasks, size, seed=seed, forced_choices=forced)
        runs, start = [], 0
        for drawn in draws:
            mine = {(task - start, sample): choice for (task, sample), choice in forced.items()
                    if start <= task < start + len(drawn.tasks)}
            runs.append(run_rollouts(drawn.tasks, size, self.engine,
                                     self.toolboxes[drawn.environment.name], self.tokenizer,
                                     self.settings, seed=seed + start * size,
                                     batcher=self.batcher, forced_choices=mine,
                                     users=drawn.environment.users()))
            start += len(drawn.tasks)
        return [t for trajectories in await asyncio.gather(*runs) for t in trajectories]

    async def groups(self, step: int, round_index: int, count: int,
                     tools: list[str] | None = None,
                     previous: Counter | None = None) -> _Round:
        """One sampling round: ``count`` tasks' groups, scored, with what exploration forced
        (after the ``previous`` step's choices) and what the policy chose itself."""
        draws = self.tasks(step, round_index, count, tools)
        tasks = [task for drawn in draws for task in drawn.tasks]
        sources = [drawn.environment for drawn in draws for _ in drawn.tasks]
        seed = derive_seed(self.config.run.seed, "episodes", step, round_index)
        forced = self.forced_choices(len(tasks), previous or Counter())
        trajectories = await self._run(draws, seed, forced)
        size = self.settings.group_size
        grouped = [trajectories[i * size:(i + 1) * size] for i in range(len(tasks))]
        made: Counter = Counter()
        for task_index, group in enumerate(grouped):
            for sample, trajectory in enumerate(group):
                choice = self.first_choice(trajectory)
                if (task_index, sample) not in forced and choice is not None:
                    made[_choice_key(choice)] += 1
        # An episode a failing user endpoint ended says nothing of the policy: it leaves its
        # group (the rest keep a baseline among themselves), and a task with none left goes.
        user_errors = sum(t.termination == "user_error" for t in trajectories)
        kept = [(task, answered, environment)
                for task, group, environment in zip(tasks, grouped, sources)
                if (answered := [t for t in group if t.termination != "user_error"])]
        environments = {task.id: environment for task, _, environment in kept}
        breakdowns = await score_groups([task for task, _, _ in kept],
                                        [group for _, group, _ in kept], self.config.reward,
                                        self._outcome(environments))
        groups = [Group(task, group, scored, environment.name)
                  for (task, group, environment), scored in zip(kept, breakdowns)]
        return _Round(groups, made, len(forced), count - len(tasks), user_errors)

    def _outcome(self, environments: dict[str, Environment]) -> OutcomeFn:
        """Each task's environment scores its episodes (on Ray: the pool's scorers)."""
        if self.pool is not None:
            return by_answer(self.pool.scorer)

        async def outcome(task: Task, trajectory: Trajectory) -> OutcomeResult:
            return (await environments[task.id].score(task, trajectory)).outcome

        return outcome

    async def validate(self) -> dict[str, float]:
        """Greedy episodes on ``grpo.val_tasks`` validation tasks of each source (the same
        tasks every time): ``val/<source>/accuracy`` and ``usd_per_task``."""
        settings = dataclasses.replace(self.settings, temperature=0.0)
        metrics = {}
        for environment in self.mixture.environments:
            tasks = [dataclasses.replace(task, id=f"val-{index:05d}") for index, task in
                     enumerate(environment.tasks("validation", self.config.grpo.val_tasks,
                                                 self.config.run.seed))]
            tasks = [task for task in tasks if self.fits(task, environment.name)]
            if not tasks:
                continue
            trajectories = await run_rollouts(tasks, 1, self.engine,
                                              self.toolboxes[environment.name], self.tokenizer,
                                              settings, seed=self.config.run.seed,
                                              batcher=self.batcher, users=environment.users())
            scored = await asyncio.gather(*(environment.score(task, trajectory) for
                                            task, trajectory in zip(tasks, trajectories)))
            prefix = f"val/{environment.name}"
            metrics[f"{prefix}/accuracy"] = statistics.mean(
                float(result.outcome.correct) for result in scored)
            metrics[f"{prefix}/usd_per_task"] = statistics.mean(t.cost_usd
                                                                for t in trajectories)
            metrics[f"{prefix}/tasks"] = len(tasks)
        return metrics

    async def batch(self, step: int, tools: list[str] | None = None) -> StepBatch:
        """``step``'s batch: rounds of groups (more with dynamic sampling) until
        ``grpo.prompts_per_step`` groups are kept or the rounds run out. The policy's own
        choices become the next step's ``previous_choices``."""
        grpo = self.config.grpo
        rounds: list[_Round] = []

        async def more(count: int, round_index: int) -> list[Group]:
            rounds.append(await self.groups(step, round_index, count, tools,
                                            self.previous_choices))
            return rounds[-1].groups

        kept, stats = await fill_batch(
            more, grpo.prompts_per_step, grpo.max_sampling_rounds if grpo.dynamic_sampling else 1,
            lambda group: group_drop_reason(group.breakdowns, self.config.reward,
                                            group_baseline=grpo.algo == "grpo"))
        choices = sum((r.choices for r in rounds), Counter())
        self.previous_choices = choices
        return StepBatch(kept, [group for r in rounds for group in r.groups], stats, choices,
                         sum(r.forced_episodes for r in rounds),
                         sum(r.skipped_context for r in rounds),
                         sum(r.user_errors for r in rounds))


def build_rollouts(config: Config, tokenizer: Any, hf: dict[str, torch.Tensor],
                   logged: list[dict[str, Any]]) -> Rollouts:
    """Rank 0's :class:`Rollouts` for ``config``: its engine (or Ray pool) started from the
    policy's ``hf`` weights, its environments and their toolboxes, and the choices of the last
    ``logged`` step (a resumed run's, whose weights have had ``len(logged)`` updates), checked:
    every source has tasks that fit the context, and the curriculum names offered tools."""
    pool = (_ray_pool(config, hf, tokenizer, len(logged)) if config.rollout.backend == "ray"
            else None)
    engine = build_rollout_engine(config, hf, tokenizer) if pool is None else None
    mixture = build_mixture(config)
    toolboxes = [environment.toolbox() for environment in mixture.environments]
    previous = Counter({key.removeprefix("choices/"): count for key, count in
                        (logged[-1] if logged else {}).items() if key.startswith("choices/")})
    rollouts = Rollouts(config, engine, tokenizer, mixture, toolboxes, pool, previous,
                        version=len(logged))
    rollouts.check_sources()
    curriculum.check_tools(config.grpo.curriculum, list(toolboxes[0].tools))
    return rollouts


async def _cancel_others() -> None:
    """Cancel every task of the running loop but this one, and wait for them to end."""
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


def _choice_key(choice: Choice) -> str:
    name, arguments = choice
    return ":".join([name, *map(str, arguments.values())])


def samples_of(groups: list[Group], config: Config) -> list[Sample]:
    """Training samples: whole trajectories (observations masked) or, with
    ``grpo.sample_mode=turn``, one per turn (the prefix up to it, loss on that turn only)."""
    samples = []
    for group in groups:
        advantages = group_advantages([b.reward for b in group.breakdowns], config.reward)
        for trajectory, breakdown, advantage in zip(group.trajectories, group.breakdowns,
                                                    advantages):
            if trajectory_drop_reason(breakdown, config.reward) or not any(trajectory.loss_mask):
                continue
            ids, mask, logprobs = (trajectory.token_ids, trajectory.loss_mask,
                                   trajectory.logprobs)
            driven = (trajectory.decision_mask if config.grpo.advantage_tokens == "decisions"
                      else mask)
            sample_id = f"{trajectory.task_id}/{trajectory.sample}"
            if config.grpo.sample_mode == "trajectory":
                samples.append(Sample(ids, mask, logprobs, advantage, driven, sample_id,
                                      breakdown.reward))
                continue
            for turn, (start, end) in enumerate(_turn_spans(mask)):
                turn_mask = [1 if start <= i < end else 0 for i in range(end)]
                samples.append(Sample(ids[:end], turn_mask, logprobs[:end], advantage,
                                      [a * b for a, b in zip(turn_mask, driven)],
                                      f"{sample_id}/{turn}", breakdown.reward))
    return samples


def _turn_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for index, flag in enumerate(mask + [0]):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            spans.append((start, index))
            start = None
    return spans


def micro_batches(samples: list[Sample], micro_batch_size: int, pad_id: int,
                  one_length: bool = False) -> list[Batch]:
    """[b, s] tensors: inputs are ids[:-1], labels ids[1:], and everything per label.

    Samples are grouped by length and each micro-batch is padded to its longest, so one long
    episode does not pad the whole batch (the loss is a token mean over the global batch: the
    grouping does not change it). ``one_length``: every micro-batch gets the longest's length,
    as pipeline stages exchange activations of one shape."""
    samples = sorted(samples, key=lambda sample: len(sample.token_ids))
    step_length = padded_length(len(s.token_ids) - 1 for s in samples)
    batches = []
    for start in range(0, len(samples), micro_batch_size):
        chunk = samples[start:start + micro_batch_size]
        length = step_length if one_length else padded_length(len(s.token_ids) - 1
                                                              for s in chunk)

        def column(values: list[list[float]], fill: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([row + [fill] * (length - len(row)) for row in values],
                                dtype=dtype)

        mask = column([s.loss_mask[1:] for s in chunk], 0, torch.float)
        advantage_mask = column([s.advantage_mask[1:] for s in chunk], 0, torch.float)
        batches.append({
            "tokens": column([s.token_ids[:-1] for s in chunk], pad_id, torch.long),
            "labels": column([s.token_ids[1:] for s in chunk], pad_id, torch.long),
            "loss_mask": mask,
            "engine_logprobs": column([s.engine_logprobs[1:] for s in chunk], 0.0, torch.float),
            "advantage_mask": advantage_mask,
            "advantages": advantage_mask * torch.tensor([[s.advantage] for s in chunk]),
            "rewards": _on_last_token(mask, [s.reward for s in chunk]),
            "position_ids": torch.arange(length).repeat(len(chunk), 1),
        })
    return batches


def _on_last_token(mask: torch.Tensor, rewards: list[float]) -> torch.Tensor:
    """[b, s]: each row's reward on its last loss token, 0 elsewhere."""
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
    placed = torch.zeros_like(mask)
    placed[torch.arange(len(rewards)), last] = torch.tensor(rewards, dtype=mask.dtype)
    return placed * mask


def _even_split(samples: list[Sample], parts: int, rng: random.Random) -> list[list[Sample]]:
    """Shuffled, then cut into ``parts`` chunks of equal size (the remainder is dropped, so
    every rank and every mini-batch sees the same number of micro-batches)."""
    samples = samples[:]
    rng.shuffle(samples)
    size = len(samples) // parts
    return [samples[i * size:(i + 1) * size] for i in range(parts)]


# ----------------------------------------------------------------------------- metrics

def episode_stats(trajectories: list[Trajectory]) -> dict[str, float]:
    """USD and seconds per task, format errors per turn."""
    turns = sum(len(t.turns) for t in trajectories)
    return {
        "usd_per_task": statistics.mean(t.cost_usd for t in trajectories),
        "seconds_per_task": statistics.mean(t.tool_seconds + t.generation_seconds
                                            for t in trajectories),
        "format_error_rate": sum(sum(t.format_errors.values()) for t in trajectories)
        / max(turns, 1),
    }


def rollout_metrics(groups: list[Group], stats: Any) -> dict[str, float]:
    """Per-step means over every episode generated (kept for training or not), and reward and
    route shares per (family, preference), so a collapse onto one shortcut shows while it
    happens."""
    episodes = [(g.task, t, b) for g in groups for t, b in zip(g.trajectories, g.breakdowns)]
    if not episodes:
        return {"sampling/rounds": stats.rounds, "sampling/kept": 0}
    metrics: dict[str, float] = {
        "reward": statistics.mean(b.reward for _, _, b in episodes),
        "accuracy": statistics.mean(b.components["outcome"] for _, _, b in episodes),
        **episode_stats([t for _, t, _ in episodes]),
        "answered": statistics.mean(float(t.answer is not None) for _, t, _ in episodes),
        "turns": statistics.mean(len(t.turns) for _, t, _ in episodes),
        "sampling/rounds": stats.rounds, "sampling/generated": stats.generated,
        "sampling/kept": stats.kept,
        **{f"sampling/dropped_{reason}": count for reason, count in stats.dropped.items()},
    }
    failed = Counter(call.tool for _, t, _ in episodes for turn in t.turns for call in turn.calls
                     if call.tool is not None and call.error is not None)
    # Calls that came back with an error: refused arguments, a tool that raised or timed out,
    # an endpoint that failed; each became an error observation, not a crash.
    metrics["call_errors"] = sum(failed.values())
    metrics.update({f"call_errors/{name}": count for name, count in failed.items()})
    routes = Counter(route_of(t) for _, t, _ in episodes)
    metrics.update({f"route/{name}": count / len(episodes) for name, count in routes.items()})
    metrics.update(_source_metrics(groups))
    # The offline world's (family, preference) groups, where its tasks are.
    family = [(task, t, b) for task, t, b in episodes if "family" in task.metadata]
    rewards: dict[str, list[float]] = defaultdict(list)
    for task, _, breakdown in family:
        rewards[group_key(task)].append(breakdown.reward)
    for key, values in rewards.items():
        metrics[f"group/{key}/reward"] = statistics.mean(values)
    shares = route_shares([task for task, _, _ in family], [route_of(t) for _, t, _ in family])
    for key, routes in shares.items():
        metrics.update({f"group/{key}/route/{name}": share for name, share in routes.items()})
    return metrics


def _source_metrics(groups: list[Group]) -> dict[str, float]:
    """Per source of the mixture: its share of the episodes, reward, accuracy, USD per task
    and tool calls per episode (``source/<name>/...``)."""
    by_source: dict[str, list[tuple[Trajectory, RewardBreakdown]]] = defaultdict(list)
    for group in groups:
        by_source[group.source].extend(zip(group.trajectories, group.breakdowns))
    total = sum(len(episodes) for episodes in by_source.values())
    metrics: dict[str, float] = {}
    for source, episodes in sorted(by_source.items()):
        prefix = f"source/{source}"
        metrics[f"{prefix}/share"] = len(episodes) / total
        metrics[f"{prefix}/reward"] = statistics.mean(b.reward for _, b in episodes)
        metrics[f"{prefix}/accuracy"] = statistics.mean(b.components["outcome"]
                                                        for _, b in episodes)
        metrics[f"{prefix}/usd_per_task"] = statistics.mean(t.cost_usd for t, _ in episodes)
        calls: Counter = Counter()
        for trajectory, _ in episodes:
            calls.update(trajectory.tool_counts())
        metrics.update({f"{prefix}/tool/{name}": count / len(episodes)
                        for name, count in calls.items()})
    return metrics


# ----------------------------------------------------------------------------- the loop

def _start(policy: Policy, config: Config) -> checkpoint.Checkpoint | None:
    """Resume from this stage's latest checkpoint (returned), or start from
    ``trainer.init_from`` (the SFT checkpoint, or an HF directory; None returned)."""
    latest = checkpoint.latest_checkpoint(checkpoint.checkpoints_dir(config))
    if latest is not None:
        checkpoint.load(latest, policy.module, policy.optimizer, policy.scheduler)
        log.info("resumed GRPO from %s", latest.path)
        return latest
    load_start_weights(policy.module, config.model, Path(config.trainer.init_from))
    policy.optimizer.reload_model_params()
    return None


def run(config: Config) -> GRPOSummary:
    """GRPO from ``trainer.init_from`` into ``config.run.dir``, in its own process group."""
    with distributed.parallel_session(config.parallel, config.run.seed) as context:
        return train(config, context)


def start_model(config: Config, command: str = "grpo") -> Config:
    """``config`` starting from its resolved starting point (:func:`start_point`: the
    checkpoint or HF directory in ``trainer.init_from``, the tokenizer in ``tokenizer.path``),
    with the architecture of those weights (an HF directory's ``config.json``, or the model
    section a nemo-orch checkpoint saved): the weights decide the shape, so ``model.*`` need not
    repeat it; the fields taken are logged. ``command``: the ``nemo-orch`` command an error
    names."""
    init_from, tokenizer_dir = start_point(config, command)
    architecture = start_architecture(init_from, config.model)
    changed = [f"{name} {getattr(config.model, name)} -> {value}"
               for name, value in architecture.items() if getattr(config.model, name) != value]
    if changed:
        log.info("model.* from the starting weights %s: %s", init_from, ", ".join(changed))
    tokenizer = dataclasses.replace(config.tokenizer, path=str(tokenizer_dir),
                                    vocab_size=len(load_tokenizer(tokenizer_dir)))
    return config_lib.replace(config, model=dataclasses.replace(config.model, **architecture),
                              tokenizer=tokenizer, trainer=dataclasses.replace(
                                  config.trainer, init_from=str(init_from)))


def start_point(config: Config, command: str = "grpo") -> tuple[Path, Path]:
    """``nemo-orch grpo``'s (or ``command``'s) starting weights (``trainer.init_from``) and the
    tokenizer their token ids belong to: the checkpoint's own, the HF directory's, else
    ``tokenizer.path``."""
    if config.trainer.init_from is None:
        raise ConfigError(f"nemo-orch {command} needs trainer.init_from: a nemo-orch checkpoint "
                          "(e.g. runs/tiny-sft/sft/checkpoints) or an HF model directory")
    source = Path(config.trainer.init_from)
    if (source / "tokenizer.json").is_file():
        return source, source
    if not (source / "config.json").is_file():
        opened = checkpoint.open_checkpoint(source)
        if (opened.tokenizer_path / "tokenizer.json").is_file():
            return opened.path, opened.tokenizer_path
        source = opened.path
    if config.tokenizer.path is None:
        raise ConfigError(f"trainer.init_from={source} has no tokenizer: set tokenizer.path")
    return source, Path(config.tokenizer.path)


def train(config: Config, context: ParallelContext) -> GRPOSummary:
    """GRPO inside a running parallel session (see :func:`run`), from ``trainer.init_from`` with
    the tokenizer of ``config.tokenizer_dir``."""
    _check_backend(config)
    config = policy_config(config)
    grpo = config.grpo
    distributed.set_intra_op_threads(config.trainer.num_threads)
    tokenizer = load_tokenizer(config.tokenizer_dir)
    policy = Policy(config, context)
    resumed = _start(policy, config)
    start_step = resumed.step if resumed is not None else 0
    reference = ReferenceModel(config, context)
    # The reference is the stage's starting point (the SFT policy), also on resume.
    load_start_weights(reference.module, config.model, Path(config.trainer.init_from))
    critic = (ppo.start_critic(config, context, resumed.step if resumed is not None else None)
              if grpo.algo == "ppo" else None)
    hf = weights.gather_hf_weights(policy.module, config.model,
                                   config.rollout.refit_bucket_mb)
    # What a resumed run needs from the steps before it: every step's mean reward (the
    # curriculum's stage depends on them) and the last step's choices (exploration's).
    logged = logged_steps(config.run.dir, start_step)
    history = [record.get("reward", math.nan) for record in logged]
    # Rank 0 rolls out; every rank trains on what it broadcasts.
    rollouts = build_rollouts(config, tokenizer, hf, logged) if distributed.is_writer() else None
    metrics = MetricsLogger.for_stage(config, grpo.algo, enabled=context.is_logging_rank,
                                      start_step=start_step, max_steps=grpo.max_steps,
                                      shown=("reward", "kl", "loss"))
    # PPO with the KL in the reward: none in the policy loss.
    loss_fn = grpo_token_loss(dataclasses.replace(grpo, kl_coef=0.0) if grpo.ppo is not None
                              and grpo.ppo.use_kl_in_reward else grpo)
    rewards, saved = [], resumed.path if resumed is not None else None
    before_update = None  # the weights before the last update (with grpo.kl_guard)
    ahead = grpo.async_grpo.enabled
    trained_log = TrainedLog(config.run.dir, start_step, enabled=distributed.is_writer())
    preemption.listen()
    with rollouts or contextlib.nullcontext(), contextlib.closing(metrics):
        if rollouts is not None and ahead:
            rollouts.run_ahead(start_step + 1, grpo.max_steps,
                               lambda: curriculum.stage_tools(grpo.curriculum, history))
        for step in range(start_step + 1, grpo.max_steps + 1):
            faults.maybe_kill("step", step)
            started = time.perf_counter()
            shared = [None]
            if rollouts is not None:
                batch = (rollouts.take(step) if ahead else
                         rollouts.step(step, curriculum.stage_tools(grpo.curriculum, history)))
                shared = [(samples_of(batch.kept, config), {
                    **batch.metrics(),
                    "curriculum/stage": curriculum.stage_index(grpo.curriculum, history)})]
                trained_log.add(step, [sample.sample_id for sample in shared[0][0]],
                                [group.task.id for group in batch.dropped_stale])
                rollouts.sleep()
            if dist.get_world_size() > 1:
                dist.broadcast_object_list(shared, src=0)
            samples, step_metrics = shared[0]
            rollout_seconds = time.perf_counter() - started

            train_started = time.perf_counter()
            start = policy.copy_weights() if grpo.kl_guard is not None else None
            trained = _update(policy, reference, loss_fn, samples, config, step,
                              context.dp_rank, tokenizer.pad_token_id, rollback=before_update,
                              critic=critic)
            if "skipped_update" not in trained:  # what the guard rolls back to
                before_update = start
            train_seconds = time.perf_counter() - train_started

            step_metrics.update(trained)
            step_metrics.update({"time/rollout_s": rollout_seconds,
                                 "time/train_s": train_seconds,
                                 "samples": len(samples)})
            # Before the refit: rollouts run ahead read the curriculum's stage from it.
            history.append(step_metrics.get("reward", math.nan))
            refit_started = time.perf_counter()
            stream = weights.hf_weight_buckets(policy.module, config.model,
                                               config.rollout.refit_bucket_mb << 20)
            if rollouts is not None:
                rollouts.refit(stream, version=step)
            else:
                for _ in stream:  # the other ranks send their shards (rank 0 yields buckets)
                    pass
            step_metrics["time/refit_s"] = time.perf_counter() - refit_started
            step_metrics["time/step_s"] = time.perf_counter() - started
            metrics.log(step, step_metrics)
            if "reward" in step_metrics:
                rewards.append(step_metrics["reward"])
            stopping = step < grpo.max_steps and preemption.agreed()
            if step % grpo.save_interval == 0 or step == grpo.max_steps or stopping:
                if critic is not None:
                    ppo.save_critic(config, step, critic)
                saved = checkpoint.save(config, step, policy.module, policy.optimizer,
                                        policy.scheduler, tokenizer_dir=config.tokenizer_dir)
            if stopping:
                raise preemption.StopRequested(step, saved)
    return GRPOSummary(start_step, max(start_step, grpo.max_steps),
                       rewards[0] if rewards else None, rewards[-1] if rewards else None,
                       saved, config.run.dir)


def _stopped(config: Config, step: int, error: HTTPError) -> str:
    """Why the run stopped in ``step`` and where running it again resumes."""
    latest = checkpoint.latest_checkpoint(checkpoint.checkpoints_dir(config))
    resumes = (f"from {latest.path} (step {latest.step})" if latest is not None
               else "from the start (no step was checkpointed)")
    return (f"GRPO stopped in step {step}: {error}. Run the same command again to resume "
            f"{resumes}.")


def _check_backend(config: Config) -> None:
    """What runs only on one source of declared tools: Ray's workers build the configured
    tools (no domain's, no tau2's), and exploration forces choices of one toolbox."""
    sources = config.env.source_list()
    if config.rollout.backend == "ray" and (len(sources) > 1 or sources[0].kind not in (
            "offline", "qa", "tasks")):
        raise ConfigError("rollout.backend=ray runs one environment with declared tools only "
                          "(env=offline|qa|tasks); use rollout.backend=local for "
                          f"env={config.env.label}")
    if config.grpo.explore_share > 0 and len(sources) > 1:
        raise ConfigError("grpo.explore_share forces routing choices of one toolbox: it needs a "
                          "single environment, not a mixture")


def _ray_pool(config: Config, hf: dict[str, torch.Tensor], tokenizer: Any,
              version: int) -> "RayRolloutPool":
    """The Ray rollout pool (imported only then: Ray is heavy), its engines built from ``hf``
    (after ``version`` updates)."""
    from nemo_orch.rollout import ray_workers

    return ray_workers.build_ray_pool(config, ray_workers.weights_engine(config, tokenizer), hf,
                                      version=version)


def _update(policy: Policy, reference: ReferenceModel, loss_fn: Any, samples: list[Sample],
            config: Config, step: int, dp_rank: int, pad_id: int,
            rollback: list[torch.Tensor] | None = None,
            critic: Critic | None = None) -> dict[str, float]:
    """``updates_per_step`` passes of ``mini_batches`` optimizer steps over this DP rank's share
    of the samples, with old and reference logprobs computed before the first update; none with
    ``grpo.kl_guard`` passed by the samples' mean KL to the reference before it
    (``kl_guard/skipped``), and then the policy goes back to the ``rollback`` weights (those
    before the update that produced the samples' policy; ``kl_guard/rolled_back``).

    With PPO's ``critic``: its values before the update give GAE advantages and value targets
    (:func:`ppo.attach_advantages`), and each optimizer step of the policy is followed by one of
    the critic on the same micro-batches (only the critic's in the first
    ``grpo.ppo.critic_warmup_steps`` steps). A step the guard skips trains neither; its
    rollback restores the policy only (the critic learned values, not a policy that jumped)."""
    grpo, dp = config.grpo, config.parallel.dp
    if len(samples) < grpo.mini_batches * dp * grpo.micro_batch_size:
        return {"skipped_update": 1.0}
    kl_in_reward = critic is not None and grpo.ppo.use_kl_in_reward
    # The trainer's old logprobs, unless the engine's are the old ones or, with one update per
    # batch, this pass's own detached values are (see grpo_loss): that saves a forward pass.
    trainer_old = grpo.old_logprobs == "trainer" and not (
        grpo.updates_per_step == 1 and grpo.mini_batches == 1)
    guarded = grpo.kl_guard is not None
    kl_sums = torch.zeros(2, dtype=torch.float64)  # the guard's KL sum and token count
    minis = []
    split = random.Random(derive_seed(config.run.seed, "mini", step))
    for mini in _even_split(samples, grpo.mini_batches, split):
        mine = _even_split(mini, dp, random.Random(0))[dp_rank]
        mine = mine[:len(mine) // grpo.micro_batch_size * grpo.micro_batch_size]
        batches = micro_batches(mine, grpo.micro_batch_size, pad_id,
                                one_length=config.parallel.pp > 1)
        none = [None] * len(batches)
        olds = (policy.forward_logprobs(batches) if trainer_old or guarded or kl_in_reward
                else none)
        refs = reference.forward_logprobs(batches) if grpo.kl_coef > 0 or guarded else none
        values = critic.forward_values(batches) if critic is not None else none
        for batch, old, ref, value in zip(batches, olds, refs, values):
            # None off the last pipeline stage
            if grpo.old_logprobs == "engine":
                batch["old_logprobs"] = batch["engine_logprobs"]
            elif old is not None and trainer_old:
                batch["old_logprobs"] = old
            if ref is not None and not kl_in_reward:
                batch["ref_logprobs"] = ref
            if value is not None:
                batch["values"] = value
            kl = (kl_penalty(old, ref, grpo.kl_type) if old is not None and ref is not None
                  and (kl_in_reward or guarded) else None)
            if kl_in_reward and kl is not None:
                batch["reward_kl"] = kl
            if guarded and kl is not None:
                mask = batch["loss_mask"]
                kl_sums += torch.stack([(kl * mask).sum(), mask.sum()]).double()
        minis.append(batches)
    guard: dict[str, float] = {}
    if guarded:
        # Every rank decides alike: the sums of all ranks (a tensor-parallel group's ranks hold
        # the same tokens, which leaves the mean as it is; other pipeline stages hold none).
        if dist.is_initialized():
            dist.all_reduce(kl_sums)
        guard["kl_guard/kl"] = float(kl_sums[0] / kl_sums[1]) if kl_sums[1] > 0 else 0.0
        if guard["kl_guard/kl"] > grpo.kl_guard:
            if rollback is not None:
                policy.restore_weights(rollback)
                guard["kl_guard/rolled_back"] = 1.0
            return {**guard, "kl_guard/skipped": 1.0, "skipped_update": 1.0}
    totals: dict[str, list[float]] = defaultdict(list)
    if critic is not None:
        for key, value in ppo.attach_advantages(minis, critic, grpo.ppo, grpo.kl_coef).items():
            totals[key].append(value)
    trains_policy = critic is None or step > grpo.ppo.critic_warmup_steps
    value_loss = ppo.value_loss(grpo.ppo) if critic is not None else None
    tokens = 0
    for _ in range(grpo.updates_per_step):
        for batches in minis:
            tokens += sum(batch["tokens"].numel() for batch in batches) * dp
            if trains_policy:
                result = policy.train_step(batches, loss_fn)
                totals["loss"].append(result.loss)
                totals["grad_norm"].append(result.grad_norm)
                totals["lr"].append(result.lr)
                for key, value in result.metrics.items():
                    totals[key].append(value)
            if critic is not None:
                result = critic.train_step(batches, value_loss)
                totals["critic/grad_norm"].append(result.grad_norm)
                for key, value in result.metrics.items():
                    totals[key].append(value)
    return {**{key: statistics.mean(values) for key, values in totals.items()},
            "tokens": tokens, **guard}
