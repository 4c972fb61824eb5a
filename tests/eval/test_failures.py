"""What an evaluation reports when something outside the system fails: every call counted by
tool and kind, the episodes an expert's outage decided listed and left out of accuracy (and run
again by a resumed evaluation); and the fixed routers running outside the offline world's
simulated experts (a gold action that fails: ``tests/eval/test_tau2_eval.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.cli_helpers import run_cli_here
from support.local_http import JSONServer

from nemo_orch import config as config_lib
from nemo_orch.data.tasks import Task, write_tasks
from nemo_orch.eval import harness


class Expert(JSONServer):
    """An OpenAI-shaped expert on 127.0.0.1: while ``down``, 500 for the questions that say
    ``flaky``; an empty reply to those that say ``blank``; else the answer 4. Keeps each
    question it was asked."""

    def __init__(self) -> None:
        self.down, self.asked = True, []

        def answer(path, headers, body):
            question = body["messages"][-1]["content"]
            self.asked.append(question)
            if self.down and "flaky" in question:
                return 500, {"error": {"message": "the GPU fell off the bus"}}, {}
            content = "" if "blank" in question else "<answer>4</answer>"
            return (
                200,
                {
                    "model": "m",
                    "choices": [
                        {"index": 0, "finish_reason": "stop", "message": {"content": content}}
                    ],
                    "usage": {"prompt_tokens": 9, "completion_tokens": 3},
                },
                {},
            )

        super().__init__(answer, url_path="/v1")


def _expert_declaration(directory: Path, url: str) -> Path:
    path = directory / "call_expert.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "call_expert",
                "description": "Ask the expert.",
                "parameters": {
                    "type": "object",
                    "required": ["model", "question"],
                    "properties": {
                        "model": {"type": "string", "enum": ["m"]},
                        "question": {"type": "string"},
                    },
                },
                "class": "nemo_orch.tools.llm.LLMTool",
                "options": {
                    "max_retries": 0,
                    "guard": {"failures": 0},
                    "models": {"m": {"base_url": url, "model": "m", "usd_per_million": [1.0, 2.0]}},
                },
            }
        )
    )
    return path


def test_an_outage_is_counted_left_out_of_accuracy_and_run_again_on_resume(
    tmp_path, tiny_tokenizer_dir
):
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(
        tasks,
        [
            Task(id=f"{kind}{i}", question=f"{kind} question {i}: 2 + 2?", answer="4")
            for kind in ("plain", "flaky", "blank")
            for i in (0, 1)
        ],
    )
    with Expert() as expert:
        args = [
            "eval",
            "--benchmark",
            "tasks",
            "--agent",
            "fixed:cheapest",
            f"env.path={tasks}",
            f"tools.declarations=[{_expert_declaration(tmp_path, expert.url)}]",
            f"tokenizer.path={tiny_tokenizer_dir}",
            "model.vocab_size=1024",
            f"eval.out_dir={tmp_path / 'eval'}",
            "rollout.max_turns=3",
        ]
        first = run_cli_here(*args)
        report = json.loads((tmp_path / "eval" / "report.json").read_text())
        markdown = (tmp_path / "eval" / "report.md").read_text()
        expert.down, asked = False, len(expert.asked)
        resumed = run_cli_here(*args)
        rerun = expert.asked[asked:]
    row = report["systems"]["fixed:cheapest"]
    # The outage decided two episodes: listed with the endpoint and why, not scored.
    assert (row["tasks"], row["scored"], row["infra_decided"]) == (6, 4, 2)
    assert [
        (item["episode"], item["reason"], item["endpoint"])
        for item in row["infra_decided_episodes"]
    ] == [
        ("flaky0@0", "infra_error", "call_expert(model=m)"),
        ("flaky1@0", "infra_error", "call_expert(model=m)"),
    ]
    assert all(
        "HTTP 500: the GPU fell off the bus" in item["detail"]
        for item in row["infra_decided_episodes"]
    )
    # The empty replies are the system's (its choice of expert): scored wrong, and counted.
    assert (row["correct"], row["accuracy"]) == (2, 0.5)
    assert row["call_kinds"] == {
        "ok": 2,
        "truncated": 0,
        "refused": 0,
        "tool_error": 0,
        "infra_error": 2,
        "empty": 2,
    }
    assert row["calls_by_tool"] == {"call_expert": {"ok": 2, "infra_error": 2, "empty": 2}}
    assert row["failed_calls_per_task"] == pytest.approx(4 / 6)
    assert "| fixed:cheapest | call_expert | 2 | 0 | 0 | 0 | 2 | 2 |" in markdown
    assert (
        "Decided by infrastructure, fixed:cheapest: 2 episodes, left out of its accuracy; "
        "a resumed evaluation runs them again."
    ) in markdown
    assert "- flaky0@0: infra_error at call_expert(model=m): " in markdown
    (line,) = [line for line in first.stdout.splitlines() if "fixed:cheapest" in line]
    assert line.split()[1:3] == ["6", "0.500"] and line.split()[-3:] == ["0.67", "2", "0"]
    assert "2 episodes decided by infrastructure failures, left out of accuracy" in first.stdout
    # Run again, the expert back: only the two episodes the outage decided ran.
    assert sorted(rerun) == ["flaky question 0: 2 + 2?", "flaky question 1: 2 + 2?"]
    again = json.loads((tmp_path / "eval" / "report.json").read_text())["systems"]["fixed:cheapest"]
    assert (again["scored"], again["infra_decided"], again["correct"]) == (6, 0, 4)
    assert "decided by infrastructure" not in resumed.stdout


def test_an_evaluation_that_scored_nothing_exits_2(tmp_path, tiny_tokenizer_dir):
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(
        tasks, [Task(id=f"flaky{i}", question=f"flaky question {i}", answer="4") for i in range(2)]
    )
    with Expert() as expert:
        failed = run_cli_here(
            "eval",
            "--benchmark",
            "tasks",
            "--agent",
            "fixed:cheapest",
            f"env.path={tasks}",
            f"tools.declarations=[{_expert_declaration(tmp_path, expert.url)}]",
            f"tokenizer.path={tiny_tokenizer_dir}",
            "model.vocab_size=1024",
            f"eval.out_dir={tmp_path / 'eval'}",
            expect=2,
        )
    assert failed.stderr.strip().splitlines()[-1] == (
        "nemo-orch eval: error: no episode of fixed:cheapest was scored: infrastructure "
        "failures decided every one (see the report); run the same command again once the "
        "endpoints are back"
    )
    row = json.loads((tmp_path / "eval" / "report.json").read_text())["systems"]["fixed:cheapest"]
    assert (row["scored"], row["accuracy"], row["usd_per_task"]) == (0, None, None)
    assert (
        "| fixed:cheapest | 2 | n/a (0.000-1.000) | 2 |"
        in (tmp_path / "eval" / "report.md").read_text()
    )


def test_fixed_routers_run_beside_served_experts_and_on_tasks_of_no_family(
    tmp_path, tiny_tokenizer_dir, monkeypatch
):
    from support.simulated_openai import SimulatedOpenAI

    monkeypatch.setenv("OPENAI_API_KEY", "sk-local")
    base = [f"tokenizer.path={tiny_tokenizer_dir}", "model.vocab_size=1024", "rollout.max_turns=4"]
    with SimulatedOpenAI(
        "gpt-5", reasoning=False, key=None, reply=lambda body: "<answer>42</answer>"
    ) as served:
        # The offline benchmark with served experts: routed and scored, but no oracle knows
        # their routes: preference adherence is not judged, and the report says so.
        endpoints = [
            f"+tools.endpoints.{alias}={served.url}"
            for alias in ("frontier", "math", "coder", "generalist")
        ]
        offline = harness.run(
            config_lib.load(
                [
                    *base,
                    "tools=experts",
                    *endpoints,
                    "eval.tasks=3",
                    f"eval.out_dir={tmp_path / 'offline'}",
                ]
            ),
            ["fixed:cheapest"],
        )
        report = json.loads(offline.report.read_text())
        row = report["systems"]["fixed:cheapest"]
        assert row["tasks"] == 3 and row["pref_adherence"] is None
        assert row["call_kinds"]["ok"] == 3 and row["infra_decided"] == 0
        assert report["notes"]["preference adherence"].startswith(
            "not judged: the oracle knows only the simulated experts"
        )
    # A QA file's tasks have no family: on ToolOrchestra's interface, the router hands each
    # to one answerer.
    qa = tmp_path / "qa.jsonl"
    qa.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i)})
            + "\n"
            for i in range(3)
        )
    )
    summary = harness.run(
        config_lib.load([*base, "env=qa", f"env.path={qa}", f"eval.out_dir={tmp_path / 'qa'}"]),
        ["fixed:strongest"],
    )
    episodes = tmp_path / "qa" / "episodes" / "fixed-strongest.jsonl"
    records = [json.loads(line) for line in episodes.read_text().splitlines()[1:]]
    assert summary.systems["fixed:strongest"]["tasks"] == 3
    assert all(
        [call["tool"] for turn in record["episode"]["ledger"] for call in turn["calls"]]
        == ["answer"]
        for record in records
    )


def test_fixed_routers_choose_among_served_experts_on_the_reference_interface():
    from nemo_orch.eval.agents import expert_prices
    from nemo_orch.rollout.builders import build_toolbox

    toolbox = build_toolbox(config_lib.load(["tools=reference"]).tools)
    prices = expert_prices(toolbox)
    assert sorted(prices) == ["answer", "enhance_reasoning", "search"]
    assert "answer-1" in prices["answer"] and "reasoner-1" in prices["enhance_reasoning"]
