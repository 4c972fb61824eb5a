"""ToolScale domain tasks as a benchmark: agents run on a domain's task rows through the toolbox
(the domain's tools act on each episode's database) and are scored on the database they leave.

Data is what ``nemo-orch synth`` writes (``<dir>/<domain>/domain.json`` and ``tasks.jsonl``,
offline or LLM-made); tasks that fail the validation filters are dropped and listed in the
report. Agents:

* ``gold-replay`` sends each task's gold actions through the toolbox, then tells the user every
  required fact. It checks the executor and the scorer, not a model: every task must pass.
* a policy (HF-format weights) runs greedy episodes with the episode runner, as in training.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from nemo_orch.config import Config
from nemo_orch.data.domain import Domain
from nemo_orch.data.domain_tasks import DomainTask, read_domain_tasks, to_task_row
from nemo_orch.data.jsonl import DataError
from nemo_orch.data.tasks import Task
from nemo_orch.data.toolscale.generator import MAX_ACTIONS
from nemo_orch.data.toolscale.validate import ValidationSummary, validated
from nemo_orch.eval.orchestration import scored_episodes
from nemo_orch.eval.report import EpisodeResult, summarize as summarize_episodes
from nemo_orch.eval.tau2 import final_message
from nemo_orch.reward.outcome import OutcomeScorer
from nemo_orch.tools.base import ToolContext
from nemo_orch.tools.registry import Toolbox

BENCHMARK = "toolscale"


@dataclass(frozen=True)
class LoadedDomain:
    """A domain's file, the domain, the rows of its valid tasks and the tasks dropped."""

    domain_file: Path
    domain: Domain
    rows: list[Task]
    validation: ValidationSummary


def load_rows(directory: str | Path, domain_name: str, limit: int | None = None
              ) -> LoadedDomain:
    """The first ``limit`` tasks of ``<dir>/<domain>/`` that pass the validation filters (a
    task file from elsewhere may hold tasks whose gold actions fail: they are dropped and
    reported, never scored), as rows."""
    folder = Path(directory) / domain_name
    if not (folder / "domain.json").is_file():
        raise DataError(f"{folder}: no domain.json (write one with `nemo-orch synth`)")
    domain = Domain.load(folder / "domain.json")
    summary = ValidationSummary()
    tasks = itertools.islice(validated(domain, read_domain_tasks(folder / "tasks.jsonl"),
                                       MAX_ACTIONS, summary), limit)
    rows = [to_task_row(domain, task) for task in tasks]
    return LoadedDomain(folder / "domain.json", domain, rows, summary)


@dataclass(frozen=True)
class DomainResult:
    """One task's episode (:class:`EpisodeResult`), why it failed, its number of gold actions
    and how it ended."""

    episode: EpisodeResult
    failures: str
    gold_actions: int
    termination: str

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self.episode), "failures": self.failures,
                "gold_actions": self.gold_actions, "termination": self.termination}


def summarize(results: list[DomainResult]) -> dict[str, Any]:
    """The shared report's numbers (:func:`nemo_orch.eval.report.summarize`), accuracy per
    difficulty (gold actions) and how the episodes ended."""
    by_difficulty: dict[int, list[bool]] = {}
    for result in results:
        by_difficulty.setdefault(result.gold_actions, []).append(result.episode.correct)
    return {**summarize_episodes([result.episode for result in results]),
            "terminations": dict(Counter(result.termination for result in results)),
            "accuracy_by_gold_actions": {str(k): sum(v) / len(v)
                                         for k, v in sorted(by_difficulty.items())}}


async def gold_replay(rows: list[Task], toolbox: Toolbox, scorer: OutcomeScorer
                      ) -> list[DomainResult]:
    """Each row's gold actions through ``toolbox``, scored on the database they leave."""
    results = []
    for row in rows:
        task = DomainTask.model_validate(row.metadata["domain_task"])
        context = ToolContext(task_id=row.id, episode_id=f"{row.id}/gold-replay", task=row)
        # Only the calls the executor carried out count: one it refused changed nothing.
        executed, calls, usd, seconds = [], Counter(), 0.0, 0.0
        for action in task.gold_actions:
            result = await toolbox.call(action.name, action.arguments, context)
            usd, seconds = usd + result.cost_usd, seconds + result.latency_s
            if result.error is None:
                executed.append((action.name, action.arguments))
                calls[action.name] += 1
        outcome = await scorer.score(row, final_message(task.facts), executed)
        episode = EpisodeResult(row.id, outcome.correct, usd, seconds,
                                turns=len(task.gold_actions) + 1, tool_calls=dict(calls))
        results.append(DomainResult(episode, outcome.detail, len(task.gold_actions), "answer"))
    return results


def run_gold_replay(config: Config, directory: str | Path, domain_name: str,
                    limit: int | None = None) -> dict[str, Any]:
    """``nemo-orch eval --benchmark toolscale --agent gold-replay``: the report as JSON."""
    from nemo_orch.rollout.builders import build_scorer, build_toolbox

    started = time.perf_counter()
    loaded = load_rows(directory, domain_name, limit)
    config = replace(config, tools=replace(config.tools, declarations=[],
                                           domains=[str(loaded.domain_file)]))

    async def run() -> list[DomainResult]:
        async with build_toolbox(config.tools) as toolbox:
            return await gold_replay(loaded.rows, toolbox, build_scorer(config))

    results = asyncio.run(run())
    return {"benchmark": BENCHMARK, "domain": domain_name, "agent": "gold-replay",
            **summarize(results), "seconds": round(time.perf_counter() - started, 3),
            "dropped": loaded.validation.to_json()["rejections"],
            "results": [result.to_json() for result in results]}


def evaluate_policies(config: Config, policies: Mapping[str, Mapping[str, Any]],
                      directory: str | Path, per_domain: int, tokenizer: Any
                      ) -> dict[str, Any]:
    """Greedy episodes of each policy (HF-named weights) on the first ``per_domain`` tasks of
    every domain under ``directory``, next to the gold replay; per domain and policy, the
    summary of :func:`summarize`."""
    from nemo_orch.rollout.builders import build_scorer, build_toolbox

    loaded = {folder.name: load_rows(directory, folder.name, per_domain)
              for folder in sorted(Path(directory).iterdir()) if folder.is_dir()}
    rows = [row for domain in loaded.values() for row in domain.rows]
    config = replace(config, tools=replace(config.tools, domains=[
        str(domain.domain_file) for domain in loaded.values()]))
    settings = replace(config.resolved_rollout(), temperature=0.0)
    scorer = build_scorer(config)

    async def run() -> dict[str, list[DomainResult]]:
        results = {}
        async with build_toolbox(config.tools) as toolbox:
            results["gold-replay"] = await gold_replay(rows, toolbox, scorer)
            for name, weights in policies.items():
                trajectories, outcomes = await scored_episodes(config, weights, rows, toolbox,
                                                               tokenizer, settings, scorer)
                results[name] = [
                    DomainResult(EpisodeResult.from_trajectory(
                        t, outcome.correct, judge_error=outcome.method == "judge_error"),
                        outcome.detail, row.metadata["difficulty"], t.termination)
                    for row, t, outcome in zip(rows, trajectories, outcomes)]
        return results

    results = asyncio.run(run())
    return {agent: {domain: summarize([r for r in agent_results
                                       if r.episode.task_id.startswith(f"{domain}/")])
                    for domain in loaded}
            for agent, agent_results in results.items()}


def write_report(report: Mapping[str, Any], out_dir: str | Path) -> Path:
    """``report.json`` and ``report.md`` of a gold replay; returns the JSON's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# ToolScale {report['domain']}, agent {report['agent']}", "",
             f"Accuracy **{report['accuracy']:.3f}** ({report['correct']}/{report['tasks']} "
             f"tasks) in {report['seconds']:.1f} s.", "",
             "| gold actions | accuracy |", "|---:|---:|",
             *[f"| {k} | {v:.3f} |" for k, v in report["accuracy_by_gold_actions"].items()]]
    if report["dropped"]:
        lines += ["", "Dropped by the validation filters (not scored):", "",
                  "| task | filter | why |", "|---|---|---|",
                  *[f"| {r['task_id']} | {r['filter']} | {r['reason']} |"
                    for r in report["dropped"]]]
    failed = [r for r in report["results"] if not r["correct"]]
    if failed:
        lines += ["", "| failed task | why |", "|---|---|",
                  *[f"| {r['task_id']} | {r['failures']} |" for r in failed]]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    path = out_dir / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
