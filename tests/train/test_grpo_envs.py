"""``nemo-orch grpo`` on every kind of environment, from a checkpoint, on the real Megatron
policy: ToolScale (reward from the database), QA with a judge on 127.0.0.1, tau2 (its own
evaluator), a mixture of a task file and QA rows (per-source metrics, exact resume after a
kill), and the errors a user meets."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from support.cli_helpers import grpo_overrides, read_metrics, run_cli, run_cli_here

from nemo_orch.data.tasks import Task, write_tasks
from nemo_orch.faults import ENV as KILL_AT
from nemo_orch.serve.http_server import serve_json

QA_SAMPLE = "env/samples/generalthought_sample.jsonl"  # shipped under conf/


def test_grpo_on_toolscale_scores_the_database(start_checkpoint, toolscale_dir, tmp_path):
    result = run_cli(
        "grpo",
        *grpo_overrides(
            start_checkpoint,
            tmp_path,
            "env=toolscale",
            f"env.path={toolscale_dir}",
            "env.domain=shop",
        ),
    )
    assert "grpo: env=toolscale, steps 1-2" in result.stdout
    metrics = read_metrics(tmp_path / "run" / "grpo-toolscale")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(
        m["source/toolscale/share"] == 1.0 and "source/toolscale/accuracy" in m and "kl" in m
        for m in metrics
    )


def _verdict(body: dict) -> dict:
    return {
        "id": "judge",
        "object": "chat.completion",
        "model": "judge",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "correct"},
            }
        ],
        "usage": {"prompt_tokens": 50, "completion_tokens": 1, "total_tokens": 51},
    }


def test_grpo_on_qa_with_a_judge_on_localhost(start_checkpoint, tmp_path):
    with serve_json({("POST", "/v1/chat/completions"): _verdict}, url_path="/v1") as judge:
        run_cli(
            "grpo",
            *grpo_overrides(
                start_checkpoint,
                tmp_path,
                "env=qa",
                f"env.path={QA_SAMPLE}",
                "grpo.val_interval=2",
                "grpo.val_tasks=2",
                f"reward.judge_base_url={judge.url}",
                "reward.judge_model=judge",
            ),
        )
    metrics = read_metrics(tmp_path / "run" / "grpo-qa")
    assert [m["step"] for m in metrics] == [1, 2]
    assert "source/qa/reward" in metrics[0] and "val/qa/accuracy" not in metrics[0]
    assert metrics[1]["val/qa/tasks"] >= 1 and "val/qa/accuracy" in metrics[1]


@pytest.mark.tau2
def test_grpo_on_tau2_mock_is_scored_by_tau2(start_checkpoint, tmp_path):
    run_cli("grpo", *grpo_overrides(start_checkpoint, tmp_path, "env=tau2", "env.domain=mock"))
    metrics = read_metrics(tmp_path / "run" / "grpo-tau2")
    assert [m["step"] for m in metrics] == [1, 2] and "source/tau2/accuracy" in metrics[0]


@pytest.mark.tau2
def test_grpo_on_an_external_tau2_domain_is_scored_by_tau2(start_checkpoint, tmp_path):
    """A domain from a directory in tau2's layout (registered in the GRPO process itself), its
    tasks the rows of a ToolScale parquet file: one task set, so GRPO trains on it too."""
    from support.tau2_bank import write_domain, write_rows

    bank, rows = write_domain(tmp_path), write_rows(tmp_path / "bank.parquet")
    run_cli(
        "grpo",
        *grpo_overrides(
            start_checkpoint,
            tmp_path,
            "env=tau2",
            "env.domain=bank",
            f"env.tau2_domains=[{bank}]",
            f"env.path={rows}",
        ),
    )
    metrics = read_metrics(tmp_path / "run" / "grpo-tau2")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["source/tau2/share"] == 1.0 and "source/tau2/accuracy" in m for m in metrics)


@pytest.mark.tau2
def test_grpo_on_tau2_talks_with_an_llm_user(start_checkpoint, tiny_tokenizer, tmp_path):
    """Rollouts on tau2 with its LLM user (the SIMULATED one, served by the project's
    OpenAI-compatible server on 127.0.0.1), whose endpoint fails for the episodes of odd seeds:
    those are counted and left out of their groups, never trained on as failures; the others
    train."""
    from support.simulated_tau2_user import MODEL, simulated_user_reply

    from nemo_orch.rollout.engines.scripted import ScriptedEngine
    from nemo_orch.serve.openai_server import start_server

    class FlakyUser(ScriptedEngine):
        def generate(self, prompts, params, seeds=None):
            if params.seed % 2:  # the user's requests carry their episode's seed
                raise RuntimeError("the user model crashed")
            return super().generate(prompts, params, seeds)

    with start_server(
        FlakyUser(tiny_tokenizer, simulated_user_reply), tiny_tokenizer, MODEL
    ) as server:
        run_cli(
            "grpo",
            *grpo_overrides(
                start_checkpoint,
                tmp_path,
                "env=tau2",
                "env.domain=mock",
                f"env.user.base_url={server.url}",
                f"env.user.model={MODEL}",
                "env.user.max_retries=0",
                # tau2's step limit bounds a conversation (not max_turns)
                "env.user.max_steps=3",
                # Half the episodes fail: masked, and trained past.
                "rollout.max_infra_error_rate=0.5",
            ),
        )
    metrics = read_metrics(tmp_path / "run" / "grpo-tau2")
    assert [m["step"] for m in metrics] == [1, 2]
    # Each round's 4 episodes (2 prompts x 2 samples) have consecutive seeds: 2 failed, and
    # left their groups.
    assert all(
        m["masked/user_error"] == 2 * m["sampling/rounds"]
        and m["masked/rate"] == 0.5
        and "source/tau2/accuracy" in m
        for m in metrics
    )


@pytest.mark.tau2
def test_a_domain_whose_prompts_do_not_fit_the_context_exits_2(start_checkpoint, tmp_path):
    error = run_cli(
        "grpo",
        *grpo_overrides(
            start_checkpoint,
            tmp_path,
            "env=tau2",
            "env.domain=retail",
            "model.max_position_embeddings=1024",
        ),
        expect=2,
    )
    assert "env tau2: no task's prompt fits the policy's context of 1024 tokens" in error.stderr
    assert "Traceback" not in error.stderr


@pytest.fixture(scope="module")
def retail_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 (an HF directory) with 5,120 positions and a tokenizer trained on
    retail's own prompts: its domain policy and tools take ~4,700 tokens of it (~9,000 of the
    offline world's tokenizer)."""
    from nemo_orch import config as config_lib
    from nemo_orch.config import ModelConfig
    from nemo_orch.envs import build_environment
    from nemo_orch.models.hf_mapping import SeededHFWeights, save_hf_checkpoint
    from nemo_orch.models.tokenizer import render_conversation, train_tokenizer

    retail = build_environment(config_lib.load(["env=tau2", "env.domain=retail"]))
    schemas = retail.toolbox().schemas()
    texts = [
        render_conversation(
            [
                {"role": "system", "content": task.system},
                {"role": "user", "content": task.question},
            ],
            schemas,
        )
        for task in retail.tasks("train", 40, 0)
    ]
    directory = tmp_path_factory.mktemp("retail")
    train_tokenizer(texts * 2, vocab_size=2560, min_frequency=2, out_dir=directory)
    model = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        vocab_size=2560,
        max_position_embeddings=5120,
    )
    return save_hf_checkpoint(directory, SeededHFWeights(model, seed=0), model)


@pytest.mark.tau2
@pytest.mark.slow
def test_grpo_on_tau2_retail_with_a_policy_long_enough_for_its_prompts(retail_policy, tmp_path):
    """Retail's train split, its whole domain policy and tools in every prompt, on a tiny
    policy built with enough positions (from an HF directory: its architecture and tokenizer
    are taken), scored by tau2's evaluator."""
    run_cli(
        "grpo",
        f"trainer.init_from={retail_policy}",
        f"run.output_dir={tmp_path}",
        "run.name=run",
        "env=tau2",
        "env.domain=retail",
        "model.max_position_embeddings=5120",
        "grpo.max_steps=2",
        "grpo.prompts_per_step=1",
        "rollout.group_size=2",
        "grpo.micro_batch_size=1",
        "grpo.kl_coef=0",
        "rollout.max_turns=1",
        "rollout.max_new_tokens=8",
        "reward.min_group_std=0",
        "trainer.num_threads=1",
    )
    metrics = read_metrics(tmp_path / "run" / "grpo-tau2")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(
        m["source/tau2/share"] == 1.0
        and "source/tau2/accuracy" in m
        and m["sampling/skipped_context"] == 0
        for m in metrics
    )


def test_the_architecture_comes_from_the_start_and_long_prompts_are_noted(
    start_checkpoint, tmp_path
):
    """No ``model.*`` override: the shape is the checkpoint's (2 layers of 64, not the micro
    preset's 4 of 128). Tasks whose prompt does not fit the default 1,024 positions are skipped,
    counted per step and named in ``notes.json``."""
    tasks = tmp_path / "tasks.jsonl"
    long = " ".join(["seven"] * 1500)
    write_tasks(
        tasks,
        [Task(id=f"short{i}", question=f"What is {i} + {i}?", answer=str(2 * i)) for i in range(6)]
        + [Task(id=f"long{i}", question=f"{long} {i}?", answer=str(i)) for i in range(6)],
    )
    run_cli(
        "grpo",
        f"trainer.init_from={start_checkpoint}",
        f"run.output_dir={tmp_path}",
        "run.name=run",
        "env=tasks",
        f"env.path={tasks}",
        "env.val_fraction=0",
        "grpo.max_steps=2",
        "grpo.prompts_per_step=6",
        "rollout.group_size=2",
        "grpo.micro_batch_size=2",
        "rollout.max_turns=1",
        "rollout.max_new_tokens=8",
        "reward.min_group_std=0",
        "trainer.num_threads=1",
    )
    run_dir = tmp_path / "run" / "grpo-tasks"
    saved = (run_dir / "checkpoints" / "step_2" / "config.yaml").read_text()
    assert "num_layers: 2\n" in saved and "hidden_size: 64\n" in saved
    skipped = sum(m["sampling/skipped_context"] for m in read_metrics(run_dir))
    notes = json.loads((run_dir / "notes.json").read_text())["tasks"]["skipped_context"]
    assert skipped > 0 and notes["count"] == skipped
    assert notes["tasks"] and all(task.startswith("long") for task in notes["tasks"])


def _mixture(tmp_path: Path) -> list[str]:
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(
        tasks,
        [Task(id=f"t{i}", question=f"What is {i} + {i}?", answer=str(2 * i)) for i in range(12)],
    )
    return [
        "env=toolscale_qa",
        "env.sources.0.kind=tasks",
        "env.sources.0.name=mine",
        f"env.sources.0.path={tasks}",
        "grpo.max_steps=3",
        "grpo.save_interval=1",
        "grpo.prompts_per_step=4",
        "reward.combination=linear",
        "reward.linear_gamma=0",
    ]


def _comparable(metrics: list[dict]) -> list[dict]:
    """What a resumed run must reproduce: everything but wall-clock figures."""
    return [
        {
            k: v
            for k, v in m.items()
            if not k.startswith("time/") and "per_s" not in k and "seconds" not in k
        }
        for m in metrics
    ]


def test_grpo_on_a_mixture_logs_each_source_and_resumes_exactly(start_checkpoint, tmp_path):
    straight = tmp_path / "straight"
    run_cli("grpo", *grpo_overrides(start_checkpoint, straight, *_mixture(tmp_path)))
    metrics = read_metrics(straight / "run" / "grpo-toolscale_qa")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    shares = [
        m.get("source/mine/share", 0) + m.get("source/generalthought/share", 0) for m in metrics
    ]
    assert all(share == pytest.approx(1.0) for share in shares)
    assert any("source/mine/reward" in m for m in metrics)
    assert any("source/generalthought/reward" in m for m in metrics)

    killed = tmp_path / "killed"
    args = grpo_overrides(start_checkpoint, killed, *_mixture(tmp_path))
    assert (
        run_cli("grpo", *args, env={KILL_AT: "step:3"}, expect=None).returncode == -signal.SIGKILL
    )
    run_cli("grpo", *args)
    resumed = read_metrics(killed / "run" / "grpo-toolscale_qa")
    assert _comparable(resumed) == _comparable(metrics)


def test_print_config_shows_the_mixture(tmp_path):
    printed = run_cli_here("grpo", "--print-config", "env=toolscale_qa").stdout
    assert "kind: mixture" in printed and "weight: 0.5" in printed
    assert "generalthought_sample.jsonl" in printed


def test_grpo_needs_a_starting_point():
    error = run_cli_here("grpo", expect=2)
    assert "nemo-orch grpo needs trainer.init_from" in error.stderr


def test_the_main_job_stays_on_the_offline_world():
    error = run_cli_here("train", "env=qa", f"env.path={QA_SAMPLE}", expect=2)
    assert "nemo-orch train is the offline main job" in error.stderr
