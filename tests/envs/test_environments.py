"""The environment seam: splits, deterministic draws, mixtures by weight, each kind's tasks,
tools and scoring, and bad input named by file and row."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from nemo_orch import config as config_lib
from nemo_orch.config import ConfigError
from nemo_orch.data.jsonl import DataError
from nemo_orch.data.tasks import Task, write_tasks
from nemo_orch.envs import build_environment
from nemo_orch.envs.interfaces import Environment, Scored
from nemo_orch.envs.mixture import Mixture
from nemo_orch.envs.offline.world import ORCHESTRA, held_out_tasks, make_tasks
from nemo_orch.rollout.trajectory import Trajectory
from nemo_orch.serve.http_server import serve_json

QA_SAMPLE = "env/samples/generalthought_sample.jsonl"


def answered(task: Task, answer: str) -> Trajectory:
    return Trajectory.without_tokens(
        task_id=task.id,
        sample=0,
        seed=0,
        messages=[],
        tools=[],
        turns=[],
        termination="answer",
        answer=answer,
        wall_seconds=0.0,
    )


def test_train_and_validation_partition_a_file_by_task_id(tmp_path):
    path = tmp_path / "tasks.jsonl"
    write_tasks(path, [Task(id=f"t{i}", question=f"q{i}?", answer=str(i)) for i in range(200)])
    env = build_environment(
        config_lib.load(["env=tasks", f"env.path={path}", "env.val_fraction=0.25"])
    )
    train, validation = env.tasks("train", None, 0), env.tasks("validation", None, 0)
    assert {t.id for t in train} | {t.id for t in validation} == {f"t{i}" for i in range(200)}
    assert not {t.id for t in train} & {t.id for t in validation}
    assert 30 <= len(validation) <= 70
    assert [t.id for t in env.tasks("test", None, 0)] == [f"t{i}" for i in range(200)]
    # A draw is deterministic for its seed, distinct tasks, and the split does not depend on it.
    assert env.tasks("train", 8, 3) == env.tasks("train", 8, 3) != env.tasks("train", 8, 4)
    assert len({t.id for t in env.tasks("train", 8, 3)}) == 8
    shuffled = build_environment(
        config_lib.load(["env=tasks", f"env.path={path}", "env.val_fraction=0.25", "env.limit=50"])
    )
    assert {t.id for t in shuffled.tasks("validation", None, 0)} <= {t.id for t in validation}


def test_an_environment_gives_a_tokenizer_its_own_text(tmp_path):
    """By default its train tasks' prompts; the offline world's, its generated conversations
    (tool markup included). Copy conversations only where the environment has them."""
    from nemo_orch.envs.offline.generator import copy_conversations, generate_conversations

    path = tmp_path / "tasks.jsonl"
    write_tasks(path, [Task(id=f"t{i}", question=f"q{i}?", system="s") for i in range(20)])
    env = build_environment(config_lib.load(["env=tasks", f"env.path={path}"]))
    conversations = env.tokenizer_conversations(5, 0)
    assert [c["messages"] for c in conversations] == [
        [{"role": "system", "content": "s"}, {"role": "user", "content": task.question}]
        for task in env.tasks("train", 5, 0)
    ]
    assert env.copy_conversations(0, 0) == []
    with pytest.raises(ConfigError, match="data.num_copy_conversations=0"):
        env.copy_conversations(3, 0)
    offline = build_environment(config_lib.load())
    assert offline.tokenizer_conversations(7, 3) == generate_conversations(7, 3)
    assert offline.copy_conversations(4, 5) == copy_conversations(4, 5)


class Fixed(Environment):
    def __init__(self, name: str, size: int) -> None:
        self.name, self.notes = name, {}
        self.pool = [Task(id=f"{name}{i}", question="q") for i in range(size)]

    def tasks(self, split, count, seed):
        import random

        return random.Random(seed).sample(self.pool, min(count, len(self.pool)))

    def toolbox(self):
        raise NotImplementedError

    async def score(self, task, trajectory):
        raise NotImplementedError


def test_a_mixture_draws_by_weight_and_a_single_source_as_itself():
    mixture = Mixture([Fixed("a", 10_000), Fixed("b", 10_000)], [0.75, 0.25])
    counts = Counter()
    for seed in range(40):
        for drawn in mixture.draw("train", 100, seed):
            counts[drawn.environment.name] += len(drawn.tasks)
    assert counts["a"] / 4000 == pytest.approx(0.75, abs=0.03)
    assert mixture.draw("train", 64, 5)[0].tasks == mixture.draw("train", 64, 5)[0].tasks
    alone = Fixed("a", 100)
    (drawn,) = Mixture([alone], [1.0]).draw("train", 8, 11)
    assert drawn.tasks == alone.tasks("train", 8, 11)


def test_the_offline_world_is_the_main_jobs():
    config = config_lib.load(["eval.tasks=20"])
    env = build_environment(config)
    assert env.preferences and env.tasks("test", None, 0) == held_out_tasks(20, ORCHESTRA)
    # GRPO's tasks of a step are make_tasks with the step's seed, as before environments.
    assert [t.question for t in env.tasks("train", 6, 99)] == [
        t.question for t in make_tasks(6, 99, interface=ORCHESTRA)
    ]
    assert not {t.question for t in env.tasks("validation", 50, 0)} & {
        t.question for t in env.tasks("test", None, 0)
    }
    with pytest.raises(ValueError, match="unbounded"):
        env.tasks("train", None, 0)


def test_qa_rows_read_with_configured_columns_and_bad_rows_named(tmp_path):
    env = build_environment(config_lib.load(["env=qa", f"env.path={QA_SAMPLE}"]))
    tasks = env.tasks("test", None, 0)
    assert len(tasks) == 32 and tasks[0].id == "gt-000" and tasks[0].answer == "2156"
    custom = tmp_path / "mine.jsonl"
    custom.write_text(
        json.dumps({"problem": "2+2?", "solution": 4, "docs": ["d1"]})
        + "\n"
        + json.dumps({"problem": "3+3?"})
        + "\n"
    )
    with pytest.raises(DataError, match=r"mine.jsonl:2: answer or reference_answer"):
        build_environment(
            config_lib.load(
                [
                    "env=qa",
                    f"env.path={custom}",
                    "env.documents_column=docs",
                    "env.retrieval.scope=oracle",
                ]
            )
        )
    custom.write_text(json.dumps({"problem": "2+2?", "solution": 4, "docs": ["d1"]}) + "\n")
    (task,) = build_environment(
        config_lib.load(
            [
                "env=qa",
                f"env.path={custom}",
                "env.documents_column=docs",
                "env.retrieval.scope=oracle",
            ]
        )
    ).tasks("test", None, 0)
    assert (task.id, task.question, task.answer, task.allowed_documents) == (
        "qa-0",
        "2+2?",
        "4",
        frozenset({"d1"}),
    )
    with pytest.raises(config_lib.ConfigError, match="read only by env.retrieval.scope=oracle"):
        config_lib.load(["env=qa", f"env.path={custom}", "env.documents_column=docs"])


def _verdict(body: dict) -> dict:
    return {
        "id": "j",
        "object": "chat.completion",
        "model": "judge",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "correct"},
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
    }


def test_qa_scores_exact_first_then_asks_the_judge_on_localhost():
    requests = []

    def judge(body: dict) -> dict:
        requests.append(body)
        return _verdict(body)

    with serve_json({("POST", "/v1/chat/completions"): judge}, url_path="/v1") as server:
        env = build_environment(
            config_lib.load(
                [
                    "env=qa",
                    f"env.path={QA_SAMPLE}",
                    f"reward.judge_base_url={server.url}",
                    "reward.judge_model=judge",
                ]
            )
        )
        task = env.tasks("test", 1, 0)[0]
        exact = asyncio.run(env.score(task, answered(task, task.answer)))
        assert isinstance(exact, Scored) and exact.outcome.correct and requests == []
        judged = asyncio.run(env.score(task, answered(task, "the digits add up to it")))
    assert judged.outcome.method == "judge" and judged.outcome.correct and len(requests) == 1


def test_toolscale_counts_domains_and_replays_gold(toolscale_dir):
    env = build_environment(config_lib.load(["env=toolscale", f"env.path={toolscale_dir}"]))
    assert env.notes["tasks_by_domain"] == {"clinic": 6, "mobile": 6, "shop": 6}
    task = env.tasks("test", None, 0)[0]
    assert task.tools and env.gold_plan(task).actions
    # Its own tools only by default; env.tools adds declared ones beside them.
    shop = [t for t in env.tasks("test", None, 0) if t.id.startswith("shop/")][0]
    extra = build_environment(
        config_lib.load(
            [
                "env=toolscale",
                f"env.path={toolscale_dir}",
                "env.domain=shop",
                "env.tools=[tools/offline]",
            ]
        )
    ).tasks("test", None, 0)[0]
    assert extra.id == shop.id
    assert extra.tools == (*shop.tools, "call_expert", "python_sandbox", "search")


def test_an_option_of_another_kind_and_moved_keys_are_refused():
    with pytest.raises(ConfigError, match="a tau2 environment has no option id_column"):
        config_lib.load(["env=tau2", "env.id_column=qid"])
    with pytest.raises(ConfigError, match="eval.limit is now env.limit"):
        config_lib.load(["eval.limit=3"])
    with pytest.raises(ConfigError, match=r"env.sources\[0\].weight must be > 0"):
        config_lib.load(["env=toolscale_qa", "env.sources.0.weight=0"])
    with pytest.raises(ConfigError, match="a mixture has several environments"):
        build_environment(config_lib.load(["env=toolscale_qa"]))


@pytest.mark.tau2
def test_tau2_mock_has_one_task_set_for_every_split():
    env = build_environment(
        config_lib.load(["env=tau2", "env.domain=mock", "env.val_fraction=0.3"])
    )
    test, train = env.tasks("test", None, 0), env.tasks("train", None, 0)
    assert len(test) == 9 and 0 < len(train) < 9
    assert env.has_gold_plan and env.user_toolbox() is not None
