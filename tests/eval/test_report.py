"""The shared evaluation report: intervals, percentiles, summaries, the Pareto front, the files
written, and comparing runs."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from nemo_orch.eval.report import (
    EpisodeResult,
    compare,
    pareto_front,
    percentile,
    summarize,
    wilson_interval,
    write_report,
)


def test_wilson_interval_matches_the_formula_and_stays_in_range():
    low, high = wilson_interval(8, 10)
    assert math.isclose(low, 0.4902, abs_tol=1e-4) and math.isclose(high, 0.9433, abs_tol=1e-4)
    assert wilson_interval(0, 20)[0] == 0.0 and wilson_interval(20, 20)[1] == 1.0
    assert wilson_interval(0, 20)[1] > 0.0  # 0/20 does not prove the rate is 0
    narrow, wide = wilson_interval(500, 1000), wilson_interval(5, 10)
    assert narrow[1] - narrow[0] < wide[1] - wide[0]


def test_percentile_interpolates():
    values = list(range(1, 11))
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 0) == 1 and percentile(values, 100) == 10
    assert percentile([3.0], 90) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)


def results(
    correct: list[bool], usd: float, tools: dict[str, int], adherence=None, judge_errors: int = 0
) -> list[EpisodeResult]:
    return [
        EpisodeResult(
            f"t{i}",
            right,
            usd * (i + 1),
            0.5 * (i + 1),
            turns=2,
            tool_calls=tools,
            format_errors=int(i == 0),
            pref_adherence=adherence,
            judge_error=i < judge_errors,
        )
        for i, right in enumerate(correct)
    ]


def test_summarize():
    summary = summarize(
        results([True, True, False, True], 0.01, {"search": 2, "expert": 1}, adherence=0.5)
    )
    assert summary["accuracy"] == 0.75 and summary["correct"] == 3
    assert summary["accuracy_ci95"] == list(wilson_interval(3, 4))
    assert summary["usd_per_task"] == pytest.approx(0.025)
    assert summary["usd_p90"] == pytest.approx(percentile([0.01, 0.02, 0.03, 0.04], 90))
    assert summary["seconds_p90"] == pytest.approx(percentile([0.5, 1.0, 1.5, 2.0], 90))
    assert summary["tool_mix"] == {"expert": pytest.approx(1 / 3), "search": pytest.approx(2 / 3)}
    assert summary["calls_per_task"] == 3 and summary["format_error_rate"] == 1 / 8
    assert summary["judge_errors"] == 0 and summary["pref_adherence"] == 0.5
    assert summarize(results([False], 0.0, {}))["pref_adherence"] is None
    assert summary["within_budget"] is None  # no task had a budget
    budgeted = [
        dataclasses.replace(result, within_budget=within)
        for result, within in zip(results([True] * 4, 0.01, {}), [True, False, None, True])
    ]
    assert summarize(budgeted)["within_budget"] == pytest.approx(2 / 3)  # of the 3 with budgets
    with pytest.raises(ValueError):
        summarize([])


def test_pareto_front():
    points = {
        "cheap": (0.001, 0.5),
        "strong": (0.01, 0.9),
        "dominated": (0.02, 0.8),
        "middle": (0.005, 0.7),
        "tie": (0.005, 0.7),
    }
    assert pareto_front(points) == ["cheap", "middle", "tie", "strong"]


def test_write_report_and_compare(tmp_path):
    systems = {
        "orchestrator": results([True, True, False], 0.002, {"search": 1}),
        "fixed:strongest": results([True, True, True], 0.02, {"call_expert": 1}),
        "random": results([False, True, False], 0.03, {"search": 1, "call_expert": 1}),
    }
    path = write_report(tmp_path / "a", "offline", systems)
    report = json.loads(path.read_text())
    assert report["pareto_front"] == ["orchestrator", "fixed:strongest"]
    assert len(report["episodes"]["random"]) == 3
    markdown = (tmp_path / "a" / "report.md").read_text()
    assert "| orchestrator * | 3 | 0.667 (" in markdown and "| random | 3 |" in markdown
    assert (tmp_path / "a" / "pareto.png").stat().st_size > 1000
    assert (tmp_path / "a" / "tool_mix.png").stat().st_size > 1000
    write_report(
        tmp_path / "b", "offline", {"monolith": results([True, False, True], 0.05, {"search": 3})}
    )
    table = compare([tmp_path / "a", tmp_path / "b"])
    assert "| a/orchestrator * |" in table and "| b/monolith |" in table
    with pytest.raises(ValueError, match="no readable report.json"):
        compare([tmp_path / "missing"])


def test_each_stated_preference_gets_its_own_cost_accuracy_picture(tmp_path):
    def stated(rows: list[EpisodeResult], preferences: list[str | None]) -> list[EpisodeResult]:
        return [dataclasses.replace(row, preference=name) for row, name in zip(rows, preferences)]

    split = ["cost", "accuracy", "accuracy", None]
    # orchestrator: cheap and right under cost, dear and right under accuracy
    orchestrator = stated(results([True, True, True, False], 0.001, {}), split)
    cheapest = stated(results([False, True, False, False], 0.0001, {}), split)
    summary = summarize(orchestrator)
    assert summary["by_preference"] == {
        "accuracy": {"tasks": 2, "accuracy": 1.0, "usd_per_task": pytest.approx(0.0025)},
        "cost": {"tasks": 1, "accuracy": 1.0, "usd_per_task": pytest.approx(0.001)},
    }
    assert summarize(results([True], 0.01, {}))["by_preference"] == {}  # none stated
    write_report(tmp_path, "offline", {"orchestrator": orchestrator, "fixed:cheapest": cheapest})
    markdown = (tmp_path / "report.md").read_text()
    assert "| preference | tasks | orchestrator | fixed:cheapest |" in markdown
    # under accuracy the cheapest router is cheaper but wrong half the time: both on the front
    assert "| accuracy | 2 | 1.000 / 0.002500 * | 0.500 / 0.000250 * |" in markdown
    assert "| cost | 1 | 1.000 / 0.001000 * | 0.000 / 0.000100 * |" in markdown


def test_episodes_decided_by_infrastructure_are_counted_and_left_out():
    failure = {"reason": "infra_error", "endpoint": "ask(model=m)", "detail": "HTTP 500"}
    scored = results([True, False], 0.01, {"ask": 1})
    scored = [dataclasses.replace(r, trial=r.trial, call_kinds={"ask": {"ok": 1}}) for r in scored]
    decided = [
        EpisodeResult(
            "t0",
            False,
            0.5,
            9.0,
            1,
            trial=1,
            infra_failure=failure,
            call_kinds={"ask": {"infra_error": 1}},
        ),
        EpisodeResult(
            "t1", False, 0.5, 9.0, 1, trial=1, judge_error=True, call_kinds={"ask": {"ok": 1}}
        ),
        EpisodeResult("t2", True, 0.5, 9.0, 1, user_error=True),
    ]  # cached before
    summary = summarize(scored + decided)
    assert (summary["tasks"], summary["scored"], summary["correct"]) == (5, 2, 1)
    assert summary["accuracy"] == 0.5 and summary["accuracy_ci95"] == list(wilson_interval(1, 2))
    assert summary["usd_per_task"] == pytest.approx(0.015)  # of the scored episodes only
    assert summary["infra_decided"] == 3
    assert [(item["episode"], item["reason"]) for item in summary["infra_decided_episodes"]] == [
        ("t0@1", "infra_error"),
        ("t1@1", "judge_error"),
        ("t2@0", "user_error"),
    ]
    assert summary["call_kinds"]["ok"] == 3 and summary["call_kinds"]["infra_error"] == 1
    assert summary["calls_by_tool"] == {"ask": {"ok": 3, "infra_error": 1}}
    assert summary["failed_calls_per_task"] == pytest.approx(1 / 5)
    # pass^k over the tasks whose every trial was scored: here every task had one decided;
    # with only t1's second trial decided, t0's one right trial is what is left.
    assert summary["pass_hat_k"] == {}
    assert summarize([*scored, decided[1]])["pass_hat_k"] == {"1": 1.0}
    nothing = summarize(decided[:1])
    assert (nothing["accuracy"], nothing["usd_per_task"], nothing["pass_hat_k"]) == (None, None, {})
