"""The preference probe: total-variation distances between one task's route distributions
under two preferences, against the oracle's; run through the offline world's real tools with a
scripted policy whose routes depend on the instruction exactly as written."""

import asyncio
import json
from collections import Counter

import pytest

from nemo_orch import config as config_lib
from nemo_orch.config import RolloutConfig
from nemo_orch.data.tasks import Task
from nemo_orch.envs import build_environment
from nemo_orch.envs.offline.probe import probe, separation, total_variation
from nemo_orch.rollout.engines.scripted import ScriptedEngine


def test_total_variation_is_half_the_l1_distance_of_the_shares():
    assert total_variation(Counter(a=2, b=2), Counter(a=4)) == pytest.approx(0.5)
    assert total_variation(Counter(a=1), Counter(b=3)) == 1.0
    assert total_variation(Counter(a=1, b=3), Counter(a=2, b=6)) == 0.0


def test_separation_averages_each_tasks_preference_pairs_per_family():
    def task(name: str, family: str) -> Task:
        return Task(name, "q", metadata={"family": family})

    tasks = [
        task("t1@accuracy", "math"),
        task("t1@cost", "math"),
        task("t1@no_code", "math"),
        task("t2@accuracy", "word"),
        task("t2@cost", "word"),
    ]
    routes = {
        "t1@accuracy": ["reasoner-1>answer-1"] * 2,
        "t1@cost": ["reasoner-1>answer-4", "reasoner-3>answer-4"],
        "t1@no_code": ["answer-1", "answer-1"],
        "t2@accuracy": ["answer-1", "answer-4"],
        "t2@cost": ["answer-1", "answer-4"],
    }
    best = {
        "t1@accuracy": "reasoner-1>answer-1",
        "t1@cost": "reasoner-3>answer-4",
        "t1@no_code": "answer-1",
        "t2@accuracy": "answer-1",
        "t2@cost": "answer-4",
    }
    found = separation(tasks, routes, best)
    # math's three pairs: accuracy-cost 1.0 (first call 0.5), accuracy-no_code 1.0 (1.0),
    # cost-no_code 1.0 (1.0); word's one pair: the same routes
    assert found["math"].policy == pytest.approx(1.0)
    assert found["math"].first_call == pytest.approx((0.5 + 1.0 + 1.0) / 3)
    assert found["math"].oracle == 1.0 and found["math"].pairs == 3
    assert (found["word"].policy, found["word"].oracle, found["word"].pairs) == (0.0, 1.0, 1)
    assert found["all"].pairs == 4 and found["all"].policy == pytest.approx(0.75)


def test_a_policy_that_reads_the_cost_instruction_alone_is_measured_so(tiny_tokenizer):
    config = config_lib.load()
    environment = build_environment(config)
    tasks = [
        task for task in environment.tasks("test", None, 0) if task.metadata["family"] == "word"
    ][:3]

    def reply(prompt: str) -> str:
        # the last user message's instruction decides: cheap under a cost phrase
        question = prompt.rsplit("<|im_start|>user", 1)[1]
        cheap = any(word in question for word in ("cost", "cheap"))
        call = {"name": "answer", "arguments": {"model": "answer-4" if cheap else "answer-1"}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    settings = RolloutConfig(
        max_context_tokens=8192, max_turns=2, max_concurrent_episodes=4, max_batch_size=4
    )
    found = asyncio.run(
        probe(
            environment,
            tasks,
            ScriptedEngine(tiny_tokenizer, reply),
            tiny_tokenizer,
            settings,
            samples=2,
        )
    )
    # word's preferences: accuracy, cost, no_search; the oracle answers with answer-1 under
    # accuracy and no_search, answer-4 under cost (tests/envs/test_offline_orchestra.py)
    word = found["word"]
    assert word.pairs == 3 * len(tasks)
    assert word.policy == pytest.approx(2 / 3) and word.first_call == pytest.approx(2 / 3)
    assert word.oracle == pytest.approx(2 / 3)
