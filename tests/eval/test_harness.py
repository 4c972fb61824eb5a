"""``nemo-orch eval``: every agent kind on the offline benchmark, the judge protocol against
local servers that fail, resume after a kill, the report files, comparing runs, swapping
the tool set and price table at evaluation time, and MCP tools the policy never trained with."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from support.cli_helpers import run_cli_here

from nemo_orch import config as config_lib
from nemo_orch import faults
from nemo_orch.clients.call_store import CallStore
from nemo_orch.config import ConfigError
from nemo_orch.data.tasks import Task, write_tasks
from nemo_orch.eval import harness
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.serve.http_server import RequestError, serve_json
from nemo_orch.serve.openai_server import start_server

AGENTS = ["orchestrator", "monolith", "fixed:cheapest", "fixed:strongest", "random"]


def _overrides(tmp_path: Path, tokenizer_dir: Path, *more: str) -> list[str]:
    """Small evaluations on the offline world's basic tools unless ``more`` names others."""
    tools = [] if any(o.startswith("tools=") for o in more) else ["tools=offline_basic"]
    return [
        *tools,
        f"run.output_dir={tmp_path}",
        f"tokenizer.path={tokenizer_dir}",
        "model.vocab_size=1024",
        "eval.tasks=10",
        f"eval.out_dir={tmp_path / 'eval'}",
        "eval.monolith.time_scale=0",
        "rollout.max_turns=3",
        "rollout.max_new_tokens=16",
        *more,
    ]


def _episodes(out: Path, agent: str) -> list[dict]:
    lines = (out / "episodes" / f"{agent.replace(':', '-')}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[1:]]


def _calls(record: dict) -> list[tuple[str, dict]]:
    return [
        (call["tool"], call["arguments"])
        for turn in record["episode"]["ledger"]
        for call in turn["calls"]
    ]


def _outcomes(out: Path, agent: str) -> list[tuple]:
    return [
        (
            r["task_id"],
            r["result"]["correct"],
            r["result"]["usd"],
            r["result"]["tool_calls"],
            r["episode"]["answer"],
        )
        for r in sorted(_episodes(out, agent), key=lambda r: r["index"])
    ]


def test_every_agent_kind_on_the_offline_benchmark(tmp_path, random_policy_dir, tiny_tokenizer_dir):
    config = config_lib.load(
        _overrides(tmp_path, tiny_tokenizer_dir, f"rollout.policy={random_policy_dir}")
    )
    summary = harness.run(config, AGENTS)
    out = tmp_path / "eval"
    report = json.loads(summary.report.read_text())
    assert list(report["systems"]) == AGENTS
    assert all(row["tasks"] == 10 for row in report["systems"].values())
    for name in ("report.md", "pareto.png", "tool_mix.png", "config.yaml"):
        assert (out / name).stat().st_size > 0
    markdown = (out / "report.md").read_text()
    assert all(f"| {name}" in markdown for name in AGENTS)
    assert report["pareto_front"] and set(report["pareto_front"]) <= set(AGENTS)
    # Each system's numbers per stated preference, from the tasks' own (the paper's picture)
    stated = Counter(record["result"]["preference"] for record in _episodes(out, "random"))
    for row in report["systems"].values():
        assert {name: part["tasks"] for name, part in row["by_preference"].items()} == stated
    assert "Per stated preference" in markdown

    # Fixed routers hand every task to one expert and pay no orchestrator tokens.
    for agent, alias in (("fixed:cheapest", "math-small"), ("fixed:strongest", "math-large")):
        for record in _episodes(out, agent):
            assert _calls(record) == [("call_expert", {"model": alias})]
            assert all(turn["orchestrator_cost_usd"] == 0 for turn in record["episode"]["ledger"])
            assert record["result"]["pref_adherence"] is not None
    drawn = {_calls(record)[0][1]["model"] for record in _episodes(out, "random")}
    assert len(drawn) > 1 and drawn <= {"math-small", "math-large", "generalist"}
    # The monolith has the basic tools only, searches before answering lookups, and does
    # not route (no adherence).
    monolith = _episodes(out, "monolith")
    assert all(tool != "call_expert" for r in monolith for tool, _ in _calls(r))
    assert any(_calls(r) and _calls(r)[0][0] == "search" for r in monolith)
    assert report["systems"]["monolith"]["pref_adherence"] is None
    assert all(r["result"]["usd"] > 0 for r in monolith)
    # The orchestrator's own tokens are priced.
    orchestrator = _episodes(out, "orchestrator")
    assert all(r["episode"]["ledger"][0]["orchestrator_cost_usd"] > 0 for r in orchestrator)
    assert report["systems"]["orchestrator"]["pref_adherence"] is not None

    # Deterministic for a seed: a second run gives the same episodes.
    again = config_lib.load(
        _overrides(
            tmp_path,
            tiny_tokenizer_dir,
            f"rollout.policy={random_policy_dir}",
            f"eval.out_dir={tmp_path / 'again'}",
        )
    )
    harness.run(again, AGENTS)
    for agent in AGENTS:
        assert _outcomes(out, agent) == _outcomes(tmp_path / "again", agent), agent


MONOLITH_BASIC_TOOLS = (
    "eval.monolith.tools=[tools/offline/search.yaml,tools/offline/python_sandbox.yaml]",
    "eval.monolith.simulate=answer-1",
)
# The test tokenizer splits the priced tool listing and the programs finely: room for them.
ORCHESTRA_CONTEXT = "model.max_position_embeddings=4096"


def test_fixed_routers_and_the_monolith_on_toolorchestras_interface(tmp_path, tiny_tokenizer_dir):
    """The main job's tools: fixed routers call the tools of the task's family, each with the
    cheapest (most expensive, a random) model; the monolith gets the basic search and sandbox
    (the composites would hand it to experts) and no adherence; unseen experts and another
    price table swap in at evaluation time."""
    agents = ["monolith", "fixed:cheapest", "fixed:strongest", "random"]
    config = config_lib.load(
        _overrides(
            tmp_path, tiny_tokenizer_dir, "tools=offline", ORCHESTRA_CONTEXT, *MONOLITH_BASIC_TOOLS
        )
    )
    report = json.loads(harness.run(config, agents).report.read_text())
    out = tmp_path / "eval"
    shapes = {"search", "enhance_reasoning", "answer"}
    for agent, tier in (
        ("fixed:cheapest", {"search-3", "reasoner-3", "answer-math-2"}),
        ("fixed:strongest", {"search-1", "reasoner-1", "answer-1"}),
    ):
        for record in _episodes(out, agent):
            calls = _calls(record)
            assert {tool for tool, _ in calls} <= shapes
            # Each ends with the answer, unless a costly call passed the task's budget first.
            assert calls[-1][0] == "answer" or record["episode"]["termination"] == "budget"
            assert {arguments["model"] for _, arguments in calls} <= tier
    assert (
        report["systems"]["fixed:strongest"]["usd_per_task"]
        > 10 * report["systems"]["fixed:cheapest"]["usd_per_task"]
    )
    monolith = _episodes(out, "monolith")
    assert {tool for r in monolith for tool, _ in _calls(r)} <= {"search", "python_sandbox"}
    assert (
        any(_calls(r) for r in monolith) and report["systems"]["monolith"]["pref_adherence"] is None
    )
    # Without basic tools the monolith is refused, not handed the experts.
    refused = config_lib.load(
        _overrides(
            tmp_path, tiny_tokenizer_dir, "tools=offline", f"eval.out_dir={tmp_path / 'refused'}"
        )
    )
    with pytest.raises(ConfigError, match="eval.monolith.tools"):
        harness.run(refused, ["monolith"])
    for tools in ("offline_unseen", "offline_repriced"):
        swapped = config_lib.load(
            _overrides(
                tmp_path,
                tiny_tokenizer_dir,
                f"tools={tools}",
                ORCHESTRA_CONTEXT,
                f"eval.out_dir={tmp_path / tools}",
            )
        )
        row = json.loads(harness.run(swapped, ["fixed:strongest"]).report.read_text())["systems"][
            "fixed:strongest"
        ]
        assert row["usd_per_task"] < report["systems"]["fixed:strongest"]["usd_per_task"]


def test_price_table_and_tool_set_swap_at_evaluation_time(tmp_path, tiny_tokenizer_dir):
    def cheapest(*overrides: str) -> tuple[str, float]:
        out = tmp_path / "-".join(o.split("=")[-1] for o in overrides or ("list",))
        config = config_lib.load(
            _overrides(tmp_path, tiny_tokenizer_dir, *overrides, f"eval.out_dir={out}")
        )
        harness.run(config, ["fixed:cheapest"])
        records = _episodes(out, "fixed:cheapest")
        return (
            _calls(records[0])[0][1]["model"],
            json.loads((out / "report.json").read_text())["systems"]["fixed:cheapest"][
                "usd_per_task"
            ],
        )

    listed, repriced = cheapest(), cheapest("tools=offline_basic_repriced")
    # The small math model costs five times its list price: the generalist is cheapest now.
    assert listed[0] == "math-small" and repriced[0] == "generalist"
    unseen = cheapest("tools=offline_basic_unseen")
    assert unseen[0] == "math-small" and unseen[1] > 3 * listed[1]  # a 72B model behind it now


def _chat_body(text: str) -> dict:
    return {
        "id": "judge",
        "object": "chat.completion",
        "model": "judge",
        "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
        ],
        "usage": {"prompt_tokens": 50, "completion_tokens": 1, "total_tokens": 51},
    }


class Judge:
    """A local judge endpoint that fails (HTTP 500) or says "correct", and records how many
    requests were in flight at once."""

    def __init__(self) -> None:
        self.failing, self.requests, self.in_flight, self.most = True, 0, 0, 0
        self.lock = threading.Lock()

    def __call__(self, body: dict) -> dict:
        with self.lock:
            self.requests += 1
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            time.sleep(0.05)
            if self.failing:
                raise RequestError("the judge is down", 500)
            return _chat_body("correct")
        finally:
            with self.lock:
                self.in_flight -= 1


def _expert_reply(prompt: str) -> str:
    question = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if "Capital of France" in question:
        return "It is Paris, of course."
    if "six plus one" in question:
        return "seven"
    return "42"


@pytest.fixture(scope="module")
def expert_server(tiny_tokenizer):
    with start_server(
        ScriptedEngine(tiny_tokenizer, _expert_reply), tiny_tokenizer, "expert"
    ) as handle:
        yield handle


def _hle_setup(tmp_path: Path, expert_url: str) -> tuple[Path, Path]:
    hle = tmp_path / "hle.jsonl"
    rows = [
        {
            "id": "q1",
            "question": "What is six times seven?",
            "answer": "42",
            "answer_type": "exactMatch",
            "image": "",
        },
        {
            "id": "q2",
            "question": "Capital of France?",
            "answer": "Paris",
            "answer_type": "exactMatch",
            "image": "",
        },
        {
            "id": "q3",
            "question": "What is six plus one?",
            "answer": "7",
            "answer_type": "exactMatch",
            "image": "",
        },
        {
            "id": "q4",
            "question": "Which picture?",
            "answer": "A",
            "answer_type": "multipleChoice",
            "image": "data:image/png;base64,AAAA",
        },
    ]
    hle.write_text("".join(json.dumps(row) + "\n" for row in rows))
    experts = tmp_path / "experts.yaml"
    experts.write_text(
        json.dumps(
            {
                "name": "call_expert",
                "description": "Ask an expert model.",
                "parameters": {
                    "type": "object",
                    "required": ["model", "question"],
                    "properties": {
                        "model": {"type": "string", "enum": ["strong", "cheap"]},
                        "question": {"type": "string"},
                    },
                },
                "class": "nemo_orch.tools.llm.LLMTool",
                "options": {
                    "models": {
                        "strong": {
                            "base_url": expert_url,
                            "model": "expert",
                            "usd_per_million": [5, 20],
                        },
                        "cheap": {
                            "base_url": expert_url,
                            "model": "expert",
                            "usd_per_million": [0.1, 0.1],
                        },
                    }
                },
            }
        )
    )
    return hle, experts


def test_judge_failures_are_counted_and_endpoints_bounded(
    tmp_path, tiny_tokenizer_dir, expert_server
):
    hle, experts = _hle_setup(tmp_path, expert_server.url)
    judge = Judge()
    with serve_json({("POST", "/v1/chat/completions"): judge}, url_path="/v1") as server:

        def evaluate(out: Path) -> dict:
            config = config_lib.load(
                _overrides(
                    tmp_path,
                    tiny_tokenizer_dir,
                    "env=hle",
                    f"env.path={hle}",
                    "env.retrieval.scope=open",
                    f"eval.out_dir={out}",
                    f"tools.declarations=[{experts}]",
                    f"reward.judge_base_url={server.url}",
                    "reward.judge_model=judge",
                    "reward.judge_max_retries=1",
                    "eval.concurrency=3",
                    "eval.max_requests_per_endpoint=1",
                )
            )
            harness.run(config, ["fixed:strongest", "fixed:cheapest"])
            return json.loads((out / "report.json").read_text())

        down = evaluate(tmp_path / "down")
        failed_requests = judge.requests
        judge.failing = False
        up = evaluate(tmp_path / "up")
    row = down["systems"]["fixed:strongest"]
    # q1 matches exactly; q2 and q3 need the judge, which failed: counted, not hidden.
    assert (row["tasks"], row["correct"], row["judge_errors"]) == (3, 1, 2)
    assert down["notes"]["skipped"] == {"image": 1}
    # The report names the judge (its template) and the retrieval setting.
    assert down["notes"]["judge"] == (
        f"default (nemo-orch's judge: one word, correct or incorrect) by judge at {server.url}"
    )
    assert down["notes"]["retrieval"].startswith("open: the whole index")
    methods = {
        r["task_id"]: r["outcome"]["method"]
        for r in _episodes(tmp_path / "down", "fixed:strongest")
    }
    assert methods == {"q1": "exact", "q2": "judge_error", "q3": "judge_error"}
    assert "| 2 |" in (tmp_path / "down" / "report.md").read_text()
    # The strongest expert costs more per task than the cheapest, for the same replies.
    assert row["usd_per_task"] > down["systems"]["fixed:cheapest"]["usd_per_task"]
    # Each failed verdict (2 questions x 2 agents): one request and one retry; never more than
    # one in flight.
    assert failed_requests == 8 and judge.most == 1
    assert (
        up["systems"]["fixed:strongest"]["correct"],
        up["systems"]["fixed:strongest"]["judge_errors"],
    ) == (3, 0)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "nemo_orch.cli", *args]


def test_a_killed_evaluation_resumes_its_episodes_without_rerunning_or_double_counting(
    tmp_path, tiny_tokenizer_dir
):
    """Killed after the monolith's 7th request to its endpoint (SIMULATED, HTTP), in the middle
    of an episode, and run again: finished examples are not run again, the unfinished
    episode continues from its last request (its requests answered from the journal, none
    made twice), and the results are those of a run never killed."""
    args = [
        "eval",
        "--benchmark",
        "offline",
        "--agent",
        "monolith",
        "--agent",
        "fixed:cheapest",
        *_overrides(
            tmp_path,
            tiny_tokenizer_dir,
            "eval.tasks=12",
            "eval.concurrency=1",
            "eval.monolith.time_scale=0.02",
        ),
    ]
    out = tmp_path / "eval"
    cache = out / "episodes" / "monolith.jsonl"
    killed = subprocess.run(
        _cli(*args),
        env={**os.environ, faults.ENV: "call:7"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    before = cache.read_text().splitlines()
    assert 2 <= len(before) < 13
    with cache.open("a") as file:  # as if killed in the middle of writing a line
        file.write('{"task_id": "eval-0001')
    resumed = run_cli_here(*args).stdout
    after = cache.read_text().splitlines()
    records = [json.loads(line) for line in after[1:]]
    assert len(records) == 12 and len({r["task_id"] for r in records}) == 12
    assert after[: len(before)] == before  # finished examples were not run again
    report = json.loads((out / "report.json").read_text())
    assert report["systems"]["monolith"]["tasks"] == 12
    # The resumed run equals one that was never interrupted ...
    fresh = tmp_path / "fresh"
    run_cli_here(*args, f"eval.out_dir={fresh}")
    for agent in ("fixed:cheapest", "monolith"):
        assert _outcomes(out, agent) == _outcomes(fresh, agent)
    # ... and made its requests once: the 7 before the kill and those made after it are the
    # uninterrupted run's (each kept once in its journal); the cut episode's got theirs back.
    replayed, made = map(
        int, re.search(r"monolith: (\d+) turns and calls .* journal, (\d+) made", resumed).groups()
    )
    assert replayed >= 1
    assert 7 + made == CallStore(fresh / "episodes" / "monolith.db").stats()["calls"]
    # Results of other settings are refused, never mixed in.
    other = run_cli_here(*args, "eval.seed=5", expect=2)
    assert "holds results of another evaluation" in other.stderr


def test_compare_puts_runs_side_by_side(tmp_path, tiny_tokenizer_dir):
    for name, tools in (("list", "offline_basic"), ("repriced", "offline_basic_repriced")):
        config = config_lib.load(
            _overrides(
                tmp_path, tiny_tokenizer_dir, f"tools={tools}", f"eval.out_dir={tmp_path / name}"
            )
        )
        harness.run(config, ["fixed:cheapest", "fixed:strongest"])
    table = run_cli_here(
        "eval", "compare", str(tmp_path / "list"), str(tmp_path / "repriced")
    ).stdout
    for run in ("list", "repriced"):
        for agent in ("fixed:cheapest", "fixed:strongest"):
            assert f"| {run}/{agent}" in table
    missing = run_cli_here("eval", "compare", str(tmp_path / "nothing"), expect=2)
    assert "no readable report.json" in missing.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--benchmark", "hle", "--agent", "fixed:cheapest"], "a qa environment reads a file"),
        (
            ["--benchmark", "offline", "--agent", "random", "--agent", "random"],
            "an agent is named twice",
        ),
        (
            ["--benchmark", "offline", "--agent", "fixed:cheapest", "eval.concurrency=0"],
            "eval.concurrency",
        ),
        (
            [
                "--benchmark",
                "offline",
                "--agent",
                "monolith",
                "eval.monolith.model=no-such-model",
                "data.num_offline_conversations=100",
            ],
            "eval.monolith.model=no-such-model has no price in the price table: set "
            "eval.monolith.usd_per_million=",
        ),
    ],
)
def test_user_errors(args, message, tmp_path):
    error = run_cli_here("eval", *args, f"run.output_dir={tmp_path}", expect=2)
    assert message in error.stderr


def test_the_real_expert_tool_set_builds_offline():
    """``tools=experts`` (HLE / FRAMES with real endpoints) builds without reaching any: keys
    are read at the first request; each expert has its context budget."""
    from nemo_orch.rollout.builders import build_toolbox

    toolbox = build_toolbox(config_lib.load(["tools=experts"]).tools)
    assert list(toolbox.tools) == ["call_expert", "web_search", "python_sandbox"]
    expert = toolbox.tools["call_expert"]
    assert {alias: expert.context_budget(alias) for alias in expert.endpoints} == {
        "frontier": 120000,
        "math": 2048,
        "coder": 24000,
        "generalist": 24000,
    }
    assert expert.pricing["frontier"].per_output_token == pytest.approx(10e-6)


def test_the_orchestrator_behind_an_endpoint_equals_the_checkpoint(
    tmp_path, random_policy_dir, tiny_tokenizer_dir, tiny_tokenizer
):
    """The same policy served over OpenAI-compatible HTTP (token ids in and out) and loaded
    from its directory plays the same greedy episodes at the same cost."""
    from nemo_orch.rollout.engines.hf import HFEngine

    engine = HFEngine.from_pretrained(random_policy_dir, tokenizer=tiny_tokenizer)
    with start_server(engine, tiny_tokenizer, "orchestrator") as server:
        served = config_lib.load(
            _overrides(
                tmp_path,
                tiny_tokenizer_dir,
                "eval.tasks=6",
                "rollout.engine=openai",
                f"rollout.base_url={server.url}",
                "rollout.model_name=orchestrator",
                f"eval.out_dir={tmp_path / 'served'}",
            )
        )
        harness.run(served, ["orchestrator"])
    local = config_lib.load(
        _overrides(
            tmp_path,
            tiny_tokenizer_dir,
            "eval.tasks=6",
            f"rollout.policy={random_policy_dir}",
            f"eval.out_dir={tmp_path / 'local'}",
        )
    )
    harness.run(local, ["orchestrator"])
    assert _outcomes(tmp_path / "served", "orchestrator") == _outcomes(
        tmp_path / "local", "orchestrator"
    )


def test_rule_agents_run_on_a_fresh_clone_without_a_trained_tokenizer(tmp_path):
    """Fixed routers need no trained policy: with no tokenizer yet, the run's own is trained
    (the one ``nemo-orch train`` would train and keep), not asked for."""
    result = run_cli_here(
        "eval",
        "--benchmark",
        "offline",
        "--agent",
        "fixed:cheapest",
        "tools=offline_basic",
        f"run.output_dir={tmp_path}",
        "run.name=fresh",
        "data.num_offline_conversations=100",
        "eval.tasks=3",
        f"eval.out_dir={tmp_path / 'eval'}",
        "rollout.max_turns=3",
    )
    assert (tmp_path / "fresh" / "tokenizer" / "tokenizer.json").is_file()
    # the evaluation's progress, by stage and agent
    assert "eval offline: fixed:cheapest: 100%" in result.stderr and "3/3" in result.stderr
    assert len(_episodes(tmp_path / "eval", "fixed:cheapest")) == 3
    # An orchestrator still needs a trained policy (and then its tokenizer).
    refused = run_cli_here(
        "eval",
        "--benchmark",
        "offline",
        "--agent",
        "orchestrator",
        f"run.output_dir={tmp_path}",
        "run.name=other",
        expect=2,
    )
    assert "holds no checkpoint: train first" in refused.stderr
    assert not (tmp_path / "other" / "tokenizer").exists()


def test_a_cache_holding_only_another_fingerprint_is_started_over(tmp_path):
    """An evaluation that failed at its start left a fingerprint and no episode: its corrected
    rerun starts over instead of being refused; one with episodes is still refused."""
    path = tmp_path / "episodes" / "agent.jsonl"
    harness.EpisodeCache(path, "first settings", resume=True)
    cache = harness.EpisodeCache(path, "corrected settings", resume=True)
    assert cache.records == {} and json.loads(path.read_text()) == {
        "fingerprint": "corrected settings"
    }


def test_mcp_tools_the_policy_never_trained_with_are_offered_and_reported(
    tmp_path, tiny_tokenizer_dir, tiny_tokenizer
):
    """``nemo-orch eval`` of a served (scripted) orchestrator with only an MCP server's tools:
    each is rendered into the prompt as a declared tool is (its description, its price per
    call); the tool the first episode's call adds (reshape: list_changed) is offered from the
    next episode on and called there; the report names the MCP tools the policy did not train
    with, with their calls. A checkpoint trained with the server's add leaves add out."""
    server = Path(__file__).resolve().parents[1] / "support" / "mcp_server.py"
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(
        tasks,
        [
            Task(id="reshape", question="Reshape the tools.", answer="reshaped"),
            Task(id="triple", question="What is three times 4?", answer="12"),
        ],
    )
    prompts: list[str] = []

    def policy(prompt: str) -> str:
        last = prompt.rsplit("<|im_start|>", 2)[-2]  # the question, or the last observation
        if "<tool_response>" in last:
            return (
                f"<answer>{last.split('<tool_response>')[1].split('</tool_response>')[0]}</answer>"
            )
        prompts.append(prompt)
        call = (
            {"name": "fx_reshape", "arguments": {}}
            if "Reshape" in last
            else {"name": "fx_triple", "arguments": {"n": 4}}
        )
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    with start_server(
        ScriptedEngine(tiny_tokenizer, policy), tiny_tokenizer, "orchestrator"
    ) as served:
        config = config_lib.load(
            [
                "env=tasks",
                f"env.path={tasks}",
                "tools.declarations=[]",
                f"tools.mcp=[{{name: fx, command: '{sys.executable}', args: ['{server}', stdio], "
                "allow: [add, reshape, triple], prices: {triple: 0.02}, per_call_usd: 0.001}]",
                f"run.output_dir={tmp_path}",
                f"tokenizer.path={tiny_tokenizer_dir}",
                f"eval.out_dir={tmp_path / 'eval'}",
                "eval.concurrency=1",
                "rollout.engine=openai",
                f"rollout.base_url={served.url}",
                "rollout.model_name=orchestrator",
                "rollout.max_turns=3",
                "rollout.max_new_tokens=100",
            ]
        )
        summary = harness.run(config, ["orchestrator"])

    first, second = prompts
    assert '"description": "Add two integers. Each call costs USD 0.001."' in first
    assert "fx_triple" not in first
    assert (
        '"description": "Three times an integer (offered once reshape ran). Each call '
        'costs USD 0.02."'
    ) in second
    episodes = _episodes(tmp_path / "eval", "orchestrator")
    assert [record["episode"]["answer"] for record in episodes] == ["reshaped", "12"]
    report = json.loads(summary.report.read_text())
    assert report["systems"]["orchestrator"]["accuracy"] == 1.0
    assert report["notes"][harness.UNTRAINED_MCP_TOOLS] == [
        {"tool": "fx_add", "server": "fx", "orchestrator": 0},
        {"tool": "fx_reshape", "server": "fx", "orchestrator": 1},
        {"tool": "fx_triple", "server": "fx", "orchestrator": 1},
    ]
    markdown = (tmp_path / "eval" / "report.md").read_text()
    assert f"{harness.UNTRAINED_MCP_TOOLS}:" in markdown
    assert "| fx_triple | fx | 1 |" in markdown

    # A policy whose checkpoint trained with the server's add: add is not reported.
    checkpoint = tmp_path / "trained" / "step_1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "nemo_orch.json").write_text('{"step": 1}')
    (checkpoint / "config.yaml").write_text("tools: {mcp: [{name: fx, allow: [add], deny: []}]}")
    trained = config_lib.load([f"rollout.policy={checkpoint}"])
    evaluation = harness.Evaluation([], {"orchestrator": episodes}, {})
    assert [
        row["tool"]
        for row in harness.untrained_mcp_tools(
            evaluation, harness._trained_with(trained, ["orchestrator"])
        )
    ] == ["fx_reshape", "fx_triple"]


def test_an_evaluation_replayed_from_its_call_store_gives_the_same_report(
    tmp_path, tiny_tokenizer_dir
):
    """``--record`` keeps the monolith's calls of its (SIMULATED, HTTP on 127.0.0.1) endpoint;
    ``--replay`` answers every one from the store, the report the same to the byte (the tools'
    seconds modeled, the endpoint's the recorded ones), the ledger marking the replayed turns
    and $0 spent on them."""
    store = tmp_path / "calls.db"
    overrides = _overrides(
        tmp_path,
        tiny_tokenizer_dir,
        "tools=offline",
        ORCHESTRA_CONTEXT,
        *MONOLITH_BASIC_TOOLS,
        "eval.tasks=4",
        "tools.timing=modeled",
    )

    def evaluate(flag: str, out: str, calls: Path = store):
        return run_cli_here(
            "eval",
            "--benchmark",
            "offline",
            "--agent",
            "monolith",
            flag,
            str(calls),
            *overrides,
            f"eval.out_dir={tmp_path / out}",
        )

    recorded = evaluate("--record", "recorded")
    replayed = evaluate("--replay", "replayed")
    assert "0 calls answered from it" in recorded.stdout
    assert ", 0 recorded, 0 not in it" in replayed.stdout
    report = (tmp_path / "recorded" / "report.json").read_bytes()
    assert report == (tmp_path / "replayed" / "report.json").read_bytes()
    turns = [
        turn
        for record in _episodes(tmp_path / "replayed", "monolith")
        for turn in record["episode"]["ledger"]
    ]
    assert turns and all(turn["replayed"] for turn in turns)
    for record in _episodes(tmp_path / "replayed", "monolith"):
        assert record["episode"]["spent_usd"] == sum(
            call["cost_usd"]
            for turn in record["episode"]["ledger"]
            for call in turn["calls"]
            if not call["replayed"]
        )
        assert record["episode"]["cost_usd"] > record["episode"]["spent_usd"]

    # A bug report ships one episode's calls: replayed from them alone, that episode runs as
    # it did (the others, whose calls are not there, end as infrastructure failures).
    shown = _episodes(tmp_path / "recorded", "monolith")[2]
    episode = f"{shown['task_id']}#{shown['trial']}"
    bug = tmp_path / "bug.db"
    extracted = run_cli_here("eval", "extract", str(store), episode, str(bug)).stdout
    # The episode's requests to the monolith's endpoint, and its sandbox runs.
    assert int(extracted.split()[0]) >= len(shown["episode"]["ledger"])
    evaluate("--replay", "bug", calls=bug)
    bugged = _episodes(tmp_path / "bug", "monolith")
    (again,) = [r for r in bugged if r["task_id"] == shown["task_id"]]
    assert (again["result"], again["episode"]["messages"]) == (
        shown["result"],
        shown["episode"]["messages"],
    )
    others = [r for r in bugged if r is not again]
    assert others and all(r["result"]["infra_failure"] for r in others)
    missing = run_cli_here("eval", "extract", str(store), "no-such#0", str(bug), expect=2)
    assert "holds no call of episode no-such#0" in missing.stderr
