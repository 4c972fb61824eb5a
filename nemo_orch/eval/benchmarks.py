"""The benchmarks an evaluation runs: tasks, the tools they run with, how an episode is scored,
and, where gold actions exist, the gold plan.

* ``offline``: the main job's held-out tasks (``eval.tasks``), each with a preference vector;
  scored by the reward protocol; preference adherence against the oracle of the simulated
  experts.
* ``toolscale``: domain tasks written by ``nemo-orch synth`` (``eval.data``, one domain or all);
  tasks failing the validation filters are dropped and listed, never scored; scored on the
  database the episode leaves.
* ``tau2``: a tau2-bench domain's split (extra ``tau2``), scored by tau2's own evaluator on the
  calls that reached its environment.
* ``hle``, ``frames``: a local JSONL or parquet file (:mod:`nemo_orch.data.qa_benchmarks`);
  scored by the judge protocol (exact or numeric match first, then the LLM judge of
  ``reward.judge_*``; a judge failure is counted, not silently scored wrong).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_orch.config import Config, ConfigError
from nemo_orch.data.domain_tasks import DomainTask
from nemo_orch.data.environment import held_out_tasks
from nemo_orch.data.tasks import Task
from nemo_orch.eval.agents import GoldAction, GoldPlan, final_message
from nemo_orch.reward.outcome import OutcomeResult
from nemo_orch.rollout.episode import Trajectory, episode_id
from nemo_orch.tools.registry import Toolbox


@dataclass(frozen=True)
class Scored:
    """An episode's outcome and what the benchmark's scorer says beyond it (e.g. tau2's
    breakdown)."""

    outcome: OutcomeResult
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Benchmark:
    """``toolbox()`` builds the tools an agent runs with (not yet started); ``score`` scores a
    finished episode; ``notes`` say what was left out and why."""

    name: str
    tasks: list[Task]
    toolbox: Callable[[], Toolbox]
    score: Callable[[Task, Trajectory], Awaitable[Scored]]
    notes: dict[str, Any] = field(default_factory=dict)
    user_toolbox: Callable[[], Toolbox] | None = None
    gold_plan: Callable[[Task], GoldPlan] | None = None
    preferences: bool = False  # tasks carry preference vectors: report adherence


def load_benchmark(config: Config, name: str) -> Benchmark:
    """The benchmark ``name`` as configured by ``eval.*``."""
    loaders = {"offline": _offline, "toolscale": _toolscale, "tau2": _tau2, "hle": _qa,
               "frames": _qa}
    if name not in loaders:
        raise ConfigError(f"unknown benchmark {name!r}; benchmarks: {', '.join(loaders)}")
    return loaders[name](config, name)


def _outcome_scorer(config: Config) -> Callable[[Task, Trajectory], Awaitable[Scored]]:
    from nemo_orch.rollout.builders import build_scorer

    scorer = build_scorer(config, judge_in_flight=config.eval.max_requests_per_endpoint)

    async def score(task: Task, trajectory: Trajectory) -> Scored:
        return Scored(await scorer.score(task, trajectory.answer, trajectory.calls()))

    return score


def _tools(config: Config) -> Callable[[], Toolbox]:
    from nemo_orch.rollout.builders import build_toolbox

    return lambda: build_toolbox(config.tools)


def _offline(config: Config, name: str) -> Benchmark:
    tasks = held_out_tasks(config.eval.tasks, config.run.seed)[:config.eval.limit]
    return Benchmark(name, tasks, _tools(config), _outcome_scorer(config), preferences=True)


def _toolscale(config: Config, name: str) -> Benchmark:
    from nemo_orch.eval.toolscale import load_rows

    directory = Path(config.eval.data or config.synth.out_dir)
    if config.eval.domain is not None:
        names = [config.eval.domain]
    else:
        names = sorted(folder.name for folder in directory.glob("*/")
                       if (folder / "domain.json").is_file())
        if not names:
            raise ConfigError(f"{directory}: no domains (write them with `nemo-orch synth`)")
    loaded = [load_rows(directory, domain, config.eval.limit) for domain in names]
    config = dataclasses.replace(config, tools=dataclasses.replace(
        config.tools, domains=[*config.tools.domains,
                               *(str(domain.domain_file) for domain in loaded)]))

    return Benchmark(name, [row for domain in loaded for row in domain.rows], _tools(config),
                     _outcome_scorer(config),
                     notes={"dropped": [rejection for domain in loaded for rejection in
                                        domain.validation.to_json()["rejections"]]},
                     gold_plan=toolscale_gold_plan)


def toolscale_gold_plan(task: Task) -> GoldPlan:
    """A domain task row's gold actions and its facts."""
    gold = DomainTask.model_validate(task.metadata["domain_task"])
    return GoldPlan([GoldAction("assistant", a.name, a.arguments) for a in gold.gold_actions],
                    final_message(gold.facts))


def tau2_gold_plan(task: Task) -> GoldPlan:
    """A tau2 task's gold actions, each by its requestor, and the facts to communicate."""
    from nemo_orch.data import tau2_bench

    criteria = tau2_bench.tau2_task_of(task).evaluation_criteria
    actions, facts = ([], []) if criteria is None else (criteria.actions or [],
                                                         criteria.communicate_info or [])
    return GoldPlan([GoldAction(a.requestor, a.name, a.arguments) for a in actions],
                    final_message(facts))


def _tau2(config: Config, name: str) -> Benchmark:
    from nemo_orch.data import tau2_bench

    if config.eval.domain is None:
        raise ConfigError("--benchmark tau2 needs eval.domain (one of: "
                          f"{', '.join(tau2_bench.domains())})")
    domain = tau2_bench.load_domain(config.eval.domain, config.eval.split)

    async def score(task: Task, trajectory: Trajectory) -> Scored:
        key = episode_id(task.id)
        try:
            turns = tau2_bench.recorded_turns(domain, task, key, trajectory.answer)
        finally:
            domain.environments.release(key)
        result = tau2_bench.score_episode(task, turns)
        return Scored(OutcomeResult(result.passed, "tau2", "; ".join(result.failures)),
                      {"tau2": result.to_json()})

    tasks = domain.tasks[:config.eval.limit]
    return Benchmark(name, tasks, domain.assistant_toolbox, score,
                     user_toolbox=domain.user_toolbox, gold_plan=tau2_gold_plan)


def _qa(config: Config, name: str) -> Benchmark:
    from nemo_orch.data import qa_benchmarks

    if config.eval.data is None:
        raise ConfigError(f"--benchmark {name} needs eval.data: the benchmark as a local JSONL "
                          "or parquet file (nothing is downloaded)")
    read = qa_benchmarks.read_hle if name == "hle" else qa_benchmarks.read_frames
    loaded = read(config.eval.data, limit=config.eval.limit)
    return Benchmark(name, loaded.tasks, _tools(config), _outcome_scorer(config),
                     notes={"skipped": loaded.skipped})
