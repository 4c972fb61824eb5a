"""The main job's report: its SFT and GRPO policies on the offline world's held-out tasks next
to the oracle, and the gold replay of the ToolScale domain tasks (a check of their tools), both
evaluated through the harness (:func:`nemo_orch.eval.harness.evaluate`).

For each policy: ``reward`` (the absolute preference utility of
:func:`nemo_orch.envs.offline.world.utility`), ``accuracy``, ``usd_per_task``,
``seconds_per_task``, ``pref_adherence`` (how well the routes taken serve each task's
preference: the route's expected utility over the oracle route's, so a policy is judged on its
choice, not on how it carried it out), ``oracle_route_share`` (the share of tasks answered by
exactly the oracle's route), ``format_error_rate`` (format errors per turn), ``tool_mix``
(the share of each route per family and preference), and every call by tool and kind with the
episodes a failure outside the policy decided (``call_kinds``, ``calls_by_tool``,
``infra_decided``: left out of every other figure). The oracle's numbers are expectations over
the simulated experts' known accuracies and prices.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from nemo_orch.data.tasks import Task
from nemo_orch.envs.offline.oracle import OracleTable, group_means, oracle_route_share, route_shares
from nemo_orch.eval.report import EpisodeResult, calls_by_kind, summarize

SMOOTHING = 5  # steps in each plotted curve's running mean
SHOWN_ROUTES = 3  # routes plotted per group: its most taken over the run
ACCURACY = "accuracy"  # the preference whose groups' accuracy is a target of its own
ORACLE_ROUTE_FLOOR, ORACLE_ROUTE_GAIN = 0.8, 0.2
GAP_CLOSED_FLOOR, ADHERENCE_FLOOR, GROUP_SLACK = 0.8, 0.9, 0.02


def policy_row(
    tasks: list[Task], records: list[dict[str, Any]], table: OracleTable
) -> dict[str, Any]:
    """One policy's row from its episode records on the offline world (in task order): the
    harness's numbers, and the routes and utilities the environment's score put in the
    details. ``expected_reward`` and ``expected_accuracy`` are the expectations of the routes
    taken (the realized values where a route has none), the oracle's unit: what the policy
    chose, without the simulated experts' luck in carrying it out."""
    summary = summarize([EpisodeResult(**record["result"]) for record in records])
    scored = [
        (task, record, result)
        for task, record in zip(tasks, records)
        if not (result := EpisodeResult(**record["result"])).decided_by_infrastructure
    ]
    tasks = [task for task, _, _ in scored]
    routes = [record["details"]["route"] for _, record, _ in scored]
    columns: dict[str, list[float]] = {
        "reward": [record["details"]["utility"] for _, record, _ in scored],
        "accuracy": [float(result.correct) for _, _, result in scored],
    }
    values = [table.value(task, route) for task, route in zip(tasks, routes)]
    columns["expected_reward"] = [
        realized if value is None else value.utility
        for value, realized in zip(values, columns["reward"])
    ]
    columns["expected_accuracy"] = [
        realized if value is None else value.accuracy
        for value, realized in zip(values, columns["accuracy"])
    ]
    return {
        "reward": statistics.mean(columns["reward"]),
        "accuracy": summary["accuracy"],
        "expected_reward": statistics.mean(columns["expected_reward"]),
        "expected_accuracy": statistics.mean(columns["expected_accuracy"]),
        "usd_per_task": summary["usd_per_task"],
        "seconds_per_task": summary["seconds_per_task"],
        "format_error_rate": summary["format_error_rate"],
        "pref_adherence": summary["pref_adherence"],
        "oracle_route_share": oracle_route_share(table, tasks, routes),
        "within_budget": summary["within_budget"],
        "tool_mix": route_shares(tasks, routes),
        "groups": group_means(tasks, columns),
        **{key: summary[key] for key in ("call_kinds", "calls_by_tool", "infra_decided")},
    }


def gap_closed(report: Mapping[str, Mapping[str, Any]], policy: str) -> float | None:
    """The share of the SFT-to-oracle gap in expected reward that ``policy`` (an RL row)
    closed. Expected on both sides: the oracle's reward is an expectation, and a realized
    reward's noise over a few hundred tasks is of the gap's own size."""
    gap = report["oracle"]["expected_reward"] - report["sft"]["expected_reward"]
    if gap <= 0:
        return None
    return (report[policy]["expected_reward"] - report["sft"]["expected_reward"]) / gap


class Target(NamedTuple):
    """One of the main job's targets for a trained policy: the measured ``value`` against
    ``bound`` (a floor, or a strict one)."""

    name: str
    value: float
    bound: float
    strict: bool = False

    @property
    def met(self) -> bool:
        return self.value > self.bound if self.strict else self.value >= self.bound


def targets(report: Mapping[str, Any], policy: str) -> list[Target]:
    """The main job's targets for ``policy`` (an RL row of ``report``): the oracle's route on
    >= 80% of the tasks and 0.2 above SFT's share, >= 80% of the gap closed, adherence >= 0.9,
    no (family, preference) group's expected reward below SFT's by more than 0.02 and no
    accuracy-preferring group's expected accuracy either, and fewer USD per task than SFT."""
    sft, row = report["sft"], report[policy]

    def worst_drop(key: str, groups: list[str]) -> float:
        return min(row["groups"][group][key] - sft["groups"][group][key] for group in groups)

    groups = list(sft["groups"])
    accuracy_groups = [group for group in groups if group.endswith(f"/{ACCURACY}")]
    return [
        Target("oracle route", row["oracle_route_share"], ORACLE_ROUTE_FLOOR),
        Target(
            "oracle route over SFT's",
            row["oracle_route_share"] - sft["oracle_route_share"],
            ORACLE_ROUTE_GAIN,
        ),
        Target(
            "gap closed",
            math.nan if row["gap_closed"] is None else row["gap_closed"],
            GAP_CLOSED_FLOOR,
        ),
        Target("pref. adherence", row["pref_adherence"], ADHERENCE_FLOOR),
        Target(
            "worst group's expected reward over SFT's",
            worst_drop("expected_reward", groups),
            -GROUP_SLACK,
        ),
        Target(
            "worst accuracy group's expected accuracy over SFT's",
            worst_drop("expected_accuracy", accuracy_groups),
            -GROUP_SLACK,
        ),
        Target(
            "USD per task under SFT's", sft["usd_per_task"] - row["usd_per_task"], 0.0, strict=True
        ),
    ]


def policies(report: Mapping[str, Any]) -> list[str]:
    """The report's rows in order: SFT, the RL policies, the oracle."""
    return [
        name
        for name, row in report.items()
        if isinstance(row, Mapping) and "oracle_route_share" in row
    ]


def trained(report: Mapping[str, Any]) -> list[str]:
    """The report's RL policies, in order (its rows but SFT and the oracle)."""
    return [name for name in policies(report) if name not in ("sft", "oracle")]


def domain_row(tasks: list[Task], records: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's numbers on one ToolScale domain's tasks: the shared report's
    (:func:`nemo_orch.eval.report.summarize`), accuracy per difficulty (gold actions) and how
    the episodes ended."""
    by_difficulty: dict[int, list[bool]] = {}
    for task, record in zip(tasks, records):
        by_difficulty.setdefault(task.metadata["difficulty"], []).append(
            record["result"]["correct"]
        )
    return {
        **summarize([EpisodeResult(**record["result"]) for record in records]),
        "terminations": dict(Counter(record["episode"]["termination"] for record in records)),
        "accuracy_by_gold_actions": {
            str(k): sum(v) / len(v) for k, v in sorted(by_difficulty.items())
        },
    }


def by_domain(tasks: list[Task], records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """:func:`domain_row` of each domain the tasks come from."""
    rows = {}
    for domain in sorted({task.metadata["domain"] for task in tasks}):
        pairs = [
            (task, record)
            for task, record in zip(tasks, records)
            if task.metadata["domain"] == domain
        ]
        rows[domain] = domain_row([task for task, _ in pairs], [record for _, record in pairs])
    return rows


def write_report(run_dir: Any, report: Mapping[str, Any], rl_dir: Any) -> None:
    """``report.json``, ``report.md`` and the training-curve plots of the RL stage in
    ``rl_dir``."""
    run_dir, rl_dir = Path(run_dir), Path(rl_dir)
    names = policies(report)
    (run_dir / "report.json").write_text(json.dumps(report, indent=2))
    plots = plot_curves(rl_dir / "metrics.jsonl", run_dir)
    lines = [
        "# nemo-orch train report",
        "",
        f"Held-out tasks: {report['eval_tasks']} (greedy decoding); oracle: expected values "
        "from the simulated experts' accuracies and prices. Pref. adherence: the expected "
        "utility of the route taken for the task's preference over the oracle route's; "
        "oracle route: the share of tasks answered by exactly the oracle's route; exp. "
        "reward: the expected reward of the routes taken, the oracle's unit.",
        "",
        "Within budget: the share of the episodes of tasks with a USD budget that kept to it.",
        "",
        "| policy | reward | exp. reward | accuracy | USD/task | s/task | pref. adherence | "
        "oracle route | within budget | format errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        row = report[name]
        seconds = "" if row["seconds_per_task"] is None else f"{row['seconds_per_task']:.2f}"
        budget = "" if row.get("within_budget") is None else f"{row['within_budget']:.3f}"
        lines.append(
            f"| {name} | {row['reward']:.3f} | {row['expected_reward']:.3f} | "
            f"{row['accuracy']:.3f} | "
            f"{row['usd_per_task']:.6f} | {seconds} | {row['pref_adherence']:.3f} | "
            f"{row['oracle_route_share']:.3f} | {budget} | "
            f"{row['format_error_rate']:.3f} |"
        )
    closed = [
        f"{name.upper()} closed {report[name]['gap_closed']:.0%}"
        for name in trained(report)
        if report[name].get("gap_closed") is not None
    ]
    if closed:
        lines += ["", "; ".join(closed) + " of the SFT -> oracle gap in expected reward."]
    for name in trained(report):
        lines += [
            "",
            f"## Targets ({name})",
            "",
            "| target | value | bound | met |",
            "|---|---:|---:|---|",
        ]
        lines += [
            f"| {target.name} | {target.value:.4g} | {'>' if target.strict else '>='} "
            f"{target.bound:.4g} | {'yes' if target.met else 'no'} |"
            for target in targets(report, name)
        ]
    columns = " / ".join(names)
    lines += [
        "",
        "## Reward and route mix per (family, preference)",
        "",
        f"| group | tasks | reward {columns} | exp. reward {columns} | "
        + " | ".join(f"routes {name}" for name in names)
        + " |",
        "|---|---:|---|---|" + "---|" * len(names),
    ]
    for group, oracle_row in report["oracle"]["groups"].items():
        rewards = [
            " / ".join(f"{report[name]['groups'][group][key]:.2f}" for name in names)
            for key in ("reward", "expected_reward")
        ]
        cells = [_top_routes(report[name]["tool_mix"].get(group, {})) for name in names]
        lines.append(f"| {group} | {oracle_row['tasks']} | " + " | ".join(rewards + cells) + " |")
    lines += calls_by_kind({name: report[name] for name in names if "call_kinds" in report[name]})
    if "toolscale" in report:
        lines += [
            "",
            "## ToolScale domain tasks (database state and facts; greedy)",
            "",
            "| agent | domain | tasks | accuracy | USD/task | calls/task | episodes ended by |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for agent, domains in report["toolscale"].items():
            lines += [
                f"| {agent} | {domain} | {row['tasks']} | {row['accuracy']:.3f} | "
                f"{row['usd_per_task']:.6f} | {row['calls_per_task']:.1f} | "
                + ", ".join(f"{k} {v}" for k, v in row["terminations"].items())
                + " |"
                for domain, row in domains.items()
            ]
    if "wall_seconds" in report:
        lines += [
            "",
            "Wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in report["wall_seconds"].items()),
        ]
    lines += ["", *[f"![{plot.stem}]({plot.name})" for plot in plots]]
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")


def _top_routes(shares: Mapping[str, float], shown: int = 3) -> str:
    """The ``shown`` most taken routes and their shares, the rest as ``other``."""
    ranked = sorted(shares.items(), key=lambda item: -item[1])
    cells = [f"{route} {share:.0%}" for route, share in ranked[:shown]]
    rest = sum(share for _, share in ranked[shown:])
    return ", ".join(cells + ([f"other {rest:.0%}"] if rest else []))


def plot_curves(metrics_path: Any, out_dir: Any) -> list[Any]:
    """PNG plots of an RL stage's curves (``curves.png``: reward, accuracy, USD per task and the
    reward under each preference; ``routes.png``: each (family, preference) group's top routes),
    every curve smoothed over :data:`SMOOTHING` steps (a group has a few episodes a step)."""
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
    paths = []
    for name, figure in (
        ("curves.png", curves_figure(records)),
        ("routes.png", routes_figure(records)),
    ):
        paths.append(out_dir / name)
        figure.savefig(paths[-1], dpi=100, bbox_inches="tight")  # labels and legends kept
        plt.close(figure)
    return paths


def _smoothed(values: list[float | None]) -> list[float]:
    """The running mean over :data:`SMOOTHING` steps of the steps that have a value (a group
    is not drawn every step); NaN where none has."""
    means = []
    for i in range(len(values)):
        window = [v for v in values[max(0, i - SMOOTHING + 1) : i + 1] if v is not None]
        means.append(statistics.fmean(window) if window else float("nan"))
    return means


def _groups(records: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """``family/preference`` -> its reward key and route keys (``route name -> metric key``)."""
    groups: dict[str, dict[str, str]] = {}
    for key in sorted({k for r in records for k in r if k.startswith("group/")}):
        family, preference, kind, *route = key.removeprefix("group/").split("/", 3)
        entry = groups.setdefault(f"{family}/{preference}", {})
        if kind == "reward":
            entry[""] = key
        elif kind == "route" and route:
            entry[route[0]] = key
    return groups


def curves_figure(records: list[dict[str, Any]]) -> Any:
    """Reward, accuracy and USD per task over the steps, and the reward under each preference
    (the mean over the families asked with it)."""
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    figure, axes = plt.subplots(1, 4, figsize=(17, 3.5))
    for axis, key in zip(axes, ("reward", "accuracy", "usd_per_task")):
        axis.plot(steps, _smoothed([r[key] for r in records]))
        axis.set_title(key)
    by_preference: dict[str, list[str]] = {}
    for group, keys in _groups(records).items():
        if "" in keys:
            by_preference.setdefault(group.split("/")[1], []).append(keys[""])
    axis = axes[3]
    for preference, keys in sorted(by_preference.items()):
        values = [
            statistics.fmean(r[k] for k in keys if k in r) if any(k in r for k in keys) else None
            for r in records
        ]
        axis.plot(steps, _smoothed(values), label=preference)
    axis.set_title("reward by preference")
    if by_preference:
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    for axis in axes:
        axis.set_xlabel("step")
    return figure


def routes_figure(records: list[dict[str, Any]]) -> Any:
    """One panel per (family, preference) group: the share of its episodes on each of its
    :data:`SHOWN_ROUTES` most taken routes, the legend beside the panel."""
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    groups = {
        group: keys for group, keys in _groups(records).items() if "" in keys and len(keys) > 1
    }
    columns = 3
    rows = max(1, -(-len(groups) // columns))
    figure, axes = plt.subplots(rows, columns, figsize=(6.2 * columns, 2.3 * rows), squeeze=False)
    for axis, (group, keys) in zip(axes.flat, groups.items()):
        # a step that drew the group and none of a route's episodes gives that route 0
        shares = {
            route: [r.get(key, 0.0) if keys[""] in r else None for r in records]
            for route, key in keys.items()
            if route
        }
        top = sorted(shares, key=lambda route: -sum(v or 0.0 for v in shares[route]))[:SHOWN_ROUTES]
        for route in top:
            axis.plot(steps, _smoothed(shares[route]), label=route)
        axis.set_title(group, fontsize=9)
        axis.set_ylim(0, 1)
        axis.set_xlim(steps[0], steps[-1])
        axis.set_xlabel("step", fontsize=8)
        axis.tick_params(labelsize=7)
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    for axis in list(axes.flat)[len(groups) :]:
        axis.axis("off")
    figure.suptitle(
        "share of each group's episodes on its most taken routes "
        f"(running mean of {SMOOTHING} steps)"
    )
    figure.tight_layout()
    return figure
