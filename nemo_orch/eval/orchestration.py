"""Evaluation of an orchestrator on the offline environment, and the oracle it is compared to.

For each policy: ``reward`` (the absolute preference utility of
:func:`nemo_orch.envs.offline.world.utility`), ``accuracy``, ``usd_per_task``,
``seconds_per_task``, ``pref_adherence`` (how well the routes taken serve each task's
preference: the route's expected utility over the oracle route's, so a policy is judged on its
choice, not on how it carried it out), ``oracle_route_share`` (the share of tasks answered by
exactly the oracle's route), ``format_error_rate`` (format errors per turn) and ``tool_mix``
(the share of each route per family and preference). The oracle's numbers are expectations over the simulated
experts' known accuracies and prices.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import Any

from nemo_orch.envs.offline.world import EXPERT_TOOL, RouteValue, oracle, route_values, utility
from nemo_orch.data.tasks import Task
from nemo_orch.rollout.episode import Trajectory
from nemo_orch.tools.base import Usage
from nemo_orch.tools.registry import Toolbox

NO_ROUTE = "none"


def route_of(trajectory: Trajectory) -> str:
    """How the episode answered: ``expert:<alias>`` (the first expert it asked),
    ``tools+expert:<alias>`` (basic tools before it), ``tools`` (only basic tools) or ``none``."""
    calls = [call for turn in trajectory.turns for call in turn.calls
             if call.tool is not None and call.error is None]
    first_expert = next((index for index, call in enumerate(calls) if call.tool == EXPERT_TOOL),
                        None)
    if first_expert is not None:
        expert = f"expert:{calls[first_expert].arguments['model']}"
        return f"tools+{expert}" if first_expert else expert
    return "tools" if calls else NO_ROUTE


def group_key(task: Task) -> str:
    return f"{task.metadata['family']}/{task.metadata['preference_name']}"


def _mix(routes_by_group: Mapping[str, list[str]]) -> dict[str, dict[str, float]]:
    return {group: {route: count / len(routes) for route, count in sorted(Counter(routes).items())}
            for group, routes in sorted(routes_by_group.items())}


def route_mix(tasks: list[Task], trajectories: list[Trajectory]) -> dict[str, dict[str, float]]:
    """The share of each route per (family, preference) group (``trajectories[i]`` is one
    episode of ``tasks[i]``)."""
    routes_by_group: dict[str, list[str]] = defaultdict(list)
    for task, trajectory in zip(tasks, trajectories):
        routes_by_group[group_key(task)].append(route_of(trajectory))
    return _mix(routes_by_group)


def group_means(tasks: list[Task], rewards: list[float],
                accuracies: list[float]) -> dict[str, dict[str, float]]:
    """Per (family, preference) group: its number of tasks, mean reward and mean accuracy."""
    rows: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for task, reward, accuracy in zip(tasks, rewards, accuracies):
        rows[group_key(task)].append((reward, accuracy))
    return {group: {"tasks": len(members),
                    "reward": statistics.mean(reward for reward, _ in members),
                    "accuracy": statistics.mean(accuracy for _, accuracy in members)}
            for group, members in sorted(rows.items())}


def episode_stats(trajectories: list[Trajectory]) -> dict[str, float]:
    """What training logs and evaluation reports alike: USD and seconds per task, format errors
    per turn."""
    turns = sum(len(t.turns) for t in trajectories)
    return {
        "usd_per_task": statistics.mean(t.cost_usd for t in trajectories),
        "seconds_per_task": statistics.mean(t.tool_seconds + t.generation_seconds
                                            for t in trajectories),
        "format_error_rate": sum(sum(t.format_errors.values()) for t in trajectories)
        / max(turns, 1),
    }


class OracleTable:
    """The best route of every task under its preference, from the known simulated experts."""

    def __init__(self, toolbox: Toolbox, tokenizer: Any, usd_reference: float,
                 orchestrator_usd_per_token: tuple[float, float]) -> None:
        self.expert = toolbox.tools[EXPERT_TOOL]
        self.toolbox, self.tokenizer = toolbox, tokenizer
        self.usd_reference = usd_reference
        self.input_price, self.output_price = orchestrator_usd_per_token
        self.tool_usd = {name: tool.spec.pricing.cost(Usage(), tool.spec.latency_hint_s)
                         for name, tool in toolbox.tools.items() if name != EXPERT_TOOL}
        self._values: dict[str, list[RouteValue]] = {}  # by task id: every report asks again

    def values(self, task: Task) -> list[RouteValue]:
        if task.id not in self._values:
            self._values[task.id] = self._route_values(task)
        return self._values[task.id]

    def _route_values(self, task: Task) -> list[RouteValue]:
        messages = ([{"role": "system", "content": task.system}] if task.system else []) + [
            {"role": "user", "content": task.question}]
        prompt = self.tokenizer.apply_chat_template(messages, tools=self.toolbox.schemas(),
                                                    tokenize=False, add_generation_prompt=True)
        # Each turn reads the context (the prompt, plus a little per earlier turn) and writes
        # ~32 tokens.
        per_turn = (self.input_price * (len(self.tokenizer.encode(prompt)) + 48)
                    + self.output_price * 32)
        return route_values(task, self.expert, per_turn, self.usd_reference, self.tool_usd)

    def best(self, task: Task) -> RouteValue:
        return oracle(self.values(task))

    def adherence(self, task: Task, route: str) -> float:
        """The expected utility of ``route`` for the task's preference over the best route's,
        in [0, 1] (0 for a route that cannot answer, such as ``none``)."""
        best = self.best(task)
        taken = next((v.utility for v in self.values(task) if v.route == route), 0.0)
        if best.utility <= 0:
            return float(route == best.route)
        return min(max(taken / best.utility, 0.0), 1.0)

    def report(self, tasks: list[Task]) -> dict[str, Any]:
        best = [self.best(task) for task in tasks]
        routes_by_group: dict[str, list[str]] = defaultdict(list)
        for task, value in zip(tasks, best):
            routes_by_group[group_key(task)].append(value.route)
        return {"reward": statistics.mean(v.utility for v in best),
                "accuracy": statistics.mean(v.accuracy for v in best),
                "usd_per_task": statistics.mean(v.usd for v in best),
                "seconds_per_task": None, "pref_adherence": 1.0, "oracle_route_share": 1.0,
                "format_error_rate": 0.0,
                "tool_mix": _mix(routes_by_group),
                "groups": group_means(tasks, [v.utility for v in best],
                                      [v.accuracy for v in best])}


def evaluation_report(tasks: list[Task], trajectories: list[Trajectory], table: OracleTable,
                      correct: list[bool]) -> dict[str, Any]:
    """The metrics of one policy's episodes (one per task, in task order)."""
    utilities = [utility(task.metadata["preference"], right, trajectory.cost_usd,
                         trajectory.tool_counts(), table.usd_reference)
                 for task, trajectory, right in zip(tasks, trajectories, correct)]
    routes = [route_of(trajectory) for trajectory in trajectories]
    return {
        "reward": statistics.mean(utilities),
        "accuracy": statistics.mean(map(float, correct)),
        **episode_stats(trajectories),
        "pref_adherence": statistics.mean(table.adherence(task, route)
                                          for task, route in zip(tasks, routes)),
        "oracle_route_share": statistics.mean(float(route == table.best(task).route)
                                              for task, route in zip(tasks, routes)),
        "tool_mix": route_mix(tasks, trajectories),
        "groups": group_means(tasks, utilities, [float(right) for right in correct]),
    }


def gap_closed(report: Mapping[str, Mapping[str, Any]]) -> float | None:
    """The share of the SFT-to-oracle reward gap that GRPO closed."""
    gap = report["oracle"]["reward"] - report["sft"]["reward"]
    if gap <= 0:
        return None
    return (report["grpo"]["reward"] - report["sft"]["reward"]) / gap


async def scored_episodes(config: Any, weights: Mapping[str, Any], tasks: list[Task],
                          toolbox: Toolbox, tokenizer: Any, settings: Any, scorer: Any
                          ) -> tuple[list[Trajectory], list[Any]]:
    """One episode per task of the policy with HF-named ``weights`` (CPU engine, under
    ``settings``), and each episode's outcome."""
    import asyncio

    from nemo_orch.rollout.engines.hf import HFEngine
    from nemo_orch.rollout.runner import run_rollouts

    engine = HFEngine(config.model, weights, tokenizer=tokenizer)
    trajectories = await run_rollouts(tasks, 1, engine, toolbox, tokenizer, settings,
                                      seed=config.run.seed)
    outcomes = await asyncio.gather(*(scorer.score(task, t.answer, t.calls())
                                      for task, t in zip(tasks, trajectories)))
    return trajectories, list(outcomes)


def evaluate_policies(config: Any, policies: Mapping[str, Mapping[str, Any]], tasks: list[Task],
                      tokenizer_dir: Any, episodes_dir: Any = None) -> dict[str, Any]:
    """Greedy episodes of each policy (HF-named weights) on ``tasks``, scored; the oracle. With
    ``episodes_dir``, each policy's trajectories go to ``<episodes_dir>/<policy>.jsonl``."""
    import asyncio
    import dataclasses
    import json
    from pathlib import Path

    from nemo_orch.models.tokenizer import load_tokenizer
    from nemo_orch.rollout.builders import build_scorer, build_toolbox

    tokenizer = load_tokenizer(tokenizer_dir)
    settings = dataclasses.replace(config.resolved_rollout(), temperature=0.0)
    scorer = build_scorer(config)

    async def evaluate() -> dict[str, Any]:
        report: dict[str, Any] = {}
        async with build_toolbox(config.tools) as toolbox:
            table = OracleTable(toolbox, tokenizer, config.reward.usd_reference,
                                (config.rollout.input_usd_per_million / 1e6,
                                 config.rollout.output_usd_per_million / 1e6))
            for name, hf in policies.items():
                trajectories, outcomes = await scored_episodes(config, hf, tasks, toolbox,
                                                               tokenizer, settings, scorer)
                report[name] = evaluation_report(tasks, trajectories, table,
                                                 [o.correct for o in outcomes])
                if episodes_dir is not None:
                    path = Path(episodes_dir, f"{name}.jsonl")
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text("".join(
                        json.dumps({**t.to_json(), "reference": task.answer,
                                    "correct": o.correct}) + "\n"
                        for task, t, o in zip(tasks, trajectories, outcomes)))
            report["oracle"] = table.report(tasks)
        report["gap_closed"] = gap_closed(report)
        report["eval_tasks"] = len(tasks)
        return report

    return asyncio.run(evaluate())


def write_report(run_dir: Any, report: Mapping[str, Any], grpo_dir: Any) -> None:
    """``report.json``, ``report.md`` and the training-curve plots of the GRPO stage."""
    import json
    from pathlib import Path

    run_dir, grpo_dir = Path(run_dir), Path(grpo_dir)
    (run_dir / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    plots = plot_curves(grpo_dir / "metrics.jsonl", run_dir)
    lines = ["# nemo-orch train report", "",
             f"Held-out tasks: {report['eval_tasks']} (greedy decoding); oracle: expected values "
             "from the simulated experts' accuracies and prices. Pref. adherence: the expected "
             "utility of the route taken for the task's preference over the oracle route's; "
             "oracle route: the share of tasks answered by exactly the oracle's route.", "",
             "| policy | reward | accuracy | USD/task | s/task | pref. adherence | oracle route | "
             "format errors |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("sft", "grpo", "oracle"):
        row = report[name]
        seconds = "" if row["seconds_per_task"] is None else f"{row['seconds_per_task']:.2f}"
        lines.append(f"| {name} | {row['reward']:.3f} | {row['accuracy']:.3f} | "
                     f"{row['usd_per_task']:.6f} | {seconds} | {row['pref_adherence']:.3f} | "
                     f"{row['oracle_route_share']:.3f} | {row['format_error_rate']:.3f} |")
    if report.get("gap_closed") is not None:
        lines += ["", f"GRPO closed {report['gap_closed']:.0%} of the SFT -> oracle reward gap."]
    lines += ["", "## Reward and route mix per (family, preference)", "",
              "| group | tasks | reward sft / grpo / oracle | routes sft | routes grpo | "
              "routes oracle |", "|---|---:|---|---|---|---|"]
    for group, oracle_row in report["oracle"]["groups"].items():
        rewards = " / ".join(f"{report[name]['groups'][group]['reward']:.2f}"
                             for name in ("sft", "grpo", "oracle"))
        cells = [", ".join(f"{route} {share:.0%}" for route, share in
                           report[name]["tool_mix"].get(group, {}).items())
                 for name in ("sft", "grpo", "oracle")]
        lines.append(f"| {group} | {oracle_row['tasks']} | {rewards} | " + " | ".join(cells)
                     + " |")
    if "toolscale" in report:
        lines += ["", "## ToolScale domain tasks (database state and facts; greedy)", "",
                  "| agent | domain | tasks | accuracy | USD/task | calls/task | "
                  "episodes ended by |", "|---|---|---:|---:|---:|---:|---|"]
        for agent, domains in report["toolscale"].items():
            lines += [f"| {agent} | {domain} | {row['tasks']} | {row['accuracy']:.3f} | "
                      f"{row['usd_per_task']:.6f} | {row['calls_per_task']:.1f} | "
                      + ", ".join(f"{k} {v}" for k, v in row["terminations"].items()) + " |"
                      for domain, row in domains.items()]
    if "wall_seconds" in report:
        lines += ["", "Wall time: " + ", ".join(f"{k} {v:.0f} s"
                                                 for k, v in report["wall_seconds"].items())]
    lines += ["", *[f"![{plot.stem}]({plot.name})" for plot in plots]]
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")


def plot_curves(metrics_path: Any, out_dir: Any) -> list[Any]:
    """PNG plots of the GRPO curves: reward, accuracy and USD per task; route shares."""
    import json
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics_path, out_dir = Path(metrics_path), Path(out_dir)
    if not metrics_path.exists():
        return []
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line]
    records = [r for r in records if "reward" in r]
    if not records:
        return []
    steps = [r["step"] for r in records]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    for axis, key in zip(axes, ("reward", "accuracy", "usd_per_task")):
        axis.plot(steps, [r[key] for r in records])
        axis.set_title(key)
        axis.set_xlabel("GRPO step")
    figure.tight_layout()
    curves = out_dir / "curves.png"
    figure.savefig(curves, dpi=100)
    plt.close(figure)
    routes = sorted({k for r in records for k in r if k.startswith("route/")})
    figure, axis = plt.subplots(figsize=(6.5, 3.5))
    for key in routes:
        axis.plot(steps, [r.get(key, 0.0) for r in records], label=key.removeprefix("route/"))
    axis.set_title("route share of episodes")
    axis.set_xlabel("GRPO step")
    axis.legend(fontsize=7)
    figure.tight_layout()
    mix = out_dir / "routes.png"
    figure.savefig(mix, dpi=100)
    plt.close(figure)
    return [curves, mix]
