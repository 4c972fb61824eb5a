"""Domain tools in the toolbox: per-episode databases, errors as observations, and a whole
episode on a domain task scored on the database it left."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
from support.scripted_plans import follow_plan, with_plan

from nemo_orch.config import Config, RolloutConfig, ToolsConfig
from nemo_orch.data.domain_tasks import gold_calls, to_task_row
from nemo_orch.data.tasks import Task
from nemo_orch.envs.toolscale.domain_records import generate_domain
from nemo_orch.envs.toolscale.generator import generate_tasks
from nemo_orch.reward.builders import build_scorer
from nemo_orch.reward.scoring import by_answer, score_groups
from nemo_orch.rollout.builders import build_toolbox
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.rollout.runner import run_rollouts
from nemo_orch.tools.base import ToolContext
from nemo_orch.tools.domain import domain_tools
from nemo_orch.tools.registry import Toolbox


@pytest.fixture(scope="module")
def mobile():
    return generate_domain("mobile", seed=0)


@pytest.fixture(scope="module")
def domain_file(mobile, tmp_path_factory):
    path = tmp_path_factory.mktemp("domains") / "mobile.json"
    mobile.save(path)
    return path


def context(row: Task, episode: str) -> ToolContext:
    return ToolContext(task_id=row.id, episode_id=episode, task=row)


def test_each_episode_writes_its_own_database(mobile):
    drawn = next(
        t
        for t in generate_tasks(mobile, seed=0)
        if any(a.name == "suspend_line" for a in t.gold_actions)
    )
    line = next(a.arguments["line_id"] for a in drawn.gold_actions if a.name == "suspend_line")
    row = to_task_row(mobile, drawn)
    toolbox = Toolbox(domain_tools(mobile, max_episodes=2))

    async def run():
        first = await toolbox.call("suspend_line", {"line_id": line}, context(row, "a"))
        again = await toolbox.call("suspend_line", {"line_id": line}, context(row, "a"))
        other = await toolbox.call("suspend_line", {"line_id": line}, context(row, "b"))
        typo = await toolbox.call("suspend_line", {"line": line}, context(row, "b"))
        bare = await toolbox.call(
            "get_line_details", {"line_id": line}, ToolContext(episode_id="c")
        )
        return first, again, other, typo, bare

    first, again, other, typo, bare = asyncio.run(run())
    assert first.error is None and json.loads(first.output)["status"] == "suspended"
    assert "needs 'active'" in again.error  # episode a already suspended it
    assert other.error is None  # episode b starts from the initial database
    assert "line_id" in typo.error
    assert "need a domain task" in bare.error
    assert mobile.database["lines"][line]["status"] == "active"  # the domain itself untouched


def test_an_episode_on_a_domain_task_is_scored_on_its_database(mobile, domain_file, tiny_tokenizer):
    drawn = list(
        itertools.islice(
            (t for t in generate_tasks(mobile, seed=1) if 2 <= len(t.gold_actions) <= 4), 3
        )
    )
    rows = [
        with_plan(to_task_row(mobile, task), gold_calls(task), "Done: " + " ".join(task.facts))
        for task in drawn
    ]

    config = Config(tools=ToolsConfig(declarations=[], domains=[str(domain_file)]))
    settings = RolloutConfig(
        max_context_tokens=8192, max_turns=8, max_new_tokens=256, check_template=False
    )

    async def run():
        async with build_toolbox(config.tools) as toolbox:
            return await run_rollouts(
                rows,
                1,
                ScriptedEngine(tiny_tokenizer, follow_plan),
                toolbox,
                tiny_tokenizer,
                settings,
            )

    trajectories = asyncio.run(run())
    assert [t.termination for t in trajectories] == ["answer"] * 3
    assert [len(t.calls()) for t in trajectories] == [len(t.gold_actions) for t in drawn]
    groups = [[t] for t in trajectories]
    scored = asyncio.run(score_groups(rows, groups, config.reward, by_answer(build_scorer(config))))
    assert [group.breakdowns[0].components["outcome"] for group in scored] == [1.0] * 3
    assert all(group.breakdowns[0].components["outcome_method:database"] == 1.0 for group in scored)
