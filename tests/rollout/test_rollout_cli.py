"""The command-line contracts other parts rely on: ``tools list|call|parse`` and ``rollout``."""

from __future__ import annotations

import json

import pytest
from support.cli_helpers import run_cli, run_cli_here

from nemo_orch import cli
from nemo_orch.data.tasks import Task, write_tasks

# The basic tools, whose parts the policy calls directly (the main job's composites hide them).
BASIC = "tools=offline_basic"
OFFLINE_TOOLS = ["call_expert", "python_sandbox", "search"]


def test_tools_list_prints_schemas():
    schemas = json.loads(run_cli_here("tools", "list", BASIC).stdout)
    assert [s["function"]["name"] for s in schemas] == OFFLINE_TOOLS
    composites = json.loads(run_cli_here("tools", "list").stdout)
    assert [s["function"]["name"] for s in composites] == ["answer", "enhance_reasoning", "search"]
    assert all(
        s["type"] == "function" and s["function"]["parameters"]["type"] == "object" for s in schemas
    )


@pytest.mark.parametrize(
    "name, arguments, output, error",
    [
        ("python_sandbox", {"code": "print(6 * 7)"}, "42\n", None),
        ("python_sandbox", {"code": "1/0"}, "ZeroDivisionError", "exit status 1"),
        (
            "search",
            {"query": "capital of Ultormark"},
            "The capital of Ultormark is Rikgarburg.",
            None,
        ),
        ("search", {"query": 5}, "", "'query' should be of type string"),
        ("nope", {}, "", "unknown tool 'nope'"),
    ],
)
def test_tools_call_reports_failures_in_json(name, arguments, output, error):
    result = json.loads(
        run_cli_here("tools", "call", name, BASIC, "--args", json.dumps(arguments)).stdout
    )
    assert set(result) >= {"output", "error", "cost_usd", "latency_s"}
    assert output in result["output"]
    assert (result["error"] is None) if error is None else (error in result["error"])


def test_tools_call_with_bad_json_still_exits_zero():
    result = json.loads(run_cli_here("tools", "call", "search", "--args", "{oops").stdout)
    assert "--args is not JSON" in result["error"]


def test_tools_parse_reads_stdin():
    def parse(text: str) -> dict:
        return json.loads(run_cli_here("tools", "parse", BASIC, stdin=text).stdout)

    ok = parse(
        '<think>go</think><tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
    )
    assert ok["calls"] == [{"name": "search", "arguments": {"query": "x"}}] and ok["error"] is None
    bad = parse("<tool_call>{nope}</tool_call>")
    assert bad["calls"] == [] and "not valid JSON" in bad["error"]
    assert bad["format_errors"] == ["malformed_json"]
    answer = parse("<answer>42</answer>")
    assert answer["answer"] == "42" and answer["calls"] == [] and answer["error"] is None


def test_rollout_writes_trajectories(random_policy_dir, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(
        tasks,
        [
            Task("q1", "What is 2 + 3?", system="Use tools.", answer="5"),
            Task("q2", "Who founded Esvin Labs?", tools=("search",)),
        ],
    )
    out = tmp_path / "out" / "trajectories.jsonl"
    result = run_cli(
        "rollout",
        "--tasks",
        str(tasks),
        "--n",
        "2",
        "--out",
        str(out),
        f"rollout.policy={random_policy_dir}",
        "rollout.max_turns=2",
        "rollout.max_new_tokens=12",
        "rollout.temperature=1.0",
    )
    assert "4 episodes (2 tasks x 2)" in result.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["task_id"], r["sample"]) for r in records] == [
        ("q1", 0),
        ("q1", 1),
        ("q2", 0),
        ("q2", 1),
    ]
    for record in records:
        assert record["termination"] in ("answer", "max_turns", "context_limit")
        assert len(record["token_ids"]) == len(record["loss_mask"]) == len(record["logprobs"])
        assert record["policy_tokens"] == sum(record["loss_mask"]) > 0
        assert (
            record["cost_usd"] > 0
            and record["ledger"][0]["input_tokens"] == record["prompt_tokens"]
        )
        # Sampled tokens carry their logprobs; template tokens none.
        assert all(lp < 0 for lp, m in zip(record["logprobs"], record["loss_mask"]) if m)
    assert records[2]["messages"][0] == {"role": "user", "content": "Who founded Esvin Labs?"}


def test_rollout_user_errors(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a"}\n')
    bad = run_cli_here(
        "rollout", "--tasks", str(tasks), "--out", str(tmp_path / "o.jsonl"), expect=2
    )
    assert "tasks.jsonl:1: question must be a non-empty string" in bad.stderr
    write_tasks(tasks, [Task("a", "q")])
    none = run_cli_here(
        "rollout",
        "--tasks",
        str(tasks),
        "--out",
        str(tmp_path / "o.jsonl"),
        f"run.output_dir={tmp_path}",
        expect=2,
    )
    assert "rollout.policy is not set" in none.stderr


def test_the_context_budget_is_the_loaded_policys(tiny_tokenizer_dir, tmp_path):
    # A policy with 384 positions under the default model.* (1024): its prompts are measured
    # against its own 384, so a task too long for it ends as context_limit, not as an engine
    # error, and the episode batched with it still runs.
    import shutil

    from nemo_orch.config import ModelConfig
    from nemo_orch.models.hf_mapping import SeededHFWeights, save_hf_checkpoint

    model = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        vocab_size=1024,
        max_position_embeddings=384,
    )
    policy = save_hf_checkpoint(tmp_path / "policy", SeededHFWeights(model, seed=0), model)
    for file in tiny_tokenizer_dir.iterdir():
        shutil.copy(file, policy / file.name)
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(
        tasks,
        [
            Task("long", "What is 2 + 3? " * 60, tools=("search",)),
            Task("short", "What is 2 + 3?", tools=("search",)),
        ],
    )
    out = tmp_path / "trajectories.jsonl"
    run_cli_here(
        "rollout",
        "--tasks",
        str(tasks),
        "--n",
        "1",
        "--out",
        str(out),
        f"rollout.policy={policy}",
        "rollout.max_turns=1",
        "rollout.max_new_tokens=4",
    )
    long, short = [json.loads(line) for line in out.read_text().splitlines()]
    assert long["prompt_tokens"] > 384 and long["termination"] == "context_limit"
    assert short["termination"] != "engine_error" and short["policy_tokens"] > 0


def test_overrides_may_follow_the_options(capsys):
    """``tools call NAME --args JSON key=value``: the overrides after ``--args`` apply (argparse
    alone stopped at them); anything else left over is still refused."""
    before = json.loads(
        run_cli_here(
            "tools", "call", "search", BASIC, "--args", '{"query": "capital of Ultormark"}'
        ).stdout
    )
    after = json.loads(
        run_cli_here(
            "tools", "call", "search", "--args", '{"query": "capital of Ultormark"}', BASIC
        ).stdout
    )
    assert after.pop("latency_s") >= 0 and before.pop("latency_s") >= 0
    assert after == before and after["error"] is None
    with pytest.raises(SystemExit) as refused:
        cli.main(["tools", "call", "search", "--args", "{}", "--nope"])
    assert refused.value.code == 2
    assert "unrecognized arguments: --nope" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command, shown, hidden",
    [
        ([], "nemo-orch: the command line", "``"),
        (["eval"], "accuracy (95% CI)", "95%%"),
        (["serve", "orchestrator"], "rollout.policy=CHECKPOINT|HF_DIR", None),
        (["serve", "orchestrator"], "serve.http_port", None),
        (["serve", "mcp"], "serve.mcp_transport=stdio", None),
    ],
)
def test_help_texts_read_as_text(command, shown, hidden, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([*command, "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert shown in text
    assert hidden is None or hidden not in text
