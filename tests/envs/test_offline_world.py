"""The offline world: tasks with preferences, routes, the oracle, the naive routers."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import pytest

from nemo_orch import config as config_lib
from nemo_orch.envs.offline.agents import NaiveRouterAgent
from nemo_orch.envs.offline.oracle import route_of
from nemo_orch.envs.offline.values import best as oracle
from nemo_orch.envs.offline.values import utility
from nemo_orch.envs.offline.world import (
    FAMILY_PREFERENCES,
    PREFERENCE_VECTORS,
    make_tasks,
    naive_routes,
    route_values,
    routes,
)
from nemo_orch.reward.components import PREFERENCE_PHRASES, preference_instruction
from nemo_orch.rollout.builders import build_toolbox
from nemo_orch.rollout.engines.scripted import RouterReplies, ScriptedEngine
from nemo_orch.rollout.episode import Episode
from nemo_orch.rollout.runner import DirectPolicy
from nemo_orch.tools.base import ToolContext


@pytest.fixture(scope="module")
def offline_config():
    return config_lib.load(["tools=offline_basic"])


def test_tasks_are_seeded_and_carry_preferences():
    tasks = make_tasks(300, seed=5)
    assert [t.to_json() for t in tasks] == [t.to_json() for t in make_tasks(300, seed=5)]
    for task in tasks:
        family, kind = task.metadata["family"], task.metadata["preference_name"]
        assert kind in FAMILY_PREFERENCES[family]
        assert task.metadata["preference"] == PREFERENCE_VECTORS[kind]
        assert task.question.endswith(f"\n{task.metadata['instruction']}") and task.answer
        assert task.metadata["instruction"] in PREFERENCE_PHRASES[kind]
    assert set(Counter(t.metadata["family"] for t in tasks)) == set(FAMILY_PREFERENCES)


def test_the_served_instruction_of_a_preference_is_one_the_policy_trained_on():
    # The served orchestrator states a request's preference with preference_instruction; the
    # training tasks draw their phrasings through it too, so for every trained preference the
    # served sentence is one the policy saw, word for word.
    trained: dict[str, set[str]] = {kind: set() for kind in PREFERENCE_VECTORS}
    for task in make_tasks(400, seed=1):
        trained[task.metadata["preference_name"]].add(task.metadata["instruction"])
    for kind, vector in PREFERENCE_VECTORS.items():
        assert preference_instruction(vector) in trained[kind], kind


def test_utility_counts_cost_and_avoided_tools():
    cost = PREFERENCE_VECTORS["cost"]
    assert utility(cost, False, 0.0, {}, 0.002) == 0.0
    assert utility(cost, True, 0.001, {}, 0.002) == pytest.approx(0.5)
    assert utility(PREFERENCE_VECTORS["accuracy"], True, 0.001, {}, 0.002) == 1.0
    assert utility(PREFERENCE_VECTORS["no_code"], True, 0.0, {"python_sandbox": 1}, 0.002) == 0.0


def test_oracle_depends_on_the_preference(offline_config):
    toolbox = build_toolbox(offline_config.tools)
    expert = toolbox.tools["call_expert"]
    best: dict[tuple[str, str, str], Counter] = {}
    for task in make_tasks(400, seed=1):
        values = route_values(task, expert, 1e-4, 0.002, {"python_sandbox": 5e-6})
        assert {v.route for v in values} == set(routes(task, expert.models))
        key = (
            task.metadata["family"],
            task.metadata["difficulty"],
            task.metadata["preference_name"],
        )
        best.setdefault(key, Counter())[oracle(values).route] += 1
    top = {key: counts.most_common(1)[0][0] for key, counts in best.items()}
    assert top[("arithmetic", "easy", "cost")] == "tools"
    assert top[("arithmetic", "easy", "no_code")].startswith("expert:")
    assert top[("lookup", "unknown", "accuracy")] == "tools"
    assert top[("math", "hard", "accuracy")] == "expert:math-large"
    assert top[("math", "hard", "cost")] != "expert:math-large"  # the frontier model is too dear
    assert top[("math", "easy", "accuracy")] == "expert:math-large"
    assert top[("math", "easy", "cost")] == "expert:math-small"
    assert top[("arithmetic", "easy", "no_code")] == "expert:math-large"


def test_naive_routers_play_their_routes(offline_config, tiny_tokenizer):
    """On easy math the strongest router always calls the frontier model; the instructed one calls
    the cheap model exactly when the instruction asks for low cost."""
    tasks = [
        task
        for task in make_tasks(600, seed=3)
        if task.metadata["family"] == "math" and task.metadata["difficulty"] == "easy"
    ]
    assert {"cost", "accuracy"} <= {task.metadata["preference_name"] for task in tasks}

    def models_called(router):
        shares = {name: float(name == router) for name in offline_config.data.demo_routers}

        async def run():
            async with build_toolbox(offline_config.tools) as toolbox:
                agent = NaiveRouterAgent(
                    tasks, shares, 0, toolbox, tiny_tokenizer, offline_config.resolved_rollout()
                )
                return [await agent.episode(task, 0, index) for index, task in enumerate(tasks)]

        return [
            (
                trajectory.messages[1]["content"].split("\n")[-1],
                trajectory.messages[2]["content"].split('"model": "')[1].split('"')[0],
            )
            for trajectory in asyncio.run(run())
        ]

    assert {model for _, model in models_called("strongest")} == {"math-large"}
    instructed = models_called("instructed")
    cost_instructions = set(PREFERENCE_PHRASES["cost"])
    assert all(
        (model == "math-small") == (instruction in cost_instructions)
        for instruction, model in instructed
    )
    assert {"math-small", "math-large"} <= {model for _, model in instructed}


def test_naive_routes_are_drawn_in_task_order_with_the_seed(offline_config):
    tasks = make_tasks(40, seed=6)
    expert = build_toolbox(offline_config.tools).tools["call_expert"]
    shares = offline_config.data.demo_routers
    drawn = naive_routes(tasks, expert.models, expert.pricing, shares, seed=1)
    assert drawn == naive_routes(tasks, expert.models, expert.pricing, shares, seed=1)
    assert drawn != naive_routes(tasks, expert.models, expert.pricing, shares, seed=2)
    assert all(drawn[task.id] in routes(task, expert.models).values() for task in tasks)
    tiered = naive_routes(
        tasks,
        expert.models,
        expert.pricing,
        {name: float(name == "tiered") for name in shares},
        seed=1,
    )
    experts_drawn = set()
    for task in tasks:  # one expert at a tier drawn at random, every tier drawn
        options = routes(task, expert.models)
        experts_drawn |= {
            alias for alias in expert.models if options[f"expert:{alias}"] == tiered[task.id]
        }
    assert experts_drawn == set(expert.models)


def test_experts_handed_the_retrieved_evidence_answer_lookups(offline_config):
    """A lookup no expert knows becomes easy once its passage is in the episode's context: the
    oracle prices ``tools+expert:<alias>`` so, and the simulated expert answers so."""
    lookups = [task for task in make_tasks(300, seed=4) if task.metadata["family"] == "lookup"][:40]
    toolbox = build_toolbox(offline_config.tools)
    expert = toolbox.tools["call_expert"]
    values = {v.route: v for v in route_values(lookups[0], expert, 1e-4, 0.002, {})}
    assert values["expert:generalist"].accuracy == 0.05
    assert values["tools+expert:generalist"].accuracy == 0.95  # reading a passage: language

    async def answers(with_passage: bool) -> list[bool]:
        async with toolbox:
            right = []
            for task in lookups:
                context = ToolContext(episode_id=task.id, task=task)
                if with_passage:
                    passage = await toolbox.call("search", {}, context)
                    context = dataclasses.replace(context, observations=(passage.observation,))
                result = await toolbox.call("call_expert", {"model": "generalist"}, context)
                right.append(result.answer == task.answer)
            return right

    assert sum(asyncio.run(answers(with_passage=False))) <= 8
    assert sum(asyncio.run(answers(with_passage=True))) >= 30


def test_exact_tool_routes_reach_the_answer(offline_config):
    """The oracle prices a family's tool route as exact: each one, run through the real tools,
    ends with an observation that states the answer."""
    tasks = [task for task in make_tasks(200, seed=3) if task.metadata["route"]][:60]

    async def last_observations():
        async with build_toolbox(offline_config.tools) as toolbox:
            outputs = []
            for task in tasks:
                for tool, arguments in task.metadata["route"]:
                    result = await toolbox.call(tool, arguments, ToolContext(task=task))
                outputs.append(result.output)
            return outputs

    observations = asyncio.run(last_observations())
    assert {t.metadata["family"] for t in tasks} == {"arithmetic", "lookup", "lookup_compute"}
    assert [task.answer in output for task, output in zip(tasks, observations)] == [True] * 60


def test_every_route_is_named_back_from_its_episode(offline_config, tiny_tokenizer):
    """``route_of`` (the reports' and metrics' tool mix) names each route of a lookup as the
    oracle does, from the episode a router following it plays through the real tools."""
    task = next(t for t in make_tasks(50, seed=6) if t.metadata["family"] == "lookup")

    async def play() -> dict[str, str]:
        async with build_toolbox(offline_config.tools) as toolbox:
            named = {}
            for name, route in routes(task, toolbox.tools["call_expert"].models).items():
                policy = DirectPolicy(
                    ScriptedEngine(tiny_tokenizer, RouterReplies(route, task.answer))
                )
                trajectory = await Episode(
                    task, 0, policy, toolbox, tiny_tokenizer, offline_config.resolved_rollout()
                ).run()
                named[name] = route_of(trajectory)
            return named

    named = asyncio.run(play())
    assert set(named) == {
        "tools",
        *(
            f"{shape}expert:{alias}"
            for shape in ("", "tools+")
            for alias in ("math-small", "math-large", "generalist")
        ),
    }
    assert all(route_of_episode == name for name, route_of_episode in named.items())
