"""The one evaluation path: systems (an agent of :mod:`nemo_orch.eval.agents`; an orchestrator
with the engine of its policy) on an environment's test tasks (:mod:`nemo_orch.envs`).
``nemo-orch eval`` (:func:`run`) runs the agents it is given on ``env.*`` (``--benchmark NAME``
is ``env=NAME``) side by side in one report; the main job (:mod:`nemo_orch.train.main_job`)
runs its trained policies, their weights handed over in memory, through :func:`evaluate`.

Every example is written to ``<directory>/episodes/<system>.jsonl`` the moment it is scored
(one line: the result, the outcome, the episode's messages and ledger). A killed evaluation
started again with the same settings reads those lines and runs only the examples that have
none, so nothing is re-run or counted twice; a line cut short by the kill is dropped. The cache
starts with a fingerprint of what decides the results (environment, agent, tasks, seed, tools,
rollout, reward, monolith): results of other settings are refused, never mixed in. An episode
the kill cut short continues from its last completed turn: each system keeps a journal
(``episodes/<system>.db``, ``eval.journal``; :mod:`nemo_orch.rollout.journal`) of its episodes'
policy turns and HTTP calls (agent, tools, user, judge), each episode in its own scope, from
which the resumed episode gets them back in order.

Episode ``i`` runs with seed ``eval.seed + i`` whichever examples are left, and decoding is
greedy by default, so a run is deterministic for a seed. With ``eval.num_trials`` each task is
an example that many times (trial ``t`` of task ``j`` is episode ``t * tasks + j``), each trial
an episode of its own (its id ``<task>#<t>``, its environment, its transcript), so results do
not depend on ``eval.concurrency``. An episode a failure outside the system decided (an
``infra_error`` call, a failing user or policy endpoint, a judge that could not score it, a
gold action that failed: :mod:`nemo_orch.call_kinds`) is listed in the report, left out of its
accuracy, and run again by a resumed evaluation.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nemo_orch import config as config_lib
from nemo_orch.clients import call_store
from nemo_orch.config import (
    AGENT_KINDS,
    GOLD_REPLAY,
    MONOLITH,
    ORCHESTRATOR,
    ROUTERS,
    Config,
    ConfigError,
)
from nemo_orch.data.tasks import Task
from nemo_orch.envs import Environment, Scored, build_environment
from nemo_orch.envs.interfaces import Oracle
from nemo_orch.eval import report as report_lib
from nemo_orch.eval.report import EpisodeResult
from nemo_orch.eval.systems import Resources, System, build_agent, preference_oracle
from nemo_orch.reward.scoring import infra_failure
from nemo_orch.rollout import journal
from nemo_orch.rollout.opening import episode_id, task_budget
from nemo_orch.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)

EPISODES = "episodes"
# The report's note on the tools from MCP servers the policy did not train with.
UNTRAINED_MCP_TOOLS = "MCP tools the policy did not train with (calls by system)"
_TOKEN_FIELDS = ("token_ids", "loss_mask", "decision_mask", "logprobs", "forced_mask")


def out_dir(config: Config, benchmark: str) -> Path:
    return Path(config.eval.out_dir or Path(config.run.output_dir) / "eval" / benchmark)


def check_agents(agents: list[str], benchmark: Environment) -> None:
    unknown = [agent for agent in agents if agent not in AGENT_KINDS]
    if unknown:
        raise ConfigError(f"unknown agent {unknown[0]!r}; agents: {', '.join(AGENT_KINDS)}")
    if GOLD_REPLAY in agents and not benchmark.has_gold_plan:
        raise ConfigError(
            f"--agent gold-replay needs gold actions, which {benchmark.name} "
            "tasks do not have (toolscale and tau2 do)"
        )
    for agent in agents:
        if agent not in (ORCHESTRATOR, MONOLITH, GOLD_REPLAY, *ROUTERS, *benchmark.baselines):
            raise ConfigError(
                f"--agent {agent} is a baseline of another environment; "
                f"{benchmark.name}'s own baselines: "
                f"{', '.join(benchmark.baselines) or 'none'}"
            )


# ---------------------------------------------------------------------------- the cache
class EpisodeCache:
    """One agent's per-example results: a JSONL file whose first line is the fingerprint."""

    def __init__(self, path: Path, fingerprint: str, resume: bool) -> None:
        self.path, self.fingerprint = path, fingerprint
        self.records: dict[str, dict[str, Any]] = {}
        if resume and path.exists():
            self._read()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._write_all([{"fingerprint": fingerprint}])

    def _read(self) -> None:
        lines = self.path.read_bytes().split(b"\n")
        kept: list[dict[str, Any]] = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                kept.append(json.loads(line))
            except json.JSONDecodeError:
                if number < len(lines) - 1:  # only the last line can be cut by a kill
                    raise ConfigError(
                        f"{self.path}:{number}: not JSON; remove the file or set eval.resume=false"
                    ) from None
                log.warning("%s: dropping the last line, cut short by a kill", self.path)
        if len(kept) < 2:  # a fingerprint alone (a start that failed): nothing to keep
            self._write_all([{"fingerprint": self.fingerprint}])
            return
        if kept[0].get("fingerprint") != self.fingerprint:
            raise ConfigError(
                f"{self.path} holds results of another evaluation (other "
                "settings, tasks or seed); set eval.resume=false to start over, "
                "or choose another eval.out_dir"
            )
        # An episode a failure outside the agent decided says nothing of it: it runs again.
        self.records = {
            example_key(record["task_id"], record["trial"]): record
            for record in kept[1:]
            if not EpisodeResult(**record["result"]).decided_by_infrastructure
        }
        self._write_all(kept)  # without a cut line, so appends start on a fresh line

    def _write_all(self, records: list[dict[str, Any]]) -> None:
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        os.replace(partial, self.path)

    def append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
            file.flush()
            os.fsync(file.fileno())
        self.records[example_key(record["task_id"], record["trial"])] = record


def example_key(task_id: str, trial: int) -> str:
    """An example of the cache: a task's trial."""
    return f"{task_id}@{trial}"


def fingerprint(
    config: Config, benchmark: Environment, tasks: list[Task], system: System, seed: int
) -> str:
    """What decides a system's results; concurrency and output paths do not."""
    relevant = {
        "benchmark": benchmark.name,
        "agent": system.kind,
        "system": system.name,
        "weights": system.weights,
        "seed": seed,
        "env": asdict(config.env),
        "tasks": [task.id for task in tasks],
        "trials": config.eval.num_trials,
        "temperature": config.eval.temperature,
        "tools": asdict(config.tools),
        "reward": asdict(config.reward),
        "rollout": {
            k: v
            for k, v in asdict(config.rollout).items()
            if k not in ("max_concurrent_episodes", "max_batch_size")
        },
        "monolith": asdict(config.eval.monolith) if system.kind == MONOLITH else None,
    }
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()


def episode_record(
    index: int,
    trial: int,
    seed: int,
    task: Task,
    trajectory: Trajectory,
    scored: Scored,
    result: EpisodeResult,
) -> dict[str, Any]:
    episode = {k: v for k, v in trajectory.to_json().items() if k not in _TOKEN_FIELDS}
    return {
        "task_id": task.id,
        "trial": trial,
        "index": index,
        "seed": seed,
        "result": asdict(result),
        "outcome": asdict(scored.outcome),
        "details": scored.details,
        "reference": task.answer,
        "episode": episode,
    }


# ---------------------------------------------------------------------------- running
Handler = Callable[[int, int, Task, Trajectory, Scored, Oracle | None], None]


async def _roll_out(
    system: System,
    resources: Resources,
    todo: list[tuple[int, Task]],
    concurrency: int,
    handle: Handler,
    stage: str,
) -> None:
    """Episode ``index`` of each ``(index, task)`` of ``todo`` (trial ``index // tasks`` of its
    task, seed ``resources.seed + index``), ``concurrency`` at once, scored by the environment
    and handed to ``handle`` with its seed and the oracle of a routing agent (see
    :func:`~nemo_orch.eval.systems.preference_oracle`); a progress bar named ``stage`` counts
    them."""
    from tqdm import tqdm

    benchmark = resources.benchmark
    slots = asyncio.Semaphore(concurrency)
    async with benchmark.toolbox() as toolbox, build_agent(system, resources, toolbox) as agent:
        oracle = preference_oracle(system.kind, benchmark, toolbox, resources)

        async def one(index: int, task: Task) -> None:
            seed, sample = resources.seed + index, index // len(resources.tasks)
            async with slots:
                await toolbox.refresh()  # an MCP server's changed tools, from this episode on
                # Its calls (agent, tools, judge) through a journal or call store are its own.
                with call_store.episode_scope(f"{episode_id(task.id, sample)}@{seed}"):
                    trajectory = await agent.episode(task, sample, seed)
                    scored = await benchmark.score(task, trajectory)
            handle(index, seed, task, trajectory, scored, oracle)
            progress.update(1)

        with tqdm(
            total=len(todo), desc=f"{stage}: {system.name}", unit="episode", dynamic_ncols=True
        ) as progress:
            await asyncio.gather(*(one(index, task) for index, task in todo))


def _cache_into(cache: EpisodeCache) -> Handler:
    def append(
        index: int,
        seed: int,
        task: Task,
        trajectory: Trajectory,
        scored: Scored,
        oracle: Oracle | None,
    ) -> None:
        result = EpisodeResult.from_trajectory(
            trajectory,
            scored.outcome.correct,
            infra_failure=infra_failure(trajectory, scored.outcome),
            pref_adherence=(
                None if oracle is None else oracle.preference_adherence(task, trajectory)
            ),
            budget_usd=task_budget(task),
            preference=task.metadata.get("preference_name"),
        )
        # The episode's sample is its trial (see _roll_out).
        cache.append(
            episode_record(index, trajectory.sample, seed, task, trajectory, scored, result)
        )

    return append


@dataclass(frozen=True)
class Evaluation:
    """The test tasks evaluated and, per system, its episode records in (trial, task) order
    (each as :func:`episode_record` writes it to the system's cache)."""

    tasks: list[Task]
    records: dict[str, list[dict[str, Any]]]
    # Per system, what its journal did this run (eval.journal): entries replayed, kept, missed.
    journaled: dict[str, dict[str, int]]

    def results(self, system: str) -> list[EpisodeResult]:
        return [EpisodeResult(**record["result"]) for record in self.records[system]]


def evaluate(
    config: Config,
    benchmark: Environment,
    systems: list[System],
    directory: Path,
    tokenizer: Any = None,
) -> Evaluation:
    """Every system on the test tasks of ``benchmark``, each example cached in
    ``<directory>/episodes/<system>.jsonl`` the moment it is scored (resumable)."""
    check_agents([system.kind for system in systems], benchmark)
    if len({system.name for system in systems}) != len(systems):
        raise ConfigError("an agent is named twice")
    seed = config.eval_seed
    tasks = benchmark.tasks("test", None, seed)
    if not tasks:
        raise ConfigError(f"{benchmark.name}: no tasks to evaluate")
    resources = Resources(config, benchmark, tasks, seed, tokenizer)
    records, journaled = {}, {}
    for system in systems:
        stem = directory / EPISODES / system.name.replace(":", "-")
        results = fingerprint(config, benchmark, tasks, system, seed)
        cache = EpisodeCache(stem.with_suffix(".jsonl"), results, config.eval.resume)
        examples = [
            (trial * len(tasks) + index, example_key(task.id, trial), task)
            for trial in range(config.eval.num_trials)
            for index, task in enumerate(tasks)
        ]
        todo = [(index, task) for index, key, task in examples if key not in cache.records]
        if todo:
            with ExitStack() as stack:
                # A journal of the same results, or emptied (eval.resume=false).
                kept = (
                    stack.enter_context(
                        journal.journaling(
                            stem.with_suffix(".db"),
                            config.calls.max_mb,
                            results,
                            fresh=not config.eval.resume,
                        )
                    )
                    if config.eval.journal
                    else None
                )
                asyncio.run(
                    _roll_out(
                        system,
                        resources,
                        todo,
                        config.eval.concurrency,
                        _cache_into(cache),
                        f"eval {benchmark.name}",
                    )
                )
            if kept is not None:
                journaled[system.name] = kept.counts()
        records[system.name] = [cache.records[key] for _, key, _ in examples]
    return Evaluation(tasks, records, journaled)


def successful_episodes(
    config: Config, benchmark: Environment, system: System, count: int, tokenizer: Any = None
) -> list[Trajectory]:
    """The episodes of ``system`` on ``count`` tasks of the environment's train split that the
    environment scores correct, in task order (the reference's positive samples for SFT), and
    whose route serves the task's preference at least ``data.demo_min_adherence`` well where
    the environment knows the best routes; never one a failure outside the system decided (a
    gold action that failed, an endpoint down).
    Tasks are drawn with ``run.seed``, episode ``i`` runs with seed ``run.seed + i``,
    ``rollout.max_concurrent_episodes`` at once."""
    check_agents([system.kind], benchmark)
    tasks = benchmark.tasks("train", count, config.run.seed)
    if not tasks:
        raise ConfigError(f"{benchmark.name}: no training tasks to demonstrate")
    resources = Resources(config, benchmark, tasks, config.run.seed, tokenizer)
    correct: dict[int, Trajectory] = {}

    def keep(
        index: int,
        seed: int,
        task: Task,
        trajectory: Trajectory,
        scored: Scored,
        oracle: Oracle | None,
    ) -> None:
        if (
            scored.outcome.correct
            and infra_failure(trajectory, scored.outcome) is None
            and (
                oracle is None
                or oracle.preference_adherence(task, trajectory) >= config.data.demo_min_adherence
            )
        ):
            correct[index] = trajectory

    asyncio.run(
        _roll_out(
            system,
            resources,
            list(enumerate(tasks)),
            config.rollout.max_concurrent_episodes,
            keep,
            "demonstrations",
        )
    )
    return [correct[index] for index in sorted(correct)]


@dataclass(frozen=True)
class EvalSummary:
    benchmark: str
    report: Path
    systems: dict[str, dict[str, Any]]
    seconds: float
    journaled: dict[str, dict[str, int]]  # see Evaluation


def _policy_identity(config: Config) -> str | None:
    """The checkpoint ``rollout.policy`` names (or the run's latest), as the cache knows it
    (:func:`checkpoint.identity`); None for a served policy or an HF directory, which the
    fingerprint's ``rollout`` section names."""
    from nemo_orch.models import checkpoint
    from nemo_orch.models.hf_mapping import HF_CONFIG

    policy = config.rollout.policy
    if config.rollout.engine == "openai" or (
        policy is not None and (Path(policy) / HF_CONFIG).is_file()
    ):
        return None
    return checkpoint.identity(policy or checkpoint.checkpoints_dir(config))


def _trained_with(config: Config, agents: list[str]) -> Callable[[str, str], bool]:
    """Whether the policy evaluated trained with a tool of an MCP server (its name, the
    server's): whether the configuration its checkpoint saved lists the server and takes that
    tool (``allow``, ``deny``). A served policy or an HF directory keeps no configuration, and
    rule agents train with nothing: for them, no MCP tool was trained with."""
    from omegaconf import OmegaConf

    from nemo_orch.models import checkpoint
    from nemo_orch.tools.mcp import tool_name

    if ORCHESTRATOR not in agents or _policy_identity(config) is None:
        return lambda tool, server: False
    saved = OmegaConf.load(
        checkpoint.open_checkpoint(
            config.rollout.policy or checkpoint.checkpoints_dir(config)
        ).config_path
    )
    # A checkpoint saved before tools.mcp existed trained with no MCP server.
    servers = {entry.name: entry for entry in OmegaConf.select(saved, "tools.mcp", default=[])}

    def trained(tool: str, server: str) -> bool:
        entry = servers.get(server)
        return (
            entry is not None
            and (entry.allow is None or tool in {tool_name(server, name) for name in entry.allow})
            and tool not in {tool_name(server, name) for name in entry.deny}
        )

    return trained


def untrained_mcp_tools(
    evaluation: Evaluation, trained: Callable[[str, str], bool]
) -> list[dict[str, Any]]:
    """The tools offered that came from MCP servers and were not ``trained`` with, each with
    its server and its (successful) calls by system, in name order."""
    rows: dict[str, dict[str, Any]] = {}
    for system, records in evaluation.records.items():
        for record in records:
            # A record cached before tool sources were recorded names none.
            for tool, server in record["episode"].get("tool_sources", {}).items():
                if not trained(tool, server):
                    row = rows.setdefault(
                        tool,
                        {
                            "tool": tool,
                            "server": server,
                            **{name: 0 for name in evaluation.records},
                        },
                    )
                    row[system] += record["result"]["tool_calls"].get(tool, 0)
    return [rows[tool] for tool in sorted(rows)]


def run(config: Config, agents: list[str], tokenizer: Any = None) -> EvalSummary:
    """Every agent on the test tasks of ``env`` (cached per example, resumable), then the
    report, which notes the MCP tools the policy did not train with
    (:func:`untrained_mcp_tools`). ``tokenizer`` renders the rule agents' prompts (None: the
    run's, or the served policy's when an orchestrator is evaluated)."""
    started = time.perf_counter()
    benchmark = build_environment(config)
    check_agents(agents, benchmark)
    engine = None
    if ORCHESTRATOR in agents:
        from nemo_orch.rollout.builders import build_engine

        engine, tokenizer = build_engine(config, max_requests=config.eval.max_requests_per_endpoint)
    systems = [
        System(kind, kind, engine, _policy_identity(config))
        if kind == ORCHESTRATOR
        else System(kind, kind)
        for kind in agents
    ]
    directory = out_dir(config, benchmark.name)
    evaluation = evaluate(config, benchmark, systems, directory, tokenizer)
    (directory / "config.yaml").write_text(config_lib.to_yaml(config))
    untrained = untrained_mcp_tools(evaluation, _trained_with(config, agents))
    path = report_lib.write_report(
        directory,
        benchmark.name,
        {kind: evaluation.results(kind) for kind in agents},
        notes={**benchmark.notes, UNTRAINED_MCP_TOOLS: untrained},
    )
    summaries = json.loads(path.read_text())["systems"]
    return EvalSummary(
        benchmark.name, path, summaries, time.perf_counter() - started, evaluation.journaled
    )
