"""The evaluation's oracle table: the best route of each task and how near a route taken is."""

from __future__ import annotations

import asyncio

import pytest

from nemo_orch import config as config_lib
from nemo_orch.envs.offline.oracle import NO_ROUTE, OracleTable
from nemo_orch.envs.offline.world import make_tasks
from nemo_orch.rollout.builders import build_toolbox


@pytest.fixture(scope="module")
def table_and_tasks(tiny_tokenizer):
    config = config_lib.load(["tools=offline_basic"])
    tasks = make_tasks(200, seed=21)

    async def build():
        async with build_toolbox(config.tools) as toolbox:
            return OracleTable(toolbox, tiny_tokenizer, config.reward.usd_reference, (2e-7, 2e-7))

    return asyncio.run(build()), tasks


def _of(tasks, family, preference):
    return [
        task
        for task in tasks
        if task.metadata["family"] == family and task.metadata["preference_name"] == preference
    ]


def test_adherence_is_the_routes_share_of_the_oracle_utility(table_and_tasks):
    table, tasks = table_and_tasks
    for task in tasks:
        best = table.best(task)
        assert table.adherence(task, best.route) == 1.0
        assert table.adherence(task, NO_ROUTE) == 0.0
        for value in table.values(task):
            assert table.adherence(task, value.route) == pytest.approx(
                max(value.utility, 0.0) / best.utility
            )


def test_adherence_follows_the_preference_not_only_the_oracle_route(table_and_tasks):
    """Arithmetic the oracle sends to the sandbox: under "cost" the cheap expert is nearly as
    good and the frontier one poor; under "no code" the frontier expert is the best route."""
    table, tasks = table_and_tasks
    for task in _of(tasks, "arithmetic", "cost"):
        assert table.best(task).route == "tools"
        assert table.adherence(task, "expert:math-small") > 0.85
        assert table.adherence(task, "expert:math-large") < 0.5
    for task in _of(tasks, "arithmetic", "no_code"):
        assert table.adherence(task, "expert:math-large") == 1.0
        assert table.adherence(task, "tools") == 0.0
