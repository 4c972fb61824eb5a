"""The ToolScale synthesis pipeline against a real OpenAI-compatible server on 127.0.0.1 that
answers each step with canned JSON: the offline generator's ``shop`` domain and a few of its
tasks, plus tasks built to fail each validation filter and deliberately bad replies."""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from nemo_orch import cli
from nemo_orch import config as config_lib
from nemo_orch.clients.openai import OpenAIError
from nemo_orch.config import SynthConfig
from nemo_orch.data.domain import Domain
from nemo_orch.data.domain_tasks import read_domain_tasks
from nemo_orch.envs.toolscale import synth
from nemo_orch.envs.toolscale.domain_records import generate_domain
from nemo_orch.envs.toolscale.generator import generate_tasks
from nemo_orch.envs.toolscale.synth_steps import InvalidOutput, SynthError, parse_json
from nemo_orch.envs.toolscale.validate import rejection
from nemo_orch.serve.http_server import RequestError, serve_json

API_KEY = "sk-synth-test-0123456789abcdef"
KEY_ENV = "SYNTH_TEST_API_KEY"
MAX_ACTIONS = 6
SHOP = generate_domain("shop", seed=0)
SPEC = SHOP.spec.to_json()
ABOUT = {
    "name": "shop",
    "description": "An online shop selling home and office goods.",
    "policy": SPEC["policy"],
}
# Requests: 6 design steps and the purposes, then 4 task drafts and 3 rewrites (one retried).
DESIGN_REQUESTS, FULL_REQUESTS = 7, 15


def _scenario(reason: str) -> dict[str, Any]:
    return {
        "instructions": {
            "domain": "shop",
            "reason_for_call": reason,
            "known_info": "You are customer C1.",
            "task_instructions": "Ask for everything at once.",
        }
    }


def _task(reason: str, actions: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    return {
        "description": {"purpose": reason},
        "user_scenario": _scenario(reason),
        "evaluation_criteria": {
            "actions": [
                {"action_id": str(n), "name": name, "arguments": arguments}
                for n, (name, arguments) in enumerate(actions)
            ]
        },
    }


def _good_tasks() -> list[dict[str, Any]]:
    """Three generator tasks that write and leave room for one more action."""
    tasks = (
        task
        for task in generate_tasks(SHOP, seed=0)
        if 2 <= len(task.gold_actions) < MAX_ACTIONS
        and any(SHOP.spec.tools[a.name].writes for a in task.gold_actions)
    )
    return [
        {key: value for key, value in task.to_json().items() if key != "id"}
        for task in itertools.islice(tasks, 3)
    ]


ORDERS = SHOP.database["orders"].values()
DELIVERED = next(o["order_id"] for o in ORDERS if o["status"] == "delivered")
HOME = SHOP.database["customers"]["C1"]["address"]
GOOD = _good_tasks()
BAD = {  # each fails exactly one filter, in the filters' order
    "schema": _task("cancel an order", [("cancel_pending_order", {"order_id": 17})]),
    "execution": _task(
        "cancel a delivered order", [("cancel_pending_order", {"order_id": DELIVERED})]
    ),
    "no_effect": _task(
        "move to where you live",
        [("update_customer_address", {"customer_id": "C1", "address": HOME})],
    ),
    "budget": _task(
        "a long call",
        [("get_customer_details", {"customer_id": "C1"})] * MAX_ACTIONS
        + [("update_customer_address", {"customer_id": "C1", "address": "1 New St"})],
    ),
}
PURPOSES = {
    "routine requests": [GOOD[0], GOOD[1]],
    "more requests": [GOOD[2], BAD["schema"]],
    "broken requests": [BAD["execution"], BAD["no_effect"]],
    "long requests": [BAD["budget"]],
}


def _prompt(messages: list[dict[str, str]]) -> str:
    return messages[1]["content"]


def _harder(messages: list[dict[str, str]]) -> str:
    """A rewrite with one more action: a read for ``shop-0-0``, a write that fails for
    ``shop-0-1`` (so the rewrite is dropped), and for ``shop-1-0`` first a rewrite that is not
    harder (sent back), then a good one."""
    prompt = _prompt(messages)
    task, _ = json.JSONDecoder().raw_decode(prompt, prompt.index('{"id": '))
    extra = {"action_id": "extra", "name": "get_product_details", "arguments": {"product_id": "P1"}}
    if task["id"] == "shop-0-1":
        extra = {
            "action_id": "extra",
            "name": "cancel_pending_order",
            "arguments": {"order_id": DELIVERED},
        }
    if task["id"] != "shop-1-0" or len(messages) > 2:
        task["evaluation_criteria"]["actions"].append(extra)
    return "```json\n" + json.dumps({"task": task}) + "\n```"


def _tasks_for(messages: list[dict[str, str]]) -> str:
    [tasks] = [tasks for purpose, tasks in PURPOSES.items() if purpose in _prompt(messages)]
    return json.dumps({"tasks": tasks})


SCHEMA = {
    "tables": [
        {
            "name": name,
            "description": f"one of the shop's {name}",
            "key": table["key"],
            "fields": [
                {
                    "name": field,
                    "description": field,
                    **(
                        {"type": spec}
                        if isinstance(spec, str)
                        else {
                            "type": spec["type"],
                            "values": spec.get("enum"),
                            "ref": spec.get("ref"),
                        }
                    ),
                }
                for field, spec in table["fields"].items()
            ],
        }
        for name, table in SPEC["tables"].items()
    ]
}
CANNED: dict[str, Callable[[list[dict[str, str]]], str]] = {
    "domain": lambda _: json.dumps(ABOUT),
    "tables": lambda _: "```json\n" + json.dumps({"tables": list(SPEC["tables"])}) + "\n```",
    "schema": lambda _: json.dumps(SCHEMA),
    "data_model": lambda _: json.dumps({"tables": SPEC["tables"]}),
    "records": lambda _: json.dumps(
        {"records": {name: list(records.values()) for name, records in SHOP.database.items()}}
    ),
    "tools": lambda _: json.dumps({"tools": SPEC["tools"]}),
    "purposes": lambda _: json.dumps({"purposes": list(PURPOSES)}),
    "tasks": _tasks_for,
    "evolve": _harder,
}


class CannedLLM:
    """An OpenAI-compatible chat server on 127.0.0.1 that requires ``API_KEY``, answers each
    step (named on its prompt's first line) from ``CANNED`` or ``replies``, records every
    request and refuses the ``fail_at``-th one (a run killed at that point)."""

    def __init__(
        self, replies: dict[str, Callable] | None = None, fail_at: int | None = None
    ) -> None:
        self.replies = {**CANNED, **(replies or {})}
        self.fail_at = fail_at
        self.requests: list[tuple[str, list[dict[str, str]]]] = []
        self._lock = threading.Lock()
        self.handle = serve_json(
            {("POST", "/v1/chat/completions"): self.chat},
            api_key=API_KEY,
            url_path="/v1",
            name="canned-llm",
        )

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body["messages"]
        step = re.match(r"Step: (\w+)\.", _prompt(messages)).group(1)
        with self._lock:
            self.requests.append((step, messages))
            if len(self.requests) == self.fail_at:
                raise RequestError("the server went away", 400)
        return {
            "model": body["model"],
            "choices": [
                {
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": self.replies[step](messages)},
                }
            ],
            "usage": {"prompt_tokens": 1000, "completion_tokens": 500},
        }

    def steps(self) -> list[str]:
        return [step for step, _ in self.requests]

    def __enter__(self) -> CannedLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, API_KEY)


def _settings(server: CannedLLM, out: Path, **overrides: Any) -> dict[str, Any]:
    return {
        "base_url": server.handle.url,
        "model": "canned",
        "api_key_env": KEY_ENV,
        "out_dir": str(out),
        "num_purposes": 4,
        "tasks_per_purpose": 2,
        "max_actions": MAX_ACTIONS,
        "max_retries": 1,
        "concurrency": 3,
        **overrides,
    }


def _config(server: CannedLLM, out: Path, **overrides: Any) -> SynthConfig:
    return SynthConfig(**_settings(server, out, **overrides))


def _outputs(out: Path) -> tuple[str, str]:
    return (out / "shop" / "domain.json").read_text(), (out / "shop" / "tasks.jsonl").read_text()


def _request_ids(server: CannedLLM) -> set[str]:
    return {json.dumps(messages, sort_keys=True) for _, messages in server.requests}


def test_parse_json_tolerates_fences_and_thinking():
    assert parse_json('{"a": 1}') == parse_json('```json\n{"a": 1}\n```') == {"a": 1}
    assert parse_json('<think>hmm {"b": 2}</think>\nHere:\n```\n{"a": 1}\n```') == {"a": 1}
    assert parse_json('{"note": "a ```fence``` inside"}') == {"note": "a ```fence``` inside"}
    with pytest.raises(InvalidOutput, match="not valid JSON"):
        parse_json('{"a": ')


def test_pipeline_builds_a_valid_domain_and_counts_each_filter(tmp_path):
    with CannedLLM() as server:
        summary = synth.run(_config(server, tmp_path))
    domain = Domain.load(tmp_path / "shop" / "domain.json")
    assert domain.spec.to_json() == SHOP.spec.to_json() and domain.database == SHOP.database
    tasks = read_domain_tasks(tmp_path / "shop" / "tasks.jsonl")
    assert [task.id for task in tasks] == ["shop-0-0", "shop-0-1", "shop-1-0"]
    # The two good rewrites replaced their tasks; the failing one left shop-0-1 as drafted.
    assert [len(task.gold_actions) for task in tasks] == [
        len(GOOD[0]["evaluation_criteria"]["actions"]) + 1,
        len(GOOD[1]["evaluation_criteria"]["actions"]),
        len(GOOD[2]["evaluation_criteria"]["actions"]) + 1,
    ]
    assert all(rejection(domain, task, MAX_ACTIONS) is None for task in tasks)
    drafted, evolved = summary["tasks"], summary["evolved"]
    assert (drafted["seen"], drafted["kept"]) == (7, 3)
    assert drafted["dropped"] == {"schema": 1, "execution": 1, "no_effect": 1, "budget": 1}
    reasons = {r["filter"]: (r["task_id"], r["reason"]) for r in drafted["rejections"]}
    assert reasons["schema"][0] == "shop-1-1" and "order_id" in reasons["schema"][1]
    assert reasons["execution"] == (
        "shop-2-0",
        f"cancel_pending_order: orders {DELIVERED!r} has status 'delivered'; this needs 'pending'",
    )
    assert reasons["no_effect"] == ("shop-2-1", "its write actions leave the database as it was")
    assert reasons["budget"] == (
        "shop-3-0",
        f"{MAX_ACTIONS + 1} gold actions > max_actions={MAX_ACTIONS}",
    )
    assert (evolved["seen"], evolved["kept"], evolved["dropped"]["execution"]) == (3, 2, 1)
    assert summary["llm"] == {
        "calls": FULL_REQUESTS,
        "retries": 1,
        "cached": 0,
        "input_tokens": 1000 * FULL_REQUESTS,
        "output_tokens": 500 * FULL_REQUESTS,
        "usd": 0.0,
    }
    assert summary["stopped"] is None
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    # Every step's raw reply and checked result is cached under its step.
    cached = {
        path.parent.name: json.loads(path.read_text())
        for path in (tmp_path / "cache").glob("*/*.json")
    }
    assert set(cached) == {
        "domain",
        "tables",
        "schema",
        "data_model",
        "records",
        "tools",
        "purposes",
        "tasks",
        "evolve",
    }
    assert cached["tables"]["result"] == list(SPEC["tables"])
    assert cached["domain"]["raw"] == json.dumps(ABOUT)


def test_a_malformed_reply_is_sent_back_with_the_error(tmp_path):
    broken = {
        "tables": lambda messages: (
            CANNED["tables"](messages)
            if len(messages) > 2
            else '```json\n{"tables": ["customers", \n```'
        )
    }
    with CannedLLM(broken) as server:
        summary = synth.run(_config(server, tmp_path, evolve_rounds=0))
    attempts = [messages for step, messages in server.requests if step == "tables"]
    assert len(attempts) == 2 and "not valid JSON" in attempts[1][-1]["content"]
    assert attempts[1][-2] == {
        "role": "assistant",
        "content": '```json\n{"tables": ["customers", \n```',
    }
    assert summary["llm"]["retries"] == 1 and summary["tasks"]["kept"] == 3
    entry = json.loads(next((tmp_path / "cache" / "tables").glob("*.json")).read_text())
    assert [r["error"] for r in entry["rejected"]] == [
        "not valid JSON (Expecting value at line 2 column 1)"
    ]


def test_a_step_that_never_validates_fails_naming_the_step(tmp_path):
    unknown_table = {
        "tools": lambda _: json.dumps(
            {"tools": [{"name": "get_thing", "op": "get", "table": "things"}]}
        )
    }
    with CannedLLM(unknown_table) as server:
        with pytest.raises(
            SynthError,
            match=r"synth step 'tools' \(domain shop\): no valid "
            r"output in 3 attempts .*unknown table 'things'",
        ):
            synth.run(_config(server, tmp_path, max_retries=2))
    assert server.steps().count("tools") == 3 and "tasks" not in server.steps()
    assert not (tmp_path / "shop").exists()


def test_resume_after_a_kill_sends_no_cached_request(tmp_path):
    with CannedLLM() as clean:
        synth.run(_config(clean, tmp_path / "clean"))
    out = tmp_path / "resumed"
    # Killed at the 9th request, a task draft; the other drafts, in flight, finish first.
    with CannedLLM(fail_at=9) as killed:
        with pytest.raises(OpenAIError, match="server went away"):
            synth.run(_config(killed, out))
    assert killed.steps() == [
        "domain",
        "tables",
        "schema",
        "data_model",
        "records",
        "tools",
        "purposes",
        "tasks",
        "tasks",
        "tasks",
        "tasks",
    ]
    answered = _request_ids(killed) - {json.dumps(killed.requests[8][1], sort_keys=True)}
    with CannedLLM() as resumed:
        summary = synth.run(_config(resumed, out))
    assert not answered & _request_ids(resumed)
    assert resumed.steps().count("tasks") == 1 and summary["llm"]["cached"] == len(answered)
    assert len(resumed.requests) == FULL_REQUESTS - len(answered)
    assert _outputs(out) == _outputs(tmp_path / "clean")
    # Lost outputs and a lost cache entry: only that step is asked again.
    (out / "shop" / "domain.json").unlink()
    next((out / "cache" / "records").glob("*.json")).unlink()
    with CannedLLM() as again:
        synth.run(_config(again, out))
    assert again.steps() == ["records"]
    assert _outputs(out) == _outputs(tmp_path / "clean")


def test_budget_stops_cleanly_and_a_rerun_continues(tmp_path):
    with CannedLLM() as server:
        summary = synth.run(
            _config(server, tmp_path, max_llm_calls=DESIGN_REQUESTS + 1, concurrency=1)
        )
    assert len(server.requests) == DESIGN_REQUESTS + 1
    assert summary["stopped"] == f"synth.max_llm_calls={DESIGN_REQUESTS + 1} reached"
    # The first purpose's drafts are kept, unevolved: the budget ran out before their rewrites.
    assert summary["domains"][0]["tasks"] == 2 and summary["evolved"]["seen"] == 0
    assert len(read_domain_tasks(tmp_path / "shop" / "tasks.jsonl")) == 2
    assert "stopped early: synth.max_llm_calls" in "\n".join(synth.summary_lines(summary))
    with CannedLLM() as server:
        # $0.001 input + $0.001 output per request: the 3rd passes $0.005, the 4th is not sent.
        summary = synth.run(
            _config(
                server, tmp_path, max_usd=0.005, input_usd_per_million=1, output_usd_per_million=2
            )
        )
    assert len(server.requests) == 3 and summary["llm"]["usd"] == pytest.approx(0.006)
    assert summary["llm"]["cached"] == DESIGN_REQUESTS + 1
    assert summary["stopped"].startswith("synth.max_usd=0.005 reached")


def test_key_comes_from_the_environment_and_is_never_written(tmp_path, monkeypatch, capsys):
    with CannedLLM() as server:
        overrides = [f"synth.{key}={value}" for key, value in _settings(server, tmp_path).items()]
        assert cli.main(["synth", *overrides]) == 0
        printed = capsys.readouterr().out
        assert (
            "tasks: 7 drafted, 3 kept; dropped: schema 1, execution 1, no_effect 1, "
            "budget 1" in printed
        )
        written = [path.read_text() for path in tmp_path.rglob("*") if path.is_file()]
        assert len(written) > FULL_REQUESTS and not any(API_KEY in text for text in written)
        assert API_KEY not in printed
        monkeypatch.delenv(KEY_ENV)
        assert cli.main(["synth", *overrides, f"synth.out_dir={tmp_path / 'other'}"]) == 2
        assert f"environment variable {KEY_ENV}" in capsys.readouterr().err


def test_cli_user_errors_and_shipped_defaults(tmp_path, capsys):
    assert cli.main(["synth", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert config_lib.validate(yaml.safe_load(printed)).synth == SynthConfig()
    assert cli.main(["synth", f"synth.out_dir={tmp_path}"]) == 2
    assert "synth.base_url" in capsys.readouterr().err
    assert cli.main(["synth", "synth.max_usd=1"]) == 2
    assert "synth.max_usd" in capsys.readouterr().err
    unknown_table = {
        "tools": lambda _: json.dumps(
            {"tools": [{"name": "get_thing", "op": "get", "table": "things"}]}
        )
    }
    with CannedLLM(unknown_table) as server:
        assert (
            cli.main(
                [
                    "synth",
                    f"synth.base_url={server.handle.url}",
                    "synth.model=m",
                    f"synth.api_key_env={KEY_ENV}",
                    f"synth.out_dir={tmp_path}",
                ]
            )
            == 2
        )
    assert "synth step 'tools'" in capsys.readouterr().err
