"""The GRPO recipe's data path (samples, micro-batches) and the main job end to end."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter

import pytest
import torch
from support.cli_helpers import TINY_MAIN_JOB, run_cli

from nemo_orch import config as config_lib
from nemo_orch.data.sft import PAD_MULTIPLE
from nemo_orch.data.tasks import Task
from nemo_orch.reward.advantages import group_advantages
from nemo_orch.reward.combine import RewardBreakdown
from nemo_orch.rollout.trajectory import CallRecord, Trajectory, TurnRecord
from nemo_orch.train.grpo_groups import Group
from nemo_orch.train.grpo_rollouts import Rollouts
from nemo_orch.train.grpo_samples import Sample, micro_batches, samples_of
from nemo_orch.train.metrics import logged_steps


def trajectory(ids, mask, logprobs, decisions=None) -> Trajectory:
    turn = TurnRecord(
        turn=0,
        input_tokens=2,
        output_tokens=2,
        generation_seconds=0.0,
        orchestrator_cost_usd=0.0,
        finish_reason="stop",
    )
    return Trajectory(
        task_id="t",
        sample=0,
        messages=[],
        tools=[],
        token_ids=ids,
        loss_mask=mask,
        decision_mask=mask if decisions is None else decisions,
        logprobs=logprobs,
        prompt_length=2,
        turns=[turn],
        termination="answer",
        answer="1",
        wall_seconds=0.0,
    )


def breakdown(reward: float, format_errors: float = 0.0) -> RewardBreakdown:
    return RewardBreakdown(reward, {"format_errors": format_errors, "answered": 1.0})


def test_samples_carry_group_advantages_and_turns():
    config = config_lib.load()
    ids, mask, logprobs = [1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 1, 0, 1, 0], [0, 0, -1, -2, 0, -3, 0]
    group = Group(
        Task("t", "q"), [trajectory(ids, mask, logprobs)] * 2, [breakdown(1.0), breakdown(0.0)]
    )
    whole = samples_of([group], config)
    assert [s.advantage for s in whole] == [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)]
    assert whole[0].token_ids == ids and whole[0].loss_mask == mask
    turns = samples_of([group], config_lib.load(["grpo.sample_mode=turn"]))
    assert [(s.token_ids, s.loss_mask) for s in turns[:2]] == [
        (ids[:4], [0, 0, 1, 1]),
        (ids[:6], [0, 0, 0, 0, 0, 1]),
    ]
    decisions = [0, 0, 1, 0, 0, 1, 0]
    group.trajectories = [trajectory(ids, mask, logprobs, decisions)] * 2
    every = config_lib.load(["grpo.advantage_tokens=all"])
    assert samples_of([group], every)[0].advantage_mask == mask
    only = config_lib.load(["grpo.advantage_tokens=decisions"])
    assert samples_of([group], only)[0].advantage_mask == decisions
    per_turn = samples_of(
        [group], config_lib.load(["grpo.advantage_tokens=decisions", "grpo.sample_mode=turn"])
    )
    assert [s.advantage_mask for s in per_turn[:2]] == [[0, 0, 1, 0], [0, 0, 0, 0, 0, 1]]
    dropping = config_lib.load(["reward.drop_format_errors=true"])
    group.breakdowns[1] = breakdown(0.0, format_errors=1.0)
    assert len(samples_of([group], dropping)) == 1


def test_step_credit_adds_each_calls_own_advantage_on_its_tokens():
    # Three episodes, two turns each (tokens 2-3 and 5): the same first call and observation
    # for the first two, so their second turns form a step group; the third saw another
    # observation (token 9), alone at its second state.
    mask = [0, 0, 1, 1, 0, 1, 0]
    first, second = (
        trajectory([1, 2, 3, 4, 5, 6, 7], mask, [0.0] * 7),
        trajectory([1, 2, 3, 4, 5, 8, 7], mask, [0.0] * 7),
    )
    third = trajectory([1, 2, 3, 9, 5, 6, 7], mask, [0.0] * 7)
    group = Group(
        Task("t", "q"), [first, second, third], [breakdown(1.0), breakdown(0.0), breakdown(0.5)]
    )
    config = config_lib.load(["grpo.step_advantage_weight=0.5", "grpo.advantage_tokens=all"])
    episode = group_advantages([1.0, 0.0, 0.5], config.reward)
    second_turn = group_advantages([1.0, 0.0], config.reward)
    samples = samples_of([group], config)
    assert [s.advantage for s in samples] == episode
    for sample, own, later in zip(samples, episode, [*second_turn, 0.0]):
        assert sample.step_advantages == pytest.approx(
            [0, 0, 0.5 * own, 0.5 * own, 0, 0.5 * later, 0]
        )
    batch = micro_batches(samples, 3, pad_id=0)[0]
    for row, sample in zip(batch["advantages"], samples):  # one length: the order kept
        expected = [
            (sample.advantage + step) * flag
            for step, flag in zip(sample.step_advantages[1:], sample.advantage_mask[1:])
        ]
        assert row[:6].tolist() == pytest.approx(expected)
    per_turn = samples_of(
        [group], config_lib.load(["grpo.step_advantage_weight=0.5", "grpo.sample_mode=turn"])
    )
    assert [s.advantage for s in per_turn] == pytest.approx(
        [
            episode[0] * 1.5,
            episode[0] + 0.5 * second_turn[0],
            episode[1] * 1.5,
            episode[1] + 0.5 * second_turn[1],
            episode[2] * 1.5,
            episode[2],
        ]
    )
    assert all(s.step_advantages is None for s in samples_of([group], config_lib.load()))


def test_forced_exploration_tokens_are_trained_but_kept_out_of_the_kl():
    ids, mask, logprobs = [1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 0, -1, -2, 0]
    forced = dataclasses.replace(trajectory(ids, mask, logprobs), forced_mask=[0, 0, 1, 1, 0, 0, 0])
    group = Group(
        Task("t", "q"), [forced, trajectory(ids, mask, logprobs)], [breakdown(1.0), breakdown(0.0)]
    )
    samples = samples_of([group], config_lib.load(["grpo.advantage_tokens=all"]))
    assert samples[0].sampled_mask == [0, 0, 0, 0, 1, 1, 0]
    assert samples[0].advantage_mask == mask  # the forced choice still learns from its outcome
    assert samples[1].sampled_mask == mask
    per_turn = samples_of([group], config_lib.load(["grpo.sample_mode=turn"]))
    assert per_turn[0].sampled_mask == [0, 0, 0, 0, 1, 1]
    batch = next(b for b in micro_batches(samples, 2, pad_id=0))
    assert batch["kl_mask"][:, :6].tolist() == [[0, 0, 0, 1, 1, 0], [0, 1, 1, 1, 1, 0]]


def test_micro_batches_align_labels_and_pad():
    samples = [
        Sample([5, 6], [0, 1], [0.0, -1.0], -1.0, [0, 1]),
        Sample([5, 6, 7, 8], [0, 1, 1, 0], [0.0, -0.5, -0.25, 0.0], 2.0, [0, 1, 0, 0]),
    ]
    (batch,) = micro_batches(samples, micro_batch_size=2, pad_id=0)
    assert batch["tokens"].shape == (2, PAD_MULTIPLE)
    assert batch["tokens"][1, :3].tolist() == [5, 6, 7] and batch["labels"][1, :3].tolist() == [
        6,
        7,
        8,
    ]
    assert batch["loss_mask"][1, :3].tolist() == [1, 1, 0]
    assert batch["engine_logprobs"][1, :2].tolist() == [-0.5, -0.25]
    assert batch["advantages"][0, :2].tolist() == [-1.0, 0.0]
    assert batch["advantages"][1, :3].tolist() == [2.0, 0.0, 0.0]  # only where the mask says
    assert torch.equal(batch["position_ids"][0], torch.arange(PAD_MULTIPLE))


def test_micro_batches_group_by_length_and_pad_each_unless_pipelined():
    lengths = [3, 40, 5, 4]
    samples = [
        Sample(list(range(1, n + 1)), [1] * n, [0.0] * n, float(n), [1] * n) for n in lengths
    ]
    short, long = micro_batches(samples, micro_batch_size=2, pad_id=0)
    assert short["tokens"].shape == (2, PAD_MULTIPLE) and long["tokens"].shape == (2, 48)
    assert [row[0].item() for row in short["advantages"]] == [3.0, 4.0]  # the two shortest
    assert [row[0].item() for row in long["advantages"]] == [5.0, 40.0]
    piped = micro_batches(samples, micro_batch_size=2, pad_id=0, one_length=True)
    assert [batch["tokens"].shape for batch in piped] == [(2, 48), (2, 48)]


def test_main_job_end_to_end(tiny_main_job):
    directory, result = tiny_main_job
    run_dir = directory / "runs" / "e2e"
    report = json.loads((run_dir / "report.json").read_text())
    for policy in ("sft", "grpo", "oracle"):
        assert set(report[policy]) >= {
            "reward",
            "expected_reward",
            "accuracy",
            "expected_accuracy",
            "usd_per_task",
            "seconds_per_task",
            "pref_adherence",
            "oracle_route_share",
            "format_error_rate",
            "tool_mix",
        }
    assert set(report["wall_seconds"]) == {"setup", "sft", "grpo", "eval"}
    # Values, not only keys. Eight new tokens a turn cannot write a call: both policies answer
    # nothing right, so the oracle's expected reward is above theirs and they are equal (0).
    sft, grpo, oracle = report["sft"], report["grpo"], report["oracle"]
    assert oracle["reward"] > 0 and oracle["reward"] >= grpo["reward"] >= sft["reward"]
    assert oracle["oracle_route_share"] == 1.0 and oracle["pref_adherence"] == 1.0
    assert oracle["expected_reward"] == oracle["reward"]
    assert grpo["gap_closed"] == pytest.approx(
        (grpo["expected_reward"] - sft["expected_reward"])
        / (oracle["expected_reward"] - sft["expected_reward"])
    )
    for row in (sft, grpo, oracle):
        assert set(row["groups"]) == set(oracle["groups"]) == set(row["tool_mix"])
        assert all(
            sum(routes.values()) == pytest.approx(1.0)  # each group's routes, shares
            for routes in row["tool_mix"].values()
        )
        assert 0 <= row["accuracy"] <= 1 and 0 <= row["oracle_route_share"] <= 1
    fingerprint, *episodes = (
        (run_dir / "eval" / "offline" / "episodes" / "grpo.jsonl").read_text().splitlines()
    )
    assert "fingerprint" in json.loads(fingerprint) and len(episodes) == 4
    record = json.loads(episodes[0])
    assert {"reference", "result", "details"} <= record.keys() and "ledger" in record["episode"]
    assert re.fullmatch(
        r"none|tools|(tools\+)?expert:(math-small|math-large|generalist)",
        record["details"]["route"],
    )
    markdown = (run_dir / "report.md").read_text()
    assert "| grpo |" in markdown and "## Targets (grpo)" in markdown
    assert "of the SFT -> oracle gap in expected reward; targets missed: oracle route" in (
        result.stdout
    )  # routes of nothing: every route target missed, and named
    domains = report["toolscale"]["gold-replay"]
    assert set(domains) == {"shop", "clinic", "mobile"}
    assert all(row["tasks"] == 2 and row["accuracy"] == 1.0 for row in domains.values())
    assert list(report["toolscale"]) == ["gold-replay"]  # the tools' check, not the policy's
    assert len((run_dir / "toolscale" / "shop" / "tasks.jsonl").read_text().splitlines()) == 6
    assert (
        "ToolScale domain tasks, gold-replay: accuracy clinic 1.00, mobile 1.00, shop 1.00"
        in result.stdout
    )
    assert (run_dir / "curves.png").exists() and (run_dir / "routes.png").exists()
    assert (directory / "runs" / "latest").resolve() == run_dir.resolve()
    # PPO from the same SFT checkpoint, in the same run: its own stage, then one report of all.
    result = run_cli("train", *TINY_MAIN_JOB, "grpo=ppo", cwd=directory)
    report = json.loads((run_dir / "report.json").read_text())
    assert list(report)[:4] == ["sft", "grpo", "ppo", "oracle"]
    assert set(report["wall_seconds"]) == {"setup", "sft", "ppo", "eval"}
    assert report["sft"] == sft and report["grpo"] == grpo  # the cached episodes, scored again
    assert (run_dir / "ppo" / "critic" / "step_2").is_dir()
    assert list(report["toolscale"]) == ["gold-replay"]
    assert "| ppo |" in (run_dir / "report.md").read_text() and "PPO closed" in result.stdout
    metrics = [
        json.loads(line) for line in (run_dir / "grpo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all({"reward", "accuracy", "time/rollout_s", "kl"} <= m.keys() for m in metrics)
    assert "  grpo " in result.stdout and "  oracle " in result.stdout
    again = run_cli("train", *TINY_MAIN_JOB, cwd=directory)  # all complete: nothing is redone
    assert "  grpo " in again.stdout
    rerun = [
        json.loads(line) for line in (run_dir / "grpo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert rerun == metrics


def test_the_diagnosis_reads_a_main_job_run(tiny_main_job, monkeypatch, capsys):
    """scripts/diagnose_main_job.py on the run: every section, from the run's checkpoints,
    metrics and report (its numbers' arithmetic is tests/envs/test_offline_probe.py's and
    tests/envs/test_offline_metrics.py's)."""
    import runpy
    from pathlib import Path

    directory, _ = tiny_main_job
    monkeypatch.chdir(directory)
    script = Path(__file__).resolve().parents[2] / "scripts" / "diagnose_main_job.py"
    runpy.run_path(str(script))["main"](["--tasks", "2", "--samples", "2", *TINY_MAIN_JOB])
    out = capsys.readouterr().out
    for policy in ("sft", "grpo"):
        for decoding in ("greedy", "sampled"):
            assert re.search(
                rf"^\| {policy} \| {decoding} \| all \| \d+ \| [01]\.\d\d \| "
                r"[01]\.\d\d \| [01]\.\d\d \|$",
                out,
                re.MULTILINE,
            )
    assert re.search(r"^\| all \| [01]\.\d\d \| [01]\.\d\d \|$", out, re.MULTILINE)
    assert "## The batch's mix" in out and "## Where the accuracy went" in out
    report = json.loads((directory / "runs" / "e2e" / "report.json").read_text())
    assert all(
        f"| {group} | {row['tasks']} |" in out for group, row in report["sft"]["groups"].items()
    )


def test_a_resumed_run_reads_back_the_steps_before_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [
        {"step": 1, "reward": 0.1},
        {"step": 3, "reward": 0.7, "choices/echo": 4},
        {"step": 4, "reward": 0.9},
    ]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert logged_steps(tmp_path, through_step=3) == [records[0], {}, records[1]]
    assert logged_steps(tmp_path / "missing", 2) == [{}, {}]


def test_exploration_forces_the_least_chosen_routes_in_rotation(tiny_tokenizer):
    from support.fixture_tools import DelayedEcho, echo_spec

    from nemo_orch.envs import build_mixture
    from nemo_orch.tools.base import ToolSpec
    from nemo_orch.tools.registry import Toolbox

    ask = ToolSpec(
        name="ask",
        description="Ask a model.",
        parameters={
            "type": "object",
            "required": ["model"],
            "properties": {"model": {"type": "string", "enum": ["small", "large"]}},
        },
    )
    toolbox = Toolbox([DelayedEcho(echo_spec("echo")), DelayedEcho(ask)])
    config = config_lib.load(["grpo.explore_share=0.25", "rollout.group_size=8"])  # 2 of each 8
    mixture = build_mixture(config)
    rollouts = Rollouts(config, None, tiny_tokenizer, mixture, [toolbox])
    forced = rollouts.forced_choices(2, Counter({"echo": 5, "ask:large": 1}))
    assert sorted(forced) == [(0, 6), (0, 7), (1, 6), (1, 7)]
    assert [forced[key] for key in sorted(forced)] == [
        ("ask", {"model": "small"}),
        ("ask", {"model": "small"}),
        ("ask", {"model": "large"}),
        ("ask", {"model": "small"}),
    ]
    assert (
        Rollouts(config_lib.load(), None, None, mixture, [toolbox]).forced_choices(3, Counter())
        == {}
    )
    # What the policy chose itself: its first turn's first call that ran.
    episode = trajectory([1, 2], [0, 1], [0.0, 0.0])
    assert rollouts.first_choice(episode) is None
    episode.turns[0].calls += [
        CallRecord(tool="ask", arguments={"model": "large"}, error="timeout"),
        CallRecord(tool="ask", arguments={"model": "small"}),
    ]
    assert rollouts.first_choice(episode) == ("ask", {"model": "small"})
    # A curriculum stage's tools are what every task of the step offers; the step's tasks are
    # renamed after it (per-episode state is keyed by task id).
    (drawn,) = rollouts.tasks(1, 0, 4)
    assert [task.id for task in drawn.tasks] == [f"s1r0-{i:05d}" for i in range(4)]
    assert all(task.tools is None for task in drawn.tasks)
    assert all(task.tools == ("echo",) for task in rollouts.tasks(1, 0, 4, ["echo"])[0].tasks)


def test_preference_sets_roll_each_task_out_under_every_preference_it_can_have(tiny_tokenizer):
    from nemo_orch.envs import build_mixture
    from nemo_orch.envs.offline.orchestra import FAMILY_PREFERENCES
    from nemo_orch.rollout.builders import build_toolbox

    context = "model.max_position_embeddings=32768"  # the tiny tokenizer writes long prompts
    config = config_lib.load(["grpo.preference_sets=true", context])
    mixture = build_mixture(config)
    rollouts = Rollouts(config, None, tiny_tokenizer, mixture, [build_toolbox(config.tools)])
    (drawn,) = rollouts.tasks(3, 1, 8)
    # as many groups as asked, renamed after the step; the first tasks drawn, each under its
    # family's preferences in turn, the question's instruction the only difference
    assert [task.id for task in drawn.tasks] == [f"s3r1-{i:05d}" for i in range(8)]
    (plain,) = Rollouts(
        config_lib.load([context]), None, tiny_tokenizer, mixture, [build_toolbox(config.tools)]
    ).tasks(3, 1, 8)

    def base(task) -> str:
        return task.question.removesuffix("\n" + task.metadata["instruction"])

    expected = [
        (base(task), name)
        for task in plain.tasks
        for name in FAMILY_PREFERENCES[task.metadata["family"]]
    ][:8]
    assert [(base(task), task.metadata["preference_name"]) for task in drawn.tasks] == expected
    assert len({base(task) for task in drawn.tasks}) < 8
