"""The main job's evaluation of its policies on ToolScale domain tasks
(:mod:`nemo_orch.envs.toolscale`) next to the gold replay (``nemo-orch eval --benchmark
toolscale`` runs any agent on them through :mod:`nemo_orch.eval.harness`). Episodes act on
their own copy of the domain's database and are scored on the database they leave.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from nemo_orch.config import Config
from nemo_orch.data.tasks import Task
from nemo_orch.envs.toolscale import load_rows, toolscale_gold_plan
from nemo_orch.eval.agents import GoldReplayAgent
from nemo_orch.eval.orchestration import scored_episodes
from nemo_orch.eval.report import EpisodeResult, summarize as summarize_episodes
from nemo_orch.reward.outcome import OutcomeResult
from nemo_orch.rollout.episode import Trajectory


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


def _domain_results(rows: list[Task], trajectories: list[Trajectory],
                    outcomes: list[OutcomeResult]) -> list[DomainResult]:
    return [DomainResult(EpisodeResult.from_trajectory(
        trajectory, outcome.correct, judge_error=outcome.method == "judge_error"),
        outcome.detail, row.metadata["difficulty"], trajectory.termination)
        for row, trajectory, outcome in zip(rows, trajectories, outcomes)]


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
            gold = GoldReplayAgent(toolscale_gold_plan, toolbox)
            trajectories = [await gold.episode(row, config.run.seed) for row in rows]
            outcomes = [await scorer.score(row, t.answer, t.calls())
                        for row, t in zip(rows, trajectories)]
            results["gold-replay"] = _domain_results(rows, trajectories, outcomes)
            for name, weights in policies.items():
                trajectories, outcomes = await scored_episodes(config, weights, rows, toolbox,
                                                               tokenizer, settings, scorer)
                results[name] = _domain_results(rows, trajectories, outcomes)
        return results

    results = asyncio.run(run())
    return {agent: {domain: summarize([r for r in agent_results
                                       if r.episode.task_id.startswith(f"{domain}/")])
                    for domain in loaded}
            for agent, agent_results in results.items()}
