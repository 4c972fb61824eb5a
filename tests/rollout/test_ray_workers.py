"""Rollouts on Ray (``rollout.backend=ray``): the trajectories of the local backend for the same
seeds, scoring through scorer actors, a killed worker or tool executor replaced with its episodes
run again, ``nemo-orch rollout`` and GRPO's rollouts on the pool, an MCP server's tools (and a
changed list of them) on a worker.

One Ray for the module, started as the pool starts one (127.0.0.1 only, object store capped),
with this machine's 2 CPUs; the pools' workers take half a CPU each so two pools fit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
import torch
from support.cli_helpers import run_cli_here
from support.fixture_tools import seed_and_slow_toolbox
from support.scripted_plans import plan_engine, reloadable_plan_engine, with_plan

from nemo_orch import config as config_lib
from nemo_orch.config import RayConfig
from nemo_orch.data.tasks import Task, write_tasks
from nemo_orch.envs import build_mixture
from nemo_orch.reward.builders import build_scorer
from nemo_orch.reward.outcome import OutcomeScorer
from nemo_orch.reward.scoring import by_answer, score_groups
from nemo_orch.rollout import ray_workers
from nemo_orch.rollout.builders import build_toolbox
from nemo_orch.rollout.ray_workers import RayRolloutPool
from nemo_orch.rollout.runner import episode_jobs, run_rollouts
from nemo_orch.rollout.trajectory import Trajectory
from nemo_orch.train.grpo_rollouts import Rollouts

HALF_CPU = "rollout.ray.num_cpus_per_worker=0.5"
TIMING = ("wall_seconds", "generation_seconds", "tool_seconds", "ledger", "logprobs")


def planned(task_id: str, tool: str, text: str, answer: str, reference: str | None = None) -> Task:
    """A task whose scripted policy calls ``tool`` once, then answers ``answer``."""
    return dataclasses.replace(
        with_plan(Task(task_id, f"Do {task_id}."), [(tool, {"text": text})], answer),
        answer=reference,
    )


def comparable(trajectory: Trajectory) -> dict[str, Any]:
    """Everything but times: tokens, messages, answer, calls and costs."""
    record = {key: value for key, value in trajectory.to_json().items() if key not in TIMING}
    record["turns"] = [
        (
            turn.input_tokens,
            turn.output_tokens,
            turn.finish_reason,
            [(call.tool, call.arguments, call.error, call.cost_usd) for call in turn.calls],
        )
        for turn in trajectory.turns
    ]
    return record


@pytest.fixture(scope="module")
def ray_session():
    """Ray started the way a pool starts it; its workers import the tests' helpers by name."""
    saved = os.environ.get("PYTHONPATH")
    here = Path(__file__).parent
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(here.parent), str(here), *([saved] if saved else [])]
    )
    try:
        assert ray_workers.connect(RayConfig(object_store_mb=128))
        yield
    finally:
        ray.shutdown()
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


@pytest.fixture(scope="module")
def config():
    return config_lib.load(["rollout.group_size=2", HALF_CPU])


@pytest.fixture(scope="module")
def marks(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("marks")


@pytest.fixture(scope="module")
def pool(ray_session, config, tiny_tokenizer_dir, marks):
    pool = RayRolloutPool(
        config.resolved_rollout(),
        partial(plan_engine, str(tiny_tokenizer_dir)),
        partial(seed_and_slow_toolbox, str(marks)),
        partial(build_scorer, config),
    )
    asyncio.run(pool.__aenter__())
    yield pool
    asyncio.run(pool.close())


def local_rollout(
    config, tokenizer_dir: Path, marks: Path, tasks: list[Task], seed: int
) -> list[Trajectory]:
    engine, tokenizer = plan_engine(str(tokenizer_dir))

    async def run() -> list[Trajectory]:
        async with seed_and_slow_toolbox(str(marks)) as toolbox:
            return await run_rollouts(
                tasks, 2, engine, toolbox, tokenizer, config.resolved_rollout(), seed=seed
            )

    return asyncio.run(run())


def ray_listening_addresses() -> set[str]:
    """The addresses the Ray processes this test process started listen on."""
    addresses = set()
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            if "ray" in " ".join(process.cmdline()):
                addresses |= {
                    connection.laddr.ip
                    for connection in process.net_connections(kind="inet")
                    if connection.status == psutil.CONN_LISTEN
                }
    return addresses


@pytest.mark.parametrize(
    "groups,group_size,workers", [(5, 4, 2), (3, 16, 4), (7, 2, 3), (1, 8, 2), (4, 1, 3)]
)
def test_a_group_runs_whole_on_one_worker(groups, group_size, workers):
    """Sticky routing: an episode's turns and its group's shared prompt meet on one engine (and
    its prefix cache); a worker replaced mid-rollout runs its whole chunk again."""
    jobs = episode_jobs([Task(f"t{i}", "Q?") for i in range(groups)], group_size)
    chunks = ray_workers._chunks(jobs, group_size, workers)
    assert 1 <= len(chunks) <= workers
    assert [job for chunk in chunks for job in chunk] == jobs
    owners = {}
    for worker, chunk in enumerate(chunks):
        for job in chunk:
            assert owners.setdefault(job.task.id, worker) == worker
        assert len(chunk) % group_size == 0


def test_ray_started_here_serves_on_loopback_only(ray_session):
    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
    listening = ray_listening_addresses()
    assert listening and listening <= {"127.0.0.1", "::ffff:127.0.0.1"}
    assert ray.available_resources()["object_store_memory"] <= 128 << 20


def test_episodes_on_ray_equal_local_ones_and_score_alike(pool, config, tiny_tokenizer_dir, marks):
    tasks = [
        planned("a", "seed", "x", "x", reference="x"),
        planned("b", "echo", "hi", "hi", reference="hi"),
        planned("c", "seed", "y", "z", reference="y"),
    ]
    on_ray = asyncio.run(pool.run(tasks, 2, seed=5))
    local = local_rollout(config, tiny_tokenizer_dir, marks, tasks, seed=5)
    assert [comparable(t) for t in on_ray] == [comparable(t) for t in local]
    # Episode i has seed 5 + i on whichever worker ran it.
    assert [t.messages[-2]["content"] for t in on_ray] == [
        "x seed 5",
        "x seed 6",
        "hi",
        "hi",
        "y seed 9",
        "y seed 10",
    ]

    groups = [on_ray[index * 2 : index * 2 + 2] for index in range(len(tasks))]
    expected = asyncio.run(
        score_groups(tasks, groups, config.reward, by_answer(OutcomeScorer(config.reward)))
    )
    on_actors = by_answer(pool.scorer)
    assert asyncio.run(score_groups(tasks, groups, config.reward, on_actors)) == expected
    assert [b.components["outcome"] for group in expected for b in group.breakdowns] == [
        1,
        1,
        1,
        1,
        0,
        0,
    ]
    # A scorer that dies is restarted by Ray and its calls retried.
    ray.kill(pool.scorer.actors[0], no_restart=False)
    assert asyncio.run(score_groups(tasks, groups, config.reward, on_actors)) == expected


def test_a_killed_worker_or_tool_executor_is_replaced_and_its_episodes_run_again(
    pool, config, tiny_tokenizer_dir, marks
):
    tasks = [planned(f"k{index}", "slow", f"k{index}", "done") for index in range(4)]
    expected = local_rollout(config, tiny_tokenizer_dir, marks, tasks, seed=11)
    for mark in marks.iterdir():
        mark.unlink()
    # Two workers: k0 and k1 run on the first, k2 and k3 on the second.
    before, workers = pool.replacements, [unit.worker for unit in pool.units]

    async def interrupted() -> list[Trajectory]:
        rollout = asyncio.ensure_future(pool.run(tasks, 2, seed=11))
        for _ in range(3000):  # until both workers are inside their episodes' tool calls
            if {"k0", "k2"} <= {mark.name[:2] for mark in marks.iterdir()}:
                break
            await asyncio.sleep(0.02)
        ray.kill(pool.units[0].worker)
        ray.kill(pool.units[1].executor)
        return await rollout

    trajectories = asyncio.run(interrupted())
    assert pool.replacements - before == 2
    assert all(unit.worker not in workers for unit in pool.units)
    assert [(t.task_id, t.sample) for t in trajectories] == [
        (task.id, sample) for task in tasks for sample in range(2)
    ]
    assert [comparable(t) for t in trajectories] == [comparable(t) for t in expected]
    assert all(t.messages[-2]["content"] == t.task_id and t.answer == "done" for t in trajectories)


def test_rollout_command_on_ray_equals_local(ray_session, random_policy_dir, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(
        tasks,
        [
            Task("q1", "What is 2 + 3?", system="Use tools.", answer="5"),
            Task("q2", "Who founded Esvin Labs?", tools=("search",)),
        ],
    )
    # Sampled at temperature 1: each turn's seed travels with its prompt, so the workers'
    # batches (2 workers here, one batcher locally) do not change the tokens.
    # Without the listed prices, whose JSON under the test tokenizer brings the second turn to
    # the edge of the policy's 1024 positions (where the two paths part: see the note of issue 23).
    overrides = [
        f"rollout.policy={random_policy_dir}",
        "rollout.max_turns=2",
        "rollout.max_new_tokens=12",
        "rollout.temperature=1.0",
        "tools.show_prices=false",
    ]

    def rollout(name: str, *more: str) -> list[dict[str, Any]]:
        out = tmp_path / f"{name}.jsonl"
        run_cli_here(
            "rollout", "--tasks", str(tasks), "--n", "2", "--out", str(out), *overrides, *more
        )
        return [json.loads(line) for line in out.read_text().splitlines()]

    local = rollout("local")
    on_ray = rollout("ray", "rollout.backend=ray", HALF_CPU)
    assert [(r["task_id"], r["sample"]) for r in on_ray] == [
        ("q1", 0),
        ("q1", 1),
        ("q2", 0),
        ("q2", 1),
    ]
    assert on_ray[0]["token_ids"] != on_ray[1]["token_ids"]  # a group's samples differ
    for ours, theirs in zip(on_ray, local):
        assert {k: v for k, v in ours.items() if k not in TIMING} == {
            k: v for k, v in theirs.items() if k not in TIMING
        }
        assert ours["logprobs"] == pytest.approx(theirs["logprobs"], abs=1e-5)
        assert ours["policy_tokens"] > 0
    # A worker's user error is the command's, as it is locally.
    none = run_cli_here(
        "rollout",
        "--tasks",
        str(tasks),
        "--out",
        str(tmp_path / "o.jsonl"),
        f"run.output_dir={tmp_path}",
        "rollout.backend=ray",
        "rollout.ray.num_workers=1",
        HALF_CPU,
        expect=2,
    )
    assert "rollout.policy is not set" in none.stderr


def test_grpo_rollouts_and_rewards_on_the_pool_equal_local_ones(
    pool, config, tiny_tokenizer, tiny_tokenizer_dir, marks
):
    toolbox = seed_and_slow_toolbox(str(marks))
    engine, _ = plan_engine(str(tiny_tokenizer_dir))
    mixture = build_mixture(config)  # the offline world: scored locally by its environment
    local = asyncio.run(
        Rollouts(config, engine, tiny_tokenizer, mixture, [toolbox]).groups(3, 0, 2)
    ).groups
    on_ray = asyncio.run(
        Rollouts(config, None, tiny_tokenizer, mixture, [toolbox], pool).groups(3, 0, 2)
    ).groups
    assert [group.task for group in on_ray] == [group.task for group in local]
    assert [[comparable(t) for t in group.trajectories] for group in on_ray] == [
        [comparable(t) for t in group.trajectories] for group in local
    ]
    # The same rewards, but for the episodes' wall times.
    assert [
        [(b.reward, {**b.components, "seconds": 0}) for b in group.breakdowns] for group in on_ray
    ] == [[(b.reward, {**b.components, "seconds": 0}) for b in group.breakdowns] for group in local]
    assert all(t.answer == "42" for group in on_ray for t in group.trajectories)


def test_a_refit_reaches_the_workers_episodes_in_flight(
    ray_session, config, tiny_tokenizer_dir, marks
):
    """Asynchronous GRPO on Ray: a refit while episodes wait on a tool reaches them from their
    next turn, and every turn records the version of the weights that wrote it."""
    pool = RayRolloutPool(
        config.resolved_rollout(),
        partial(reloadable_plan_engine, str(tiny_tokenizer_dir)),
        partial(seed_and_slow_toolbox, str(marks)),
        version=3,
    )

    async def main() -> list[Trajectory]:
        async with pool:
            episodes = asyncio.ensure_future(
                pool.run([planned(f"refit{i}", "slow", "x", "done") for i in range(2)], 2)
            )
            await asyncio.sleep(0.5)  # the first turns are written; the 1 s tool is running
            await asyncio.to_thread(pool.update_weights, {"w": torch.zeros(1)}, 4)
            return await episodes

    trajectories = asyncio.run(main())
    assert all(t.answer == "done" for t in trajectories)
    assert [[turn.policy_version for turn in t.turns] for t in trajectories] == [[3, 4]] * 4
    assert pool.version == 4


def test_mcp_tools_on_a_worker_and_a_changed_list_from_the_next_rollout(
    ray_session, config, tiny_tokenizer_dir
):
    """The tool executor builds its toolbox from the config, an MCP server's tools included
    (a stdio server it starts itself); the tool a rollout's call adds (reshape: list_changed)
    is offered to the worker's next rollout, and the episodes record where it came from."""
    server = Path(__file__).resolve().parents[1] / "support" / "mcp_server.py"
    tools = config_lib.load(
        [
            "tools.declarations=[]",
            f"tools.mcp=[{{name: fx, command: '{sys.executable}', "
            f"args: ['{server}', stdio], allow: [add, reshape, sleep, triple]}}]",
        ]
    ).tools
    settings = config.resolved_rollout()
    pool = RayRolloutPool(
        dataclasses.replace(settings, ray=dataclasses.replace(settings.ray, num_workers=1)),
        partial(plan_engine, str(tiny_tokenizer_dir)),
        partial(build_toolbox, tools),
    )

    async def main() -> tuple[Trajectory, Trajectory]:
        async with pool:
            (reshaped,) = await pool.run(
                [with_plan(Task("r", "Reshape."), [("fx_reshape", {})], "done")], 1
            )
            (tripled,) = await pool.run(
                [with_plan(Task("t", "Triple 4."), [("fx_triple", {"n": 4})], "done")], 1
            )
            return reshaped, tripled

    reshaped, tripled = asyncio.run(main())

    def offered(trajectory: Trajectory) -> list[str]:
        return [schema["function"]["name"] for schema in trajectory.tools]

    assert offered(reshaped) == ["fx_add", "fx_sleep", "fx_reshape"]
    assert reshaped.messages[-2]["content"] == "reshaped"
    assert offered(tripled) == ["fx_add", "fx_reshape", "fx_triple"]
    assert tripled.messages[-2]["content"] == "12"
    assert tripled.tool_sources == dict.fromkeys(offered(tripled), "fx")
