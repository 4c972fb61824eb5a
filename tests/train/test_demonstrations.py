"""SFT from successful trajectories: an agent's episodes on an environment's train split, kept
where the environment scores them correct (``data.demo_agent``), and ``nemo-orch sft`` on them."""

from __future__ import annotations

import json
from collections import Counter

from support.cli_helpers import TINY_LONG_MODEL, run_cli, run_cli_here, small_sft_overrides

from nemo_orch import config as config_lib
from nemo_orch.config import NAIVE_ROUTERS
from nemo_orch.envs import build_environment
from nemo_orch.eval import harness
from nemo_orch.eval.systems import System


def test_naive_router_demonstrations_are_right_and_use_every_route(tiny_tokenizer):
    # The test tokenizer learnt the legacy interface's conversations: the priced listing of the
    # main job's tools takes it ~900 tokens (a run's own, in its compact format: ~110).
    # The context grows to fit.
    config = config_lib.load(["model.max_position_embeddings=2048"])
    offline = build_environment(config)
    tasks = offline.tasks("train", 60, config.run.seed)
    episodes = harness.successful_episodes(
        config, offline, System(NAIVE_ROUTERS, NAIVE_ROUTERS), 60, tiny_tokenizer
    )
    # Wrong routes (e.g. an answer without a search on a lookup of the made-up world) are dropped.
    assert 15 <= len(episodes) < len(tasks)
    answers = {task.id: task.answer for task in tasks}
    order = [task.id for task in tasks]
    assert [e.task_id for e in episodes] == sorted((e.task_id for e in episodes), key=order.index)
    assert all(episode.answer == answers[episode.task_id] for episode in episodes)
    used = Counter()
    for episode in episodes:
        used.update(episode.tool_counts())
        # The answer tool's answer ends the episode: the policy only chooses tools and models.
        assert episode.messages[-1]["role"] == "assistant"
        assert '"name": "answer"' in episode.messages[-1]["content"]
    assert set(used) == {"search", "enhance_reasoning", "answer"}


def test_demonstrations_can_be_kept_by_how_well_they_serve_the_preference(tiny_tokenizer):
    """``data.demo_min_adherence``: of the correct episodes, only those whose route's expected
    utility is near the best route's for the task's preference (the oracle's adherence)."""
    config = config_lib.load(["model.max_position_embeddings=2048", "data.demo_min_adherence=0.9"])
    offline = build_environment(config)
    system = System(NAIVE_ROUTERS, NAIVE_ROUTERS)
    kept = harness.successful_episodes(config, offline, system, 60, tiny_tokenizer)
    every = harness.successful_episodes(
        config_lib.load(["model.max_position_embeddings=2048"]), offline, system, 60, tiny_tokenizer
    )
    oracle = offline.oracle(offline.toolbox(), tiny_tokenizer)
    tasks = {task.id: task for task in offline.tasks("train", 60, config.run.seed)}
    adherence = {e.task_id: oracle.preference_adherence(tasks[e.task_id], e) for e in every}
    assert {e.task_id for e in kept} == {task for task, value in adherence.items() if value >= 0.9}
    assert 0 < len(kept) < len(every)  # the naive routers' correct episodes include poor routes


def test_sft_trains_on_the_gold_replays_of_domain_tasks(
    tmp_path, tiny_tokenizer_dir, toolscale_dir
):
    """``env=toolscale data.demo_agent=gold-replay``: each demonstration is the conversation
    of a task's gold actions (calls, outputs, closing message), and SFT trains on them."""
    result = run_cli(
        "sft",
        *small_sft_overrides(tiny_tokenizer_dir, tmp_path, "gold"),
        *TINY_LONG_MODEL,
        "data.seq_length=2560",
        "env=toolscale",
        f"env.path={toolscale_dir}",
        "data.demo_agent=gold-replay",
        "data.num_offline_conversations=5",
        "data.num_copy_conversations=0",  # the offline world's, not toolscale's
        "trainer.max_steps=2",
    )
    conversations = [
        json.loads(line)
        for line in (tmp_path / "gold" / "demonstrations.jsonl").read_text().splitlines()
    ]
    assert len(conversations) == 5
    domains = {"shop", "clinic", "mobile"}
    for conversation in conversations:
        messages = conversation["messages"]
        calls = [m["content"] for m in messages if m["role"] == "assistant"][:-1]
        assert calls and all(call.startswith("<tool_call>") for call in calls)
        assert sum(m["role"] == "tool" for m in messages) == len(calls)
        assert messages[-1]["content"].startswith("<answer>Your request has been handled.")
        names = {json.loads(call.split("\n")[1])["name"] for call in calls}
        assert names <= {tool["function"]["name"] for tool in conversation["tools"]}
    assert any(domain in json.dumps(conversations) for domain in domains)
    assert "sft: " in result.stdout and (tmp_path / "gold" / "checkpoints" / "step_2").is_dir()


def test_a_demonstrator_that_answers_nothing_right_is_a_clear_error(
    tmp_path, tiny_tokenizer_dir, random_policy_dir
):
    """A random policy (the orchestrator of ``rollout.policy``, on the CPU engine) answers no
    offline task right: one line, exit 2, nothing written."""
    error = run_cli(
        "sft",
        *small_sft_overrides(tiny_tokenizer_dir, tmp_path, "none"),
        "data.demo_agent=orchestrator",
        f"rollout.policy={random_policy_dir}",
        "data.num_offline_conversations=3",
        "rollout.max_turns=1",
        "rollout.max_new_tokens=4",
        expect=2,
    )
    assert "answered none of its env=offline tasks right" in error.stderr
    assert not (tmp_path / "none" / "demonstrations.jsonl").exists()


def test_demonstrators_are_checked(tmp_path, tiny_tokenizer_dir, toolscale_dir):
    unknown = run_cli_here(
        "sft",
        *small_sft_overrides(tiny_tokenizer_dir, tmp_path, "x"),
        "data.demo_agent=oracle",
        expect=2,
    )
    assert "data.demo_agent must be one of" in unknown.stderr
    off_world = run_cli(
        "sft",
        *small_sft_overrides(tiny_tokenizer_dir, tmp_path, "y"),
        "env=toolscale",
        f"env.path={toolscale_dir}",
        expect=2,
    )
    assert (
        "naive-routers is a baseline of another environment; toolscale's own baselines: none"
        in (off_world.stderr)
    )
