"""GRPO's rollouts: rank 0's side of a step. :class:`Rollouts` owns the engine (or the Ray
pool), the environments and the reward; it draws each step's tasks, rolls their groups out,
scores and filters them (a :class:`~nemo_orch.train.grpo_groups.StepBatch`), refits the engine
after each update, and rolls steps out ahead for asynchronous GRPO. The trainer's side is
:mod:`nemo_orch.train.grpo`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nemo_orch.call_kinds import InfrastructureError
from nemo_orch.clients.http import HTTPError
from nemo_orch.config import Config, ConfigError
from nemo_orch.data.tasks import Task
from nemo_orch.envs import Environment, Mixture, build_mixture
from nemo_orch.envs.mixture import Draw
from nemo_orch.loop_thread import LoopThread
from nemo_orch.models import checkpoint
from nemo_orch.reward.advantages import fill_batch, group_drop_reason
from nemo_orch.reward.outcome import OutcomeResult
from nemo_orch.reward.scoring import OutcomeFn, by_answer, infra_failure, score_groups
from nemo_orch.rollout import journal
from nemo_orch.rollout.builders import build_rollout_engine
from nemo_orch.rollout.engines.base import Sleepable, WeightUpdate
from nemo_orch.rollout.external import external_agents
from nemo_orch.rollout.format import Choice, TurnFormat, choice_of, choices
from nemo_orch.rollout.opening import prompt_length
from nemo_orch.rollout.runner import GenerationBatcher, run_rollouts
from nemo_orch.rollout.trajectory import Trajectory
from nemo_orch.seeding import derive_seed
from nemo_orch.train import curriculum
from nemo_orch.train.grpo_groups import Group, StepBatch, environment_metrics
from nemo_orch.train.metrics import IdleClock

if TYPE_CHECKING:  # Ray loads only for rollout.backend=ray
    from nemo_orch.rollout.ray_workers import RayRolloutPool

log = logging.getLogger(__name__)

# Training tasks per source whose prompts are measured before the first step: a source none of
# whose prompts fits the policy's context is an error, not a run that trains on nothing.
PROBE_TASKS = 64

# <run>/notes.json: each source's notes; those of a prompt too long for the context name at most
# NOTED_TASKS task ids.
NOTES, SKIPPED_CONTEXT, NOTED_TASKS = "notes.json", "skipped_context", 10


def _note_skipped(environment: Environment, task_id: str) -> None:
    """Count a task whose prompt does not fit the policy's context in its environment's notes
    (with the first few ids)."""
    skipped = environment.notes.setdefault(SKIPPED_CONTEXT, {"count": 0, "tasks": []})
    skipped["count"] += 1
    if len(skipped["tasks"]) < NOTED_TASKS:
        skipped["tasks"].append(task_id)


@dataclass
class _Round:
    """One sampling round of a step (see :meth:`Rollouts.groups`)."""

    groups: list[Group]
    choices: Counter
    forced_episodes: int
    skipped_context: int


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

    def __init__(
        self,
        config: Config,
        engine: Any,
        tokenizer: Any,
        mixture: Mixture,
        toolboxes: list[Any],
        pool: RayRolloutPool | None = None,
        previous_choices: Counter | None = None,
        version: int = 0,
    ) -> None:
        self.config, self.engine, self.tokenizer, self.pool = config, engine, tokenizer, pool
        self.mixture, self.toolboxes = (
            mixture,
            dict(zip((environment.name for environment in mixture.environments), toolboxes)),
        )
        self.settings = config.resolved_rollout()
        self.format = TurnFormat.for_tools(toolboxes[0].schemas())
        self.previous_choices = previous_choices or Counter()
        # A colocated GPU engine gives the GPUs back while the policy trains (RolloutConfig).
        self.colocated = config.rollout.colocate and isinstance(engine, Sleepable)
        # One batcher for the run: its engine calls and weight updates take turns.
        self.batcher = (
            None
            if pool is not None
            else GenerationBatcher(
                engine, self.settings.max_batch_size, version, config.rollout.engine_threads
            )
        )
        self._loop: LoopThread | None = None  # started on entering
        self._refitted = asyncio.Condition()  # run_ahead waits on it for fresh enough weights
        self._ahead: dict[int, asyncio.Task] = {}  # run_ahead's rollouts by step
        self._idle = IdleClock()  # when no step of run_ahead's is rolling out
        self.agents = external_agents(config.rollout, config.run.name)  # None: the built-in loop
        self._journal = ExitStack()  # the episodes' (grpo.journal)

    def __enter__(self) -> Rollouts:
        self._journal.enter_context(journal.of_stage(self.config))
        self._loop = LoopThread("rollouts")
        self._call(self._each("start"))
        return self

    def __exit__(self, *exc: object) -> None:
        (self.config.run.dir / NOTES).write_text(
            json.dumps(
                {environment.name: environment.notes for environment in self.mixture.environments},
                indent=1,
                default=str,
            )
            + "\n"
        )
        try:
            self._call(self._each("close"))
        finally:
            # Also cancels what is still running: batches rolled out ahead, the scoring
            # requests of a batch whose first one failed for good.
            self._call(_cancel_others())
            self._loop.stop()
            self._journal.close()

    def _call(self, coroutine: Any) -> Any:
        """Run ``coroutine`` on the rollout loop and wait for its result."""
        return self._loop.run(coroutine)

    async def _each(self, method: str) -> None:
        """``start`` or ``close`` the pool, else every toolbox (on Ray the tools run in the
        workers' executors) and, when closing, the batcher."""
        if self.pool is not None:
            await getattr(self.pool, method)()
            return
        await asyncio.gather(*(getattr(toolbox, method)() for toolbox in self.toolboxes.values()))
        if self.agents is not None:
            await (
                self.agents.start(self.config.run.dir) if method == "start" else self.agents.close()
            )
        if method == "close":
            await self.batcher.close()

    @property
    def version(self) -> int | None:
        """The update count behind the engine's (or the pool's) weights."""
        return self.pool.version if self.batcher is None else self.batcher.version

    def step(self, step: int, tools: list[str] | None) -> StepBatch:
        """Roll out, score and filter ``step``'s batch offering ``tools`` (None: all), and
        validate every ``grpo.val_interval`` steps. A reward server gone past its retries stops
        the run with an :class:`HTTPError` saying where it resumes; so does a step more of
        whose episodes than ``rollout.max_infra_error_rate`` were decided by infrastructure
        failures (an :class:`~nemo_orch.call_kinds.InfrastructureError` naming them)."""
        try:
            return self._call(self._step(step, tools))
        except (HTTPError, InfrastructureError) as error:
            raise _stopped(self.config, step, error) from None

    async def _step(self, step: int, tools: list[str] | None) -> StepBatch:
        batch = await self.batch(step, tools)
        interval = self.config.grpo.val_interval
        if interval and step % interval == 0:
            batch.validation = await self.validate()
        return batch

    def run_ahead(
        self, first_step: int, last_step: int, tools: Callable[[], list[str] | None]
    ) -> None:
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
        except (HTTPError, InfrastructureError) as error:
            raise _stopped(self.config, step, error) from None
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
                if not isinstance(weights, Mapping)
                else weights,
                version,
            )
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
                raise ConfigError(
                    f"env {environment.name}: no training tasks (its train split "
                    "is empty: see env.val_fraction and env.limit)"
                )
            shortest = min(
                prompt_length(task, self.toolboxes[environment.name], self.tokenizer)
                for task in probe
            )
            if shortest + self.settings.max_new_tokens > self.settings.max_context_tokens:
                raise ConfigError(
                    f"env {environment.name}: no task's prompt fits the policy's context of "
                    f"{self.settings.max_context_tokens} tokens with rollout.max_new_tokens="
                    f"{self.settings.max_new_tokens} (the shortest of {len(probe)} takes "
                    f"{shortest} tokens: system prompt, tools and question); use a policy with "
                    "more positions (model.max_position_embeddings) or shorter tasks"
                )

    def tasks(
        self, step: int, round_index: int, count: int, tools: list[str] | None = None
    ) -> list[Draw]:
        """The step's tasks by source, each renamed ``s<step>r<round>-<index>`` (per-episode
        state is keyed by task id: a task drawn again later is a new episode) and offering
        ``tools`` (None: all), without those whose prompt does not fit the context (noted in
        their source's notes)."""
        seed = derive_seed(self.config.run.seed, "tasks", step, round_index)
        draws, index = [], 0
        for drawn in self.mixture.draw("train", count, seed):
            tasks = []
            for drawn_task in self._sets(drawn):
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

    def _sets(self, drawn: Draw) -> list[Task]:
        """A source's drawn tasks; with ``grpo.preference_sets`` each under every preference
        its environment states, as many as it drew (its share of the step stays)."""
        if not self.config.grpo.preference_sets:
            return drawn.tasks
        return [
            task
            for drawn_task in drawn.tasks
            for task in drawn.environment.under_each_preference(drawn_task)
        ][: len(drawn.tasks)]

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

    async def _run(
        self, draws: list[Draw], seed: int, forced: dict[tuple[int, int], Choice]
    ) -> list[Trajectory]:
        """Every draw's groups, each source on its toolbox, the episodes numbered across the
        step as one call would (episode ``i`` gets seed ``seed + i``)."""
        size = self.settings.group_size
        if self.pool is not None:
            return await self.pool.run(
                draws[0].tasks,
                size,
                seed=seed,
                forced_choices=forced,
                explore_models=self.config.grpo.explore_models,
            )
        runs, start = [], 0
        for drawn in draws:
            mine = {
                (task - start, sample): choice
                for (task, sample), choice in forced.items()
                if start <= task < start + len(drawn.tasks)
            }
            runs.append(
                run_rollouts(
                    drawn.tasks,
                    size,
                    self.engine,
                    self.toolboxes[drawn.environment.name],
                    self.tokenizer,
                    self.settings,
                    seed=seed + start * size,
                    batcher=self.batcher,
                    forced_choices=mine,
                    explore_models=self.config.grpo.explore_models,
                    users=drawn.environment.users(),
                    agent=self.agents,
                )
            )
            start += len(drawn.tasks)
        return [t for trajectories in await asyncio.gather(*runs) for t in trajectories]

    async def groups(
        self,
        step: int,
        round_index: int,
        count: int,
        tools: list[str] | None = None,
        previous: Counter | None = None,
    ) -> _Round:
        """One sampling round: ``count`` tasks' groups, scored, with what exploration forced
        (after the ``previous`` step's choices) and what the policy chose itself."""
        draws = self.tasks(step, round_index, count, tools)
        tasks = [task for drawn in draws for task in drawn.tasks]
        sources = [drawn.environment for drawn in draws for _ in drawn.tasks]
        seed = derive_seed(self.config.run.seed, "episodes", step, round_index)
        forced = self.forced_choices(len(tasks), previous or Counter())
        trajectories = await self._run(draws, seed, forced)
        size = self.settings.group_size
        grouped = [trajectories[i * size : (i + 1) * size] for i in range(len(tasks))]
        made: Counter = Counter()
        for task_index, group in enumerate(grouped):
            for sample, trajectory in enumerate(group):
                choice = self.first_choice(trajectory)
                if (task_index, sample) not in forced and choice is not None:
                    made[_choice_key(choice)] += 1
        # An episode a failure outside the policy decided leaves its group (the rest keep a
        # baseline among themselves; a group left with none is dropped, and refilled by
        # dynamic sampling where it is on).
        environments = {task.id: environment for task, environment in zip(tasks, sources)}
        scored = await score_groups(tasks, grouped, self.config.reward, self._outcome(environments))
        groups = [
            Group.of(task, group, environment.name)
            for task, group, environment in zip(tasks, scored, sources)
        ]
        return _Round(groups, made, len(forced), count - len(tasks))

    def _outcome(self, environments: dict[str, Environment]) -> OutcomeFn:
        """Each task's environment scores its episodes (on Ray: the pool's scorers)."""
        if self.pool is not None:
            return by_answer(self.pool.scorer)

        async def outcome(task: Task, trajectory: Trajectory) -> OutcomeResult:
            return (await environments[task.id].score(task, trajectory)).outcome

        return outcome

    async def validate(self) -> dict[str, float]:
        """Greedy episodes on ``grpo.val_tasks`` validation tasks of each source (the same
        tasks every time): ``val/<source>/accuracy`` and ``usd_per_task`` over the episodes no
        failure outside the policy decided, and how many one did (``infra_decided``)."""
        settings = dataclasses.replace(self.settings, temperature=0.0)
        metrics = {}
        for environment in self.mixture.environments:
            tasks = [
                dataclasses.replace(task, id=f"val-{index:05d}")
                for index, task in enumerate(
                    environment.tasks(
                        "validation", self.config.grpo.val_tasks, self.config.run.seed
                    )
                )
            ]
            tasks = [task for task in tasks if self.fits(task, environment.name)]
            if not tasks:
                continue
            trajectories = await run_rollouts(
                tasks,
                1,
                self.engine,
                self.toolboxes[environment.name],
                self.tokenizer,
                settings,
                seed=self.config.run.seed,
                batcher=self.batcher,
                users=environment.users(),
                agent=self.agents,
            )
            scored = await asyncio.gather(
                *(
                    environment.score(task, trajectory)
                    for task, trajectory in zip(tasks, trajectories)
                )
            )
            prefix = f"val/{environment.name}"
            decided = [
                infra_failure(t, result.outcome) is not None
                for t, result in zip(trajectories, scored)
            ]
            kept = [(t, result) for t, result, out in zip(trajectories, scored, decided) if not out]
            metrics[f"{prefix}/tasks"] = len(tasks)
            metrics[f"{prefix}/infra_decided"] = sum(decided)
            if kept:
                metrics[f"{prefix}/accuracy"] = statistics.mean(
                    float(result.outcome.correct) for _, result in kept
                )
                metrics[f"{prefix}/usd_per_task"] = statistics.mean(t.cost_usd for t, _ in kept)
        return metrics

    async def batch(self, step: int, tools: list[str] | None = None) -> StepBatch:
        """``step``'s batch: rounds of groups (more with dynamic sampling) until
        ``grpo.prompts_per_step`` groups are kept or the rounds run out. The policy's own
        choices become the next step's ``previous_choices``."""
        grpo = self.config.grpo
        rounds: list[_Round] = []

        async def more(count: int, round_index: int) -> list[Group]:
            rounds.append(await self.groups(step, round_index, count, tools, self.previous_choices))
            return rounds[-1].groups

        kept, stats = await fill_batch(
            more,
            grpo.prompts_per_step,
            grpo.max_sampling_rounds if grpo.dynamic_sampling else 1,
            lambda group: group_drop_reason(
                group.breakdowns, self.config.reward, group_baseline=grpo.algo == "grpo"
            ),
        )
        choices = sum((r.choices for r in rounds), Counter())
        self.previous_choices = choices
        generated = [group for r in rounds for group in r.groups]
        batch = StepBatch(
            kept,
            generated,
            stats,
            choices,
            sum(r.forced_episodes for r in rounds),
            sum(r.skipped_context for r in rounds),
            environment_metrics(self.mixture.environments, generated, kept, self.config.reward),
        )
        batch.check_infrastructure(step, self.settings.max_infra_error_rate)
        return batch


def build_rollouts(
    config: Config, tokenizer: Any, hf: dict[str, torch.Tensor], logged: list[dict[str, Any]]
) -> Rollouts:
    """Rank 0's :class:`Rollouts` for ``config``: its engine (or Ray pool) started from the
    policy's ``hf`` weights, its environments and their toolboxes, and the choices of the last
    ``logged`` step (a resumed run's, whose weights have had ``len(logged)`` updates), checked:
    every source has tasks that fit the context, and the curriculum names offered tools."""
    pool = (
        _ray_pool(config, hf, tokenizer, len(logged)) if config.rollout.backend == "ray" else None
    )
    engine = build_rollout_engine(config, hf, tokenizer) if pool is None else None
    mixture = build_mixture(config)
    toolboxes = [environment.toolbox() for environment in mixture.environments]
    previous = Counter(
        {
            key.removeprefix("choices/"): count
            for key, count in (logged[-1] if logged else {}).items()
            if key.startswith("choices/")
        }
    )
    rollouts = Rollouts(
        config, engine, tokenizer, mixture, toolboxes, pool, previous, version=len(logged)
    )
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


def _stopped(
    config: Config, step: int, error: HTTPError | InfrastructureError
) -> HTTPError | InfrastructureError:
    """``error`` again, saying that the run stopped in ``step`` and where running it again
    resumes."""
    latest = checkpoint.latest_checkpoint(checkpoint.checkpoints_dir(config))
    resumes = (
        f"from {latest.path} (step {latest.step})"
        if latest is not None
        else "from the start (no step was checkpointed)"
    )
    message = (
        f"GRPO stopped in step {step}: {error}. Run the same command again to resume {resumes}."
    )
    return (
        HTTPError(message, error.status)
        if isinstance(error, HTTPError)
        else InfrastructureError(message)
    )


def _ray_pool(
    config: Config, hf: dict[str, torch.Tensor], tokenizer: Any, version: int
) -> RayRolloutPool:
    """The Ray rollout pool (imported only then: Ray is heavy), its engines built from ``hf``
    (after ``version`` updates)."""
    from nemo_orch.rollout import ray_workers

    return ray_workers.build_ray_pool(
        config, ray_workers.weights_engine(config, tokenizer), hf, version=version
    )
