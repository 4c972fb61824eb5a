"""The main job's plots read as a newcomer needs: per group its few most taken routes, per
preference its reward, legends beside the axes (never over the curves)."""

from __future__ import annotations

import math

import matplotlib
import pytest

from nemo_orch.eval import main_job_report

matplotlib.use("Agg")  # no display: what plot_curves uses too

ROUTES = ["answer-1", "answer-2", "answer-4", "search-1>answer-1", "search-3>answer-1"]


def _records(steps: int = 12) -> list[dict]:
    """Steps drawing the math/cost group on even steps only, with five routes whose shares
    shift, and the lookup/accuracy group every step."""
    records = []
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "reward": 0.5,
            "accuracy": 0.7,
            "usd_per_task": 0.01,
            "group/lookup/accuracy/reward": 0.8,
            "group/lookup/accuracy/route/search-1>answer-1": 1.0,
        }
        if step % 2 == 0:
            record["group/math/cost/reward"] = 0.2
            for index, route in enumerate(ROUTES):
                record[f"group/math/cost/route/{route}"] = (index + 1) / 15
        records.append(record)
    return records


def _legends_beside_their_axes(figure) -> None:
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    for axis in figure.axes:
        legend = axis.get_legend()
        if legend is not None:
            assert legend.get_window_extent(renderer).x0 >= axis.get_window_extent(renderer).x1


def test_routes_show_each_groups_top_routes_beside_the_panel():
    figure = main_job_report.routes_figure(_records())
    panels = {axis.get_title(): axis for axis in figure.axes if axis.get_title()}
    assert set(panels) == {"lookup/accuracy", "math/cost"}
    # the three most taken of five routes, by name
    assert [line.get_label() for line in panels["math/cost"].get_lines()] == [
        "search-3>answer-1",
        "search-1>answer-1",
        "answer-4",
    ]
    # a step that did not draw the group is no data, not a share of 0
    values = panels["math/cost"].get_lines()[0].get_ydata()
    assert math.isnan(values[0]) and values[1] == pytest.approx(values[-1]) == 5 / 15
    _legends_beside_their_axes(figure)


def test_curves_show_the_reward_under_each_preference():
    figure = main_job_report.curves_figure(_records())
    preference = next(axis for axis in figure.axes if axis.get_title() == "reward by preference")
    lines = {line.get_label(): line.get_ydata() for line in preference.get_lines()}
    assert set(lines) == {"accuracy", "cost"}
    assert lines["accuracy"][0] == 0.8 and math.isnan(lines["cost"][0])
    assert lines["cost"][-1] == pytest.approx(0.2)
    _legends_beside_their_axes(figure)
