"""The main job's targets and its gap on expected rewards, on hand-built reports."""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path

import pytest

from nemo_orch.eval import main_job_report

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "main_job_targets.py"


def _row(
    oracle_route: float,
    expected: float,
    adherence: float,
    usd: float,
    groups: dict[str, tuple[float, float]],
) -> dict:
    return {
        "reward": expected + 0.05,
        "expected_reward": expected,
        "accuracy": 0.8,
        "expected_accuracy": 0.8,
        "usd_per_task": usd,
        "pref_adherence": adherence,
        "oracle_route_share": oracle_route,
        "groups": {
            name: {"tasks": 10, "expected_reward": reward, "expected_accuracy": accuracy}
            for name, (reward, accuracy) in groups.items()
        },
    }


def _report(grpo_groups: dict[str, tuple[float, float]], usd: float = 0.01) -> dict:
    report = {
        "sft": _row(0.5, 0.50, 0.7, 0.02, {"math/accuracy": (0.6, 0.9), "math/cost": (0.4, 0.7)}),
        "grpo": _row(0.9, 0.68, 0.95, usd, grpo_groups),
        "oracle": _row(
            1.0, 0.70, 1.0, 0.01, {"math/accuracy": (0.7, 0.9), "math/cost": (0.6, 0.7)}
        ),
    }
    report["grpo"]["gap_closed"] = main_job_report.gap_closed(report, "grpo")
    return report


def test_gap_closed_compares_expected_rewards_not_realized_ones():
    report = _report({"math/accuracy": (0.6, 0.9), "math/cost": (0.6, 0.7)})
    # (0.68 - 0.50) / (0.70 - 0.50): the realized rewards (each 0.05 higher) play no part.
    assert report["grpo"]["gap_closed"] == pytest.approx(0.9)
    report["oracle"]["expected_reward"] = 0.5
    assert main_job_report.gap_closed(report, "grpo") is None  # no gap to close


def test_targets_met_and_each_miss_named():
    met = main_job_report.targets(
        _report({"math/accuracy": (0.59, 0.89), "math/cost": (0.6, 0.5)}), "grpo"
    )
    assert [t.name for t in met] == [
        "oracle route",
        "oracle route over SFT's",
        "gap closed",
        "pref. adherence",
        "worst group's expected reward over SFT's",
        "worst accuracy group's expected accuracy over SFT's",
        "USD per task under SFT's",
    ]
    # A cost group's accuracy may fall (0.7 -> 0.5); an accuracy group's may not, by > 0.02.
    assert all(t.met for t in met)
    assert met[1].value == pytest.approx(0.4) and met[6].value == pytest.approx(0.01)
    missed = main_job_report.targets(
        _report({"math/accuracy": (0.57, 0.85), "math/cost": (0.6, 0.7)}, usd=0.02), "grpo"
    )
    assert {t.name for t in missed if not t.met} == {
        "worst group's expected reward over SFT's",
        "worst accuracy group's expected accuracy over SFT's",
        "USD per task under SFT's",
    }  # equal USD is not below SFT's
    no_gap = _report({"math/accuracy": (0.6, 0.9), "math/cost": (0.6, 0.7)})
    no_gap["grpo"]["gap_closed"] = None
    gap = main_job_report.targets(no_gap, "grpo")[2]
    assert math.isnan(gap.value) and not gap.met


def test_script_prints_a_row_per_report_and_fails_on_a_miss(tmp_path, capsys):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(_report({"math/accuracy": (0.6, 0.9), "math/cost": (0.6, 0.7)})))
    bad.write_text(json.dumps(_report({"math/accuracy": (0.5, 0.9), "math/cost": (0.6, 0.7)})))
    main = runpy.run_path(str(SCRIPT))["main"]
    assert main([str(good)]) == 0
    assert "every target met" in capsys.readouterr().out
    assert main([str(good), str(bad)]) == 1
    out = capsys.readouterr().out
    assert out.count("| grpo |") == 2 and "-0.1 (missed)" in out and "targets missed" in out
