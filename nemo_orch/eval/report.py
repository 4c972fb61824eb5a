"""What every evaluation reports, for every system the same way: accuracy with a 95% interval,
mean and p90 USD and seconds per task, the tool-call mix, format errors per turn, every call
counted by tool and kind (:mod:`nemo_orch.call_kinds`: ``tool_error``, ``infra_error``,
``truncated``, ...), judge failures and, where tasks carry preference vectors, preference
adherence.

An episode a failure outside the system decided (an ``infra_error`` call, a failing user or
policy endpoint, a judge that could not score it, a gold action that failed) says nothing of the
system: it is listed with its cause and counted (``infra_decided``) beside the accuracy, which,
with every other per-episode figure, is over the other episodes (``scored``); a resumed
evaluation runs it again.

The reference reports accuracy only (its price table is never used). Here one
:class:`EpisodeResult` per task and system is reduced by :func:`summarize`; :func:`write_report`
writes ``report.json``, ``report.md``, a cost-accuracy Pareto plot of the systems (``pareto.png``)
and their tool mix (``tool_mix.png``); :func:`compare` puts several such reports side by side.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nemo_orch.call_kinds import KINDS, CallKind, InfraFailure
from nemo_orch.rollout.trajectory import Termination

REPORT = "report.json"


@dataclass(frozen=True)
class EpisodeResult:
    """One system's episode on one task (its trial ``trial``). ``infra_failure``: the failure
    outside the system that decided it (an :class:`~nemo_orch.call_kinds.InfraFailure` as a
    mapping; None: none did), which leaves it out of accuracy; ``judge_error`` and
    ``user_error`` name two such failures (the judge's, the user endpoint's). ``call_kinds``:
    its calls by tool and kind. ``within_budget``: whether the episode kept to its task's USD
    budget (None: the task has none). ``preference``: the preference its task stated (the
    offline world's ``preference_name``; None: none)."""

    task_id: str
    correct: bool
    usd: float
    seconds: float
    turns: int
    tool_calls: dict[str, int] = field(default_factory=dict)
    format_errors: int = 0
    pref_adherence: float | None = None
    judge_error: bool = False
    within_budget: bool | None = None
    trial: int = 0
    user_error: bool = False
    infra_failure: dict[str, str] | None = None
    call_kinds: dict[str, dict[str, int]] = field(default_factory=dict)
    preference: str | None = None

    @classmethod
    def from_trajectory(
        cls,
        trajectory: Any,
        correct: bool,
        infra_failure: InfraFailure | None = None,
        pref_adherence: float | None = None,
        budget_usd: float | None = None,
        preference: str | None = None,
    ) -> EpisodeResult:
        """From a :class:`~nemo_orch.rollout.trajectory.Trajectory` and the failure outside the
        system that decided it (see :func:`nemo_orch.reward.scoring.infra_failure`): its
        ledger's USD (orchestrator and tools), its tool and generation seconds, calls by kind
        and format errors, and whether it kept to ``budget_usd`` (not ended for it, nor over
        it)."""
        within = (
            None
            if budget_usd is None
            else (
                trajectory.termination != Termination.BUDGET and trajectory.cost_usd <= budget_usd
            )
        )
        reason = None if infra_failure is None else infra_failure.reason
        return cls(
            trajectory.task_id,
            correct,
            trajectory.cost_usd,
            trajectory.tool_seconds + trajectory.generation_seconds,
            len(trajectory.turns),
            trajectory.tool_counts(),
            sum(trajectory.format_errors.values()),
            pref_adherence,
            reason == "judge_error",
            within,
            trajectory.sample,
            reason == "user_error",
            None if infra_failure is None else asdict(infra_failure),
            trajectory.call_kinds(),
            preference,
        )

    @property
    def decided_by_infrastructure(self) -> bool:
        """Whether a failure outside the system decided it (a result cached before such
        failures were recorded knows only the user's and the judge's)."""
        return self.infra_failure is not None or self.user_error or self.judge_error


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% by default): unlike the normal
    approximation it stays inside [0, 1] and is sensible at 0/n and n/n."""
    if trials == 0:
        return (0.0, 1.0)
    p = successes / trials
    denominator = 1 + z * z / trials
    center = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return (max(0.0, center - half), min(1.0, center + half))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linearly interpolated between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def pass_hat_k(trials: int, successes: int, k: int) -> float:
    """The chance that ``k`` trials drawn from a task's ``trials``, ``successes`` of them
    right, are all right: tau2-bench's pass^k of one task (``comb(s, k) / comb(n, k)``)."""
    if not 1 <= k <= trials or not 0 <= successes <= trials:
        raise ValueError(
            f"pass^k needs 1 <= k <= trials and 0 <= successes <= trials, got "
            f"k={k}, trials={trials}, successes={successes}"
        )
    return math.comb(successes, k) / math.comb(trials, k)


def pass_hat_ks(results: Sequence[EpisodeResult]) -> dict[str, float]:
    """pass^k for k = 1..trials, averaged over tasks (each task run ``trials`` times) all of
    whose trials were scored (none decided by infrastructure); {} when no task was."""
    by_task: dict[str, list[bool]] = {}
    for result in results:
        by_task.setdefault(result.task_id, []).append(result.correct)
    for result in results:
        if result.decided_by_infrastructure:
            by_task.pop(result.task_id, None)
    if not by_task:
        return {}
    trials = {len(outcomes) for outcomes in by_task.values()}
    if len(trials) != 1:
        raise ValueError(f"pass^k needs as many trials of every task, got {sorted(trials)}")
    (count,) = trials
    return {
        str(k): statistics.mean(
            pass_hat_k(count, sum(outcomes), k) for outcomes in by_task.values()
        )
        for k in range(1, count + 1)
    }


def call_kind_counts(
    results: Sequence[EpisodeResult],
) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """The calls of ``results`` by kind (every kind, in :data:`~nemo_orch.call_kinds.KINDS`
    order) and by tool and kind (the kinds each tool had)."""
    by_tool: dict[str, Counter[str]] = {}
    for result in results:
        for tool, kinds in result.call_kinds.items():
            by_tool.setdefault(tool, Counter()).update(kinds)
    totals = sum(by_tool.values(), Counter())
    return (
        {str(kind): totals[kind] for kind in KINDS},
        {
            tool: {str(kind): kinds[kind] for kind in KINDS if kinds[kind]}
            for tool, kinds in sorted(by_tool.items())
        },
    )


def _legacy_failure(result: EpisodeResult) -> dict[str, str]:
    """The failure of a result cached before failures were recorded whole."""
    return asdict(
        InfraFailure("user_error", "the user", "")
        if result.user_error
        else InfraFailure("judge_error", "the judge", "")
    )


def summarize(results: Sequence[EpisodeResult]) -> dict[str, Any]:
    """A system's numbers over its episodes (one per task, or per trial of each task:
    ``tasks`` counts the episodes, ``pass_hat_k`` the tasks' pass^k). The episodes decided by
    infrastructure are counted and listed (``infra_decided``, ``infra_decided_episodes``) and
    their calls counted by kind; every other figure is over the rest (``scored``; with none,
    accuracy and the means are None)."""
    if not results:
        raise ValueError("no episodes to summarize")
    scored = [r for r in results if not r.decided_by_infrastructure]
    decided = [r for r in results if r.decided_by_infrastructure]
    correct = sum(result.correct for result in scored)
    usd = [result.usd for result in scored]
    seconds = [result.seconds for result in scored]
    calls: Counter[str] = Counter()
    for result in scored:
        calls.update(result.tool_calls)
    total_calls, turns = sum(calls.values()), sum(result.turns for result in scored)
    adherence = [r.pref_adherence for r in scored if r.pref_adherence is not None]
    budgeted = [r.within_budget for r in scored if r.within_budget is not None]
    low, high = wilson_interval(correct, len(scored))
    kinds, by_tool = call_kind_counts(results)
    stated: dict[str, list[EpisodeResult]] = defaultdict(list)
    for result in scored:
        if result.preference is not None:
            stated[result.preference].append(result)

    def mean(values: list[float]) -> float | None:
        return statistics.mean(values) if values else None

    return {
        "tasks": len(results),
        "scored": len(scored),
        "correct": correct,
        "accuracy": correct / len(scored) if scored else None,
        "accuracy_ci95": [low, high],
        "usd_per_task": mean(usd),
        "usd_p90": percentile(usd, 90) if usd else None,
        "seconds_per_task": mean(seconds),
        "seconds_p90": percentile(seconds, 90) if seconds else None,
        "calls_per_task": total_calls / len(scored) if scored else None,
        "tool_mix": {name: count / total_calls for name, count in sorted(calls.items())},
        "format_error_rate": sum(r.format_errors for r in scored) / max(turns, 1),
        # Every call, of every episode, by kind and by tool and kind.
        "call_kinds": kinds,
        "calls_by_tool": by_tool,
        "failed_calls_per_task": (sum(kinds.values()) - kinds[CallKind.OK]) / len(results),
        "infra_decided": len(decided),
        # Which episodes a failure outside the system decided, as ``<task>@<trial>``, and how.
        "infra_decided_episodes": [
            {"episode": f"{r.task_id}@{r.trial}", **(r.infra_failure or _legacy_failure(r))}
            for r in decided
        ],
        "judge_errors": sum(result.judge_error for result in results),
        "user_errors": sum(result.user_error for result in results),
        # Which episodes a failing user ended, as ``<task>@<trial>``.
        "user_error_episodes": [f"{r.task_id}@{r.trial}" for r in results if r.user_error],
        "pref_adherence": mean(adherence),
        # The share of the episodes of tasks with a budget that kept to it (None: no budgets).
        "within_budget": mean(budgeted),
        "pass_hat_k": pass_hat_ks(results),
        # Per stated preference: its scored episodes' accuracy and USD per task.
        "by_preference": {
            name: {
                "tasks": len(group),
                "accuracy": statistics.mean(r.correct for r in group),
                "usd_per_task": statistics.mean(r.usd for r in group),
            }
            for name, group in sorted(stated.items())
        },
    }


def pareto_front(points: Mapping[str, tuple[float | None, float | None]]) -> list[str]:
    """The systems no other beats on both cost (lower) and accuracy (higher), cheapest first
    (a system with no scored episode, its point None, is on no front)."""
    points = {name: point for name, point in points.items() if None not in point}
    front = [
        name
        for name, (usd, accuracy) in points.items()
        if not any(
            other_usd <= usd
            and other_accuracy >= accuracy
            and (other_usd, other_accuracy) != (usd, accuracy)
            for other_usd, other_accuracy in points.values()
        )
    ]
    return sorted(front, key=lambda name: points[name][0])


def _figure(value: float | None, digits: int) -> str:
    """A figure of the table; ``n/a`` where no episode was scored."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def _table(systems: Mapping[str, Mapping[str, Any]], front: Sequence[str]) -> list[str]:
    lines = [
        "| system | tasks | accuracy (95% CI) | decided by infra. | USD/task | USD p90 | "
        "s/task | s p90 | calls/task | failed calls/task | format errors/turn | "
        "judge errors | pref. adherence |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in systems.items():
        low, high = row["accuracy_ci95"]
        adherence = "" if row["pref_adherence"] is None else f"{row['pref_adherence']:.3f}"
        marker = " *" if name in front else ""
        # Rows of reports written before failures were counted lack their columns.
        lines.append(
            f"| {name}{marker} | {row['tasks']} | {_figure(row['accuracy'], 3)} "
            f"({low:.3f}-{high:.3f}) | {row.get('infra_decided', 0)} | "
            f"{_figure(row['usd_per_task'], 6)} | {_figure(row['usd_p90'], 6)} | "
            f"{_figure(row['seconds_per_task'], 2)} | {_figure(row['seconds_p90'], 2)} | "
            f"{_figure(row['calls_per_task'], 2)} | "
            f"{_figure(row.get('failed_calls_per_task', 0.0), 2)} | "
            f"{row['format_error_rate']:.3f} | {row['judge_errors']} | {adherence} |"
        )
    return lines


def by_preference(systems: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Each stated preference's cost-accuracy picture: every system's accuracy and USD per task
    on that preference's tasks, ``*`` on that preference's Pareto front (markdown lines; none
    where no task stated one)."""
    names = sorted({name for row in systems.values() for name in row.get("by_preference", {})})
    if not names:
        return []
    lines = [
        "",
        "Per stated preference (accuracy / USD per task; * on that preference's "
        "cost-accuracy Pareto front):",
        "",
        "| preference | tasks | " + " | ".join(systems) + " |",
        "|---|---:|" + "---|" * len(systems),
    ]
    for preference in names:
        rows = {
            system: row["by_preference"][preference]
            for system, row in systems.items()
            if preference in row.get("by_preference", {})
        }
        front = pareto_front(
            {system: (row["usd_per_task"], row["accuracy"]) for system, row in rows.items()}
        )
        tasks = max(row["tasks"] for row in rows.values())
        cells = [
            f"{rows[system]['accuracy']:.3f} / {rows[system]['usd_per_task']:.6f}"
            + (" *" if system in front else "")
            if system in rows
            else ""
            for system in systems
        ]
        lines.append(f"| {preference} | {tasks} | " + " | ".join(cells) + " |")
    return lines


def calls_by_kind(systems: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Each system's calls by tool and kind (markdown lines; none where no call was made)."""
    if not any(row["calls_by_tool"] for row in systems.values()):
        return []
    return [
        "",
        "Calls by tool and kind:",
        "",
        "| system | tool | " + " | ".join(KINDS) + " |",
        "|---|---|" + "---:|" * len(KINDS),
        *[
            f"| {name} | {tool} | " + " | ".join(str(kinds.get(kind, 0)) for kind in KINDS) + " |"
            for name, row in systems.items()
            for tool, kinds in row["calls_by_tool"].items()
        ],
    ]


def _plots(
    systems: Mapping[str, Mapping[str, Any]], front: Sequence[str], out_dir: Path
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4.5))
    for name, row in systems.items():
        if row["accuracy"] is None:  # no episode scored: no point
            continue
        low, high = row["accuracy_ci95"]
        axes.errorbar(
            row["usd_per_task"],
            row["accuracy"],
            yerr=[[max(0.0, row["accuracy"] - low)], [max(0.0, high - row["accuracy"])]],
            fmt="o",
            capsize=3,
            label=name,
        )
    axes.plot(
        [systems[name]["usd_per_task"] for name in front],
        [systems[name]["accuracy"] for name in front],
        "k--",
        linewidth=1,
        label="Pareto front",
    )
    axes.set_xlabel("USD per task (mean)")
    axes.set_ylabel("accuracy (95% CI)")
    axes.legend(fontsize="small")
    figure.tight_layout()
    pareto = out_dir / "pareto.png"
    figure.savefig(pareto, dpi=120)
    plt.close(figure)

    tools = sorted({tool for row in systems.values() for tool in row["tool_mix"]})
    figure, axes = plt.subplots(figsize=(6, max(2.0, 0.5 + 0.5 * len(systems))))
    left = [0.0] * len(systems)
    for tool in tools:
        shares = [row["tool_mix"].get(tool, 0.0) for row in systems.values()]
        axes.barh(list(systems), shares, left=left, label=tool)
        left = [a + b for a, b in zip(left, shares)]
    axes.set_xlabel("share of tool calls")
    if tools:  # the legend sits outside the axes; bbox_inches="tight" makes room for it
        axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1, 1))
    mix = out_dir / "tool_mix.png"
    figure.savefig(mix, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return [pareto, mix]


def _pass_hat_k(systems: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """pass^k per system, where tasks ran more than once."""
    if all(len(row["pass_hat_k"]) <= 1 for row in systems.values()):
        return []
    ks = max((row["pass_hat_k"] for row in systems.values()), key=len)
    return [
        "",
        "| system | " + " | ".join(f"pass^{k}" for k in ks) + " |",
        "|---|" + "---:|" * len(ks),
        *[
            f"| {name} | "
            + " | ".join(
                f"{row['pass_hat_k'][k]:.3f}" if k in row["pass_hat_k"] else "" for k in ks
            )
            + " |"
            for name, row in systems.items()
        ],
    ]


def _infra_decided(systems: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The episodes a failure outside the system decided, per system, where there were any."""
    lines = []
    for name, row in systems.items():
        decided = row.get("infra_decided_episodes", [])
        if decided:
            lines += [
                "",
                f"Decided by infrastructure, {name}: {len(decided)} episodes, left "
                "out of its accuracy; a resumed evaluation runs them again.",
                "",
                *[
                    f"- {item['episode']}: {item['reason']} at {item['endpoint']}: "
                    f"{_cell(item['detail'])[:300]}"
                    for item in decided
                ],
            ]
    return lines


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _notes(notes: Mapping[str, Any]) -> list[str]:
    """What the benchmark left out: a list of records becomes a table, anything else a line."""
    lines: list[str] = []
    for key, value in notes.items():
        if not value:
            continue
        if isinstance(value, list) and all(isinstance(item, dict) for item in value):
            columns = list(value[0])
            lines += [
                "",
                f"{key}:",
                "",
                "| " + " | ".join(columns) + " |",
                "|" + "---|" * len(columns),
                *[
                    "| " + " | ".join(_cell(item.get(c, "")) for c in columns) + " |"
                    for item in value
                ],
            ]
        else:
            lines += ["", f"{key}: {_cell(value)}"]
    return lines


def write_report(
    out_dir: str | Path,
    benchmark: str,
    systems: Mapping[str, Sequence[EpisodeResult]],
    notes: Mapping[str, Any] | None = None,
) -> Path:
    """``report.json`` (the summaries, every episode and the ``notes``: what the benchmark
    left out and why, the MCP tools the policy did not train with), ``report.md``,
    ``pareto.png`` and ``tool_mix.png`` for the systems evaluated on ``benchmark``; returns the
    JSON's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    notes = dict(notes or {})
    summaries = {name: summarize(results) for name, results in systems.items()}
    front = pareto_front(
        {name: (row["usd_per_task"], row["accuracy"]) for name, row in summaries.items()}
    )
    plots = _plots(summaries, front, out_dir)
    lines = [
        f"# {benchmark}",
        "",
        *_table(summaries, front),
        "",
        "\\* on the cost-accuracy Pareto front.",
        *_pass_hat_k(summaries),
        *by_preference(summaries),
        *calls_by_kind(summaries),
        *_infra_decided(summaries),
        *_notes(notes),
        "",
        *[f"![{plot.stem}]({plot.name})" for plot in plots],
    ]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    path = out_dir / REPORT
    path.write_text(
        json.dumps(
            {
                "benchmark": benchmark,
                "systems": summaries,
                "pareto_front": front,
                "notes": notes,
                "episodes": {
                    name: [asdict(result) for result in results]
                    for name, results in systems.items()
                },
            },
            indent=1,
        )
        + "\n"
    )
    return path


def compare(run_dirs: Sequence[str | Path]) -> str:
    """The systems of several reports side by side (markdown), each named
    ``<run directory>/<system>``, with the Pareto front over all of them."""
    systems: dict[str, Mapping[str, Any]] = {}
    for run_dir in map(Path, run_dirs):
        try:
            report = json.loads((run_dir / REPORT).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"{run_dir}: no readable {REPORT} ({error})") from None
        for name, row in report["systems"].items():
            key = f"{run_dir.name}/{name}"
            if key in systems:
                raise ValueError(f"two runs named {run_dir.name!r} hold system {name!r}")
            systems[key] = row
    front = pareto_front(
        {name: (row["usd_per_task"], row["accuracy"]) for name, row in systems.items()}
    )
    return "\n".join(_table(systems, front)) + "\n"
