"""The offline world on ToolOrchestra's interface: the SIMULATED writers' accuracies and wrong
outputs, executed by the real retriever and sandbox; the oracle over multi-step routes, against
a hand computation and against played episodes; the margins the world is built to have."""

from __future__ import annotations

import asyncio
import json
import statistics
from collections import Counter, defaultdict

import pytest

from nemo_orch import config as config_lib
from nemo_orch.config import RolloutConfig
from nemo_orch.envs.offline import orchestra
from nemo_orch.envs.offline.agents import NaiveRouterAgent
from nemo_orch.envs.offline.oracle import route_of
from nemo_orch.envs.offline.values import best
from nemo_orch.envs.offline.world import ORCHESTRA, make_tasks, restated
from nemo_orch.rollout.builders import build_toolbox
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.rollout.opening import initial_messages
from nemo_orch.rollout.runner import run_rollouts
from nemo_orch.tools.base import ToolContext
from nemo_orch.tools.simulated_expert import holds

TASKS = make_tasks(400, seed=3, interface=ORCHESTRA)
PER_TURN_USD = 5e-5


def of(family: str) -> list:
    return [task for task in TASKS if task.metadata["family"] == family]


@pytest.fixture(scope="module")
def config():
    return config_lib.load()


@pytest.fixture(scope="module")
def writers(config):
    return orchestra.Writers.of(build_toolbox(config.tools))


async def _play(toolbox, task, route, seed: int) -> tuple[list[str], str | None]:
    """The calls of ``route`` as an episode makes them: each handed the observations so far."""
    observations: list[str] = []
    answer = None
    for tool, arguments in route:
        context = ToolContext(
            task_id=task.id,
            episode_id=f"{task.id}#{seed}",
            seed=seed,
            task=task,
            observations=tuple(observations),
        )
        result = await toolbox.call(tool, arguments, context)
        assert result.error is None, result.error
        observations.append(result.observation)
        answer = result.answer
    return observations, answer


def play(config, plays):
    """Run ``plays`` ((task, route, seed) triples) through one started toolbox."""

    async def run():
        async with build_toolbox(config.tools) as toolbox:
            return [await _play(toolbox, *one) for one in plays]

    return asyncio.run(run())


def test_the_policy_is_offered_the_three_composites_only(config):
    toolbox = build_toolbox(config.tools)
    assert sorted(toolbox.tools) == ["answer", "enhance_reasoning", "search"]
    assert sorted(part.spec.name for part in toolbox.parts) == [
        "answerer",
        "coder",
        "query_writer",
        "retriever",
        "sandbox",
    ]
    assert asyncio.run(toolbox.call("sandbox", {"code": "print(1)"})).error.startswith(
        "unknown tool"
    )


def test_every_program_runs_in_the_sandbox_and_prints_what_the_oracle_expects(config):
    """Right programs print the answer, wrong ones a near miss, blind ones their guess: the
    texts the oracle reasons over are what the real sandbox prints."""
    tasks = [
        task
        for family in ("arithmetic", "lookup_compute", "math", "word")
        for task in of(family)[:6]
    ]

    async def run():
        async with build_toolbox(config.tools) as toolbox:
            sandbox = next(part for part in toolbox.parts if part.spec.name == "sandbox")
            printed = []
            for task in tasks:
                code = task.metadata["code"]
                for kind in ("right", "wrong", "blind"):
                    if code[kind] is not None:
                        result = await sandbox.call({"code": code[kind]}, ToolContext())
                        printed.append((task, kind, result.output.strip()))
            return printed

    printed = asyncio.run(run())
    assert len(printed) >= 2 * len(tasks)
    for task, kind, output in printed:
        assert output == task.metadata["code"]["printed"][kind], (task.question, kind)
        assert (output == task.answer) == (kind == "right")


def test_query_writers_find_the_fact_with_their_accuracy(config, writers):
    """search-3 writes the right query with its accuracy; the real retriever then returns the
    fact's passage, else the decoy entity's, which holds no evidence."""
    lookups = of("lookup")[:20]
    plays = [
        (task, ((orchestra.SEARCH, {"model": "search-3"}),), seed)
        for task in lookups
        for seed in range(10)
    ]
    found = []
    for (task, _, _), (observations, _) in zip(plays, play(config, plays)):
        right, decoy = task.metadata["passages"]
        if holds(observations[0], task.answer):
            assert right in observations[0]
            found.append(True)
        else:
            assert decoy in observations[0] and task.metadata["query"][1] in observations[0]
            found.append(False)
    accuracy = writers.experts[orchestra.SEARCH].models["search-3"].accuracy_on("easy")
    assert statistics.mean(found) == pytest.approx(accuracy, abs=0.08)


def test_coders_need_the_fact_and_err_with_their_accuracy(config, writers):
    """A lookup-then-compute program needs the fact: without the passage the coder guesses it
    (the blind program), with it reasoner-3 writes the right program with its accuracy."""
    tasks = of("lookup_compute")[:8]
    code = (orchestra.REASON, {"model": "reasoner-3"})
    search = (orchestra.SEARCH, {"model": "search-1"})
    blind = play(config, [(task, (code,), 0) for task in tasks])
    for task, (observations, _) in zip(tasks, blind):
        assert task.metadata["code"]["blind"] in observations[0]
    plays = [(task, (search, code), seed) for task in tasks for seed in range(10)]
    # Among the episodes whose search found the fact:
    right = [
        holds(observations[1], task.answer)
        for (task, _, _), (observations, _) in zip(plays, play(config, plays))
        if holds(observations[0], task.metadata["code"]["needs"])
    ]
    accuracy = writers.experts[orchestra.REASON].models["reasoner-3"].accuracy_on("easy")
    assert statistics.mean(right) == pytest.approx(accuracy, abs=0.1)


def test_answerers_read_the_evidence_and_are_distracted_by_the_rest(config, writers):
    """answer-4 reads a passage right with its accuracy; with an unrelated observation beside
    it, that times its distraction; without the passage it does not know the made-up world."""
    from nemo_orch.tools.composite import ExpertAnswer

    lookups = of("lookup")[:25]

    async def run():
        async with build_toolbox(config.tools) as toolbox:
            answer = toolbox.tools[orchestra.ANSWER]
            assert isinstance(answer, ExpertAnswer)
            rates = {}
            for name, extra in (
                ("passage", ()),
                ("distracted", ("Result:\nNo documents.",)),
                ("nothing", None),
            ):
                correct = []
                for task in lookups:
                    passage = task.metadata["passages"][0]
                    observations = () if extra is None else (passage, *extra)
                    for seed in range(8):
                        context = ToolContext(
                            task_id=task.id,
                            episode_id=f"{task.id}#{seed}",
                            seed=seed,
                            task=task,
                            observations=observations,
                        )
                        result = await toolbox.call(
                            orchestra.ANSWER, {"model": "answer-4"}, context
                        )
                        correct.append(result.answer == task.answer)
                rates[name] = statistics.mean(correct)
            return rates

    rates = asyncio.run(run())
    model = writers.experts[orchestra.ANSWER].models["answer-4"]
    assert rates["passage"] == pytest.approx(model.accuracy_on("language"), abs=0.08)
    assert rates["distracted"] == pytest.approx(
        model.accuracy_on("language") * model.distraction, abs=0.06
    )
    assert rates["nothing"] < 0.1


def test_episodes_are_the_same_one_at_a_time_and_eight_at_once(config, tiny_tokenizer):
    """The offline world times and bills every call by the tools' models (tools.timing=modeled),
    not the clock: episodes through the real retriever and sandbox come out the same whatever
    ran beside them, cost and seconds included."""
    route = [("search", "search-2"), ("enhance_reasoning", "reasoner-3"), ("answer", "answer-4")]

    def reply(prompt: str) -> str:
        tool, model = route[prompt.count("<tool_response>")]
        call = {"name": tool, "arguments": {"model": model}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    async def rollouts(concurrency: int):
        async with build_toolbox(config.tools) as toolbox:
            return await run_rollouts(
                of("lookup_compute")[:4],
                2,
                ScriptedEngine(tiny_tokenizer, reply),
                toolbox,
                tiny_tokenizer,
                RolloutConfig(
                    max_context_tokens=8192,
                    max_turns=3,
                    max_concurrent_episodes=concurrency,
                    max_batch_size=concurrency,
                ),
                seed=5,
            )

    def comparable(trajectory) -> dict:
        return {key: value for key, value in trajectory.to_json().items() if key != "wall_seconds"}

    alone, together = asyncio.run(rollouts(1)), asyncio.run(rollouts(8))
    assert [comparable(t) for t in alone] == [comparable(t) for t in together]
    calls = [call for trajectory in alone for turn in trajectory.turns for call in turn.calls]
    assert len(calls) == 3 * len(alone) and all(call.error is None for call in calls)
    assert {call.tool for call in calls} == {"search", "enhance_reasoning", "answer"}
    assert all(trajectory.termination == "answer" for trajectory in alone)


def test_the_oracle_enumerates_multi_step_routes_and_matches_a_hand_computation(writers):
    routes = orchestra.routes(writers)
    assert len(routes) == (1 + 6 + 36) * 6  # up to two writer calls, then one of 6 answerers
    assert max(len(route) for route in routes.values()) == orchestra.MAX_CALLS
    task = of("lookup")[0]
    values = {v.route: v for v in orchestra.route_values(task, writers, PER_TURN_USD, 0.01)}
    # search-3 finds the passage 69% of the time; answer-4 reads it 70%; otherwise it faces the
    # decoy passage (an unrelated observation: x0.15) knowing nothing of the made-up world (3%).
    assert values["search-3>answer-4"].accuracy == pytest.approx(0.69 * 0.70 + 0.31 * 0.03 * 0.15)
    # Asked again, a model repeats itself: a second search-3 adds nothing when it was right and
    # a second unrelated passage when it was wrong.
    assert values["search-3>search-3>answer-4"].accuracy == pytest.approx(
        0.69 * 0.70 + 0.31 * 0.03 * 0.15**2
    )
    assert values["answer-4"].accuracy == pytest.approx(0.03)
    assert values["search-3>answer-4"].shape == {"search", "answer"}


def test_the_oracle_expects_what_played_episodes_score(config, writers):
    """Expected accuracy of two routes against 120 played episodes each (real retriever and
    sandbox, simulated writers): within three standard errors."""
    lookup, computed = of("lookup")[1], of("lookup_compute")[1]
    for task, name in ((lookup, "search-3>answer-4"), (computed, "search-2>reasoner-3>answer-4")):
        route = orchestra.routes(writers)[name]
        outcomes = [
            answer == task.answer
            for _, answer in play(config, [(task, route, seed) for seed in range(120)])
        ]
        expected = next(
            v.accuracy
            for v in orchestra.route_values(task, writers, PER_TURN_USD, 0.01)
            if v.route == name
        )
        spread = 3 * (expected * (1 - expected) / len(outcomes)) ** 0.5 + 0.01
        assert abs(statistics.mean(outcomes) - expected) <= spread, (name, expected)


def test_every_group_has_a_clear_best_shape_and_preferences_change_routes(writers):
    """The world's margins: in every (family, preference) group the oracle's best route leads
    every other route by >= 0.05 expected utility on average, the same route with one model
    changed included (but not a route that asks a model twice: it sees what the route without
    the repeat sees, a turn later); it beats the best route of another shape (another set of
    tools) by >= 0.1; and in every family two preferences have different best routes."""
    groups = defaultdict(list)
    for task in TASKS[:240]:
        values = sorted(
            orchestra.route_values(task, writers, PER_TURN_USD, 0.01),
            key=lambda value: -value.utility,
        )
        top = values[0]
        rival = next(v for v in values[1:] if not orchestra.repeats_a_call(v.route))
        other = max((v for v in values if v.shape != top.shape), key=lambda v: v.utility)
        groups[(task.metadata["family"], task.metadata["preference_name"])].append(
            (top, rival, other)
        )
    print(
        f"\n{'family':15} {'preference':10} {'tasks':>5} {'utility':>7} {'margin':>7} "
        f"{'shape':>7}  route"
    )
    modal = {}
    for (family, preference), rows in sorted(groups.items()):
        margin = statistics.mean(top.utility - rival.utility for top, rival, _ in rows)
        shape_margin = statistics.mean(top.utility - other.utility for top, _, other in rows)
        modal[family, preference] = Counter(top.route for top, _, _ in rows).most_common(1)[0][0]
        print(
            f"{family:15} {preference:10} {len(rows):5} "
            f"{statistics.mean(top.utility for top, _, _ in rows):7.3f} {margin:7.3f} "
            f"{shape_margin:7.3f}  {modal[family, preference]}"
        )
        assert margin >= 0.05 and shape_margin >= 0.1, (family, preference)
    for family, preferences in orchestra.FAMILY_PREFERENCES.items():
        assert all((family, preference) in modal for preference in preferences)
        assert len({modal[family, preference] for preference in preferences}) >= 2, family


def test_budget_tasks_state_their_budget_and_the_oracle_keeps_within_it(writers, tiny_tokenizer):
    budgeted = [task for task in TASKS if task.metadata["preference_name"] == "budget"][:10]
    assert budgeted
    for task in budgeted:
        assert task.metadata["budget_usd"] == orchestra.BUDGET_USD
        message = initial_messages(task, tiny_tokenizer)[-1]["content"]
        assert message.endswith(f"Budget: at most ${orchestra.BUDGET_USD:g} for this task.")
        top = best(orchestra.route_values(task, writers, PER_TURN_USD, 0.01))
        assert top.usd < 0.75 * orchestra.BUDGET_USD
        assert all(
            writers.experts[tool].models[arguments["model"]].counterpart != "gpt-5"
            for tool, arguments in orchestra.routes(writers)[top.route]
        )


def test_naive_routers_play_the_new_interface_and_every_route_is_named_back(config, tiny_tokenizer):
    tasks = TASKS[:40]
    settings = config.resolved_rollout(4096)  # the test tokenizer splits programs finely

    async def run():
        async with build_toolbox(config.tools) as toolbox:
            agent = NaiveRouterAgent(
                tasks, config.data.demo_routers, 0, toolbox, tiny_tokenizer, settings
            )
            episodes = [await agent.episode(task, 0, seed=0) for task in tasks]
            return agent.routes, episodes

    routes, episodes = asyncio.run(run())
    for task, trajectory in zip(tasks, episodes):
        if trajectory.termination == "budget":  # a costly route past its task's budget
            assert task.metadata["preference_name"] == "budget"
            assert routes[task.id][: len(trajectory.calls())] == tuple(trajectory.calls())
            continue
        assert trajectory.termination == "answer"
        assert route_of(trajectory) == orchestra.route_name(routes[task.id])
    tools_called = Counter(tool for route in routes.values() for tool, _ in route)
    assert set(tools_called) == {"search", "enhance_reasoning", "answer"}


def test_the_instructed_rule_reads_the_instruction_and_nothing_else(writers):
    """The one naive router that reads the preference: the tool an instruction forbids is
    dropped, a cost instruction takes the cheapest model of the strongest's line (not the math
    specialist), a balance (neutral) or a budget the next below the strongest, any other the
    strongest; the strongest router ignores the instruction."""
    instructed = orchestra.naive_routes(TASKS, writers, _only("instructed"), seed=0)
    strongest = orchestra.naive_routes(TASKS, writers, _only("strongest"), seed=0)
    cheapest = {
        orchestra.SEARCH: "search-3",
        orchestra.REASON: "reasoner-3",
        orchestra.ANSWER: "answer-4",
    }
    dearest = {
        orchestra.SEARCH: "search-1",
        orchestra.REASON: "reasoner-1",
        orchestra.ANSWER: "answer-1",
    }
    middle = {
        orchestra.SEARCH: "search-2",
        orchestra.REASON: "reasoner-2",
        orchestra.ANSWER: "answer-2",
    }
    seen = set()
    for task in TASKS:
        family, preference = task.metadata["family"], task.metadata["preference_name"]
        shape = orchestra.FAMILY_SHAPES[family]
        assert [tool for tool, _ in strongest[task.id]] == list(shape)
        assert all(arguments["model"] == dearest[tool] for tool, arguments in strongest[task.id])
        forbidden = {"no_code": orchestra.REASON, "no_search": orchestra.SEARCH}.get(preference)
        assert [tool for tool, _ in instructed[task.id]] == [t for t in shape if t != forbidden]
        for tool, arguments in instructed[task.id]:
            expected = {"cost": cheapest, "neutral": middle, "budget": middle}.get(
                preference, dearest
            )[tool]
            assert arguments["model"] == expected, (task.id, preference)
        seen.add(preference)
    assert seen == set(orchestra.PREFERENCE_VECTORS)


def test_the_tiered_router_takes_one_tier_of_the_strongests_line_for_the_whole_route(writers):
    """Each route is the family's tools at one tier (the strongest, the next, ...) of each
    tool's line of models, a tool with fewer tiers at its cheapest; every tier is drawn, so the
    demonstrations hold the middle tiers together (``search-2>answer-2``)."""
    lines = {
        orchestra.SEARCH: ["search-1", "search-2", "search-3"],
        orchestra.REASON: ["reasoner-1", "reasoner-2", "reasoner-3"],
        orchestra.ANSWER: ["answer-1", "answer-2", "answer-3", "answer-4"],
    }
    tiered = orchestra.naive_routes(TASKS, writers, _only("tiered"), seed=0)
    tiers = Counter()
    for task in TASKS:
        route = tiered[task.id]
        assert [tool for tool, _ in route] == list(orchestra.FAMILY_SHAPES[task.metadata["family"]])
        answer_tier = lines[orchestra.ANSWER].index(route[-1][1]["model"])
        for tool, arguments in route:
            assert arguments["model"] == lines[tool][min(answer_tier, len(lines[tool]) - 1)]
        tiers[answer_tier] += 1
    assert set(tiers) == {0, 1, 2, 3}
    assert tiers[1] > len(TASKS) / 8


def _only(router: str) -> dict[str, float]:
    return {name: float(name == router) for name in config_lib.DEMO_ROUTERS}


def test_a_task_restated_under_each_preference_differs_in_its_instruction_alone():
    for task in make_tasks(40, seed=11, interface=ORCHESTRA):
        family = task.metadata["family"]
        restated_tasks = restated(task, ORCHESTRA, seed=3)
        assert [t.metadata["preference_name"] for t in restated_tasks] == list(
            orchestra.FAMILY_PREFERENCES[family]
        )
        assert [t.id for t in restated_tasks] == [
            f"{task.id}@{name}" for name in orchestra.FAMILY_PREFERENCES[family]
        ]
        question = task.question.removesuffix("\n" + task.metadata["instruction"])
        for other in restated_tasks:
            name = other.metadata["preference_name"]
            assert other.question == f"{question}\n{other.metadata['instruction']}"
            assert other.metadata["preference"] == orchestra.PREFERENCE_VECTORS[name]
            assert ("budget_usd" in other.metadata) == (name == "budget")
            assert {
                key: value
                for key, value in other.metadata.items()
                if key not in ("preference_name", "instruction", "preference", "budget_usd")
            } == {
                key: value
                for key, value in task.metadata.items()
                if key not in ("preference_name", "instruction", "preference", "budget_usd")
            }
            assert other.answer == task.answer and other.system == task.system
        # the task's own preference, restated, is the task again (its phrasing aside)
        own = next(
            t
            for t in restated_tasks
            if t.metadata["preference_name"] == task.metadata["preference_name"]
        )
        assert own.metadata["preference"] == task.metadata["preference"]
        assert restated(task, ORCHESTRA, seed=3) == restated_tasks
