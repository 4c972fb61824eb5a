"""Faults injected into GRPO: a tool that raises, one that hangs past its timeout, one that
returns 10 MB, an expert endpoint on 127.0.0.1 that dies mid-step or fails a share of its calls,
and the reward server (a real ``nemo-orch serve reward``) restarted mid-step. Each tool fault is
a call of its kind counted in its step's metrics, never a crash; an episode an infrastructure
failure decided is masked out of its group (the others' advantages are those of a group where
it never ran), and past ``rollout.max_infra_error_rate`` the step stops with one line naming
the endpoint. A reward server that comes back within the retries is waited for, one that does
not stops the run with one clear line, and the same command resumes it from its last
checkpoint. Nothing hangs.

First the rollouts alone, with a scripted policy (exact counts); then whole GRPO runs, one per
backend, of a tiny policy fine-tuned to call the task's tool, with directed exploration forcing
every fault in turn."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.cli_helpers import free_ports, read_metrics, run_cli

from nemo_orch import config as config_lib
from nemo_orch.data.tasks import Task, write_tasks
from nemo_orch.envs import build_mixture
from nemo_orch.faults import ENV as KILL_AT
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.rollout.format import call_text
from nemo_orch.train.grpo_rollouts import Rollouts

TESTS = Path(__file__).resolve().parents[1]
# Each task's question names the call it wants (the scripted policy and the fine-tuned one make
# it): the first word is the key.
FAULTS = {
    "raise": ("faulty", {"mode": "raise"}),
    "hang": ("faulty", {"mode": "hang"}),
    "huge": ("faulty", {"mode": "huge"}),
    "expert": ("expert", {"model": "m"}),
    "fine": ("faulty", {"mode": "ok"}),
}


def _declarations(directory: Path, expert_url: str, **expert_options: Any) -> list[str]:
    faulty = {
        "name": "faulty",
        "description": "A tool that fails as asked.",
        "parameters": {
            "type": "object",
            "properties": {"mode": {"type": "string", "enum": ["raise", "hang", "huge", "ok"]}},
            "required": ["mode"],
        },
        "timeout_s": 1.0,
        "deterministic": False,
        "class": "support.fixture_tools.Faulty",
    }
    expert = {
        "name": "expert",
        "description": "Ask the expert the task's question.",
        "parameters": {
            "type": "object",
            "properties": {"model": {"type": "string", "enum": ["m"]}},
            "required": ["model"],
        },
        "timeout_s": 10.0,
        "deterministic": False,
        "class": "support.fixture_tools.ExpertOnTheQuestion",
        "options": {
            "models": {"m": {"base_url": expert_url, "model": "m", "usd_per_million": [1.0, 1.0]}},
            "timeout_s": 2.0,
            "max_retries": 1,
            **expert_options,
        },
    }
    paths = []
    for declaration in (faulty, expert):
        path = directory / f"{declaration['name']}.json"
        path.write_text(json.dumps(declaration))
        paths.append(str(path))
    return paths


def _write_tasks(path: Path, per_kind: int) -> Path:
    write_tasks(
        path,
        [
            Task(id=f"{kind}{i}", question=f"{kind} please", answer="fine")
            for kind in FAULTS
            for i in range(per_kind)
        ],
    )
    return path


# An expert endpoint in a process of its own, so that it can die as servers do (SIGKILL: every
# connection reset, kept-alive ones too). It prints its URL, then serves until killed, or until
# the request numbered argv[1] (0: never) arrives: that one kills it mid-request. With argv[2],
# it appends a line to that file for every request.
EXPERT = """
import os, signal, sys, time
from nemo_orch.serve.http_server import serve_json

dies_at, served = int(sys.argv[1]), []

def chat(body):
    served.append(1)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "a") as log:
            log.write(body["messages"][-1]["content"][:40].replace("\\n", " ") + "\\n")
    if len(served) == dies_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"id": "x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "fine"}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}

with serve_json({("POST", "/v1/chat/completions"): chat}, url_path="/v1") as server:
    print(server.url, flush=True)
    while True:
        time.sleep(1)
"""


class Expert:
    """The expert endpoint's process (``dies_at``: the request that kills it; 0: never;
    ``log``: where each request is noted)."""

    def __init__(self, dies_at: int = 0, log: Path | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", EXPERT, str(dies_at), *([str(log)] if log else [])],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.url = self.process.stdout.readline().strip()
        assert self.url.startswith("http://127.0.0.1:"), "the expert endpoint did not start"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def __enter__(self) -> Expert:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def _reply(prompt: str) -> str:
    """Call the tool the task names; then answer with what came back (cut short)."""
    if "<tool_response>" in prompt:
        observed = prompt.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
        return f"<answer>{observed[:20]}</answer>"
    question = prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    return call_text(FAULTS[question.split()[0]])


def test_rollouts_count_faults_and_go_on(tmp_path, tiny_tokenizer):
    tasks = _write_tasks(tmp_path / "tasks.jsonl", per_kind=2)
    with Expert() as expert:
        config = config_lib.load(
            [
                "env=tasks",
                f"env.path={tasks}",
                "env.val_fraction=0",
                f"tools.declarations=[{','.join(_declarations(tmp_path, expert.url))}]",
                "grpo.prompts_per_step=10",
                "rollout.group_size=2",
                "grpo.max_sampling_rounds=1",
                "rollout.max_turns=2",
                "rollout.max_new_tokens=64",
                "reward.min_group_std=0",
                # The faults are this test's subject: train on what they leave.
                "rollout.max_infra_error_rate=1",
            ]
        )
        mixture = build_mixture(config)
        toolboxes = [environment.toolbox() for environment in mixture.environments]
        engine = ScriptedEngine(tiny_tokenizer, _reply)

        async def three_steps() -> list[dict]:
            for toolbox in toolboxes:
                await toolbox.start()
            rollouts = Rollouts(config, engine, tiny_tokenizer, mixture, toolboxes)
            steps = []
            try:
                for step in (1, 2, 3):
                    if step == 2:  # the expert's server dies between the steps
                        expert.kill()
                    started = time.perf_counter()
                    batch = await rollouts.batch(step)
                    steps.append({**batch.metrics(), "seconds": time.perf_counter() - started})
            finally:
                for toolbox in toolboxes:
                    await toolbox.close()
            return steps

        steps = asyncio.run(three_steps())
    for metrics in steps:
        # Every fault came back as an observation of its kind: counted, and the step went on.
        assert metrics["call_errors/faulty"] == 8  # raise and hang: 2 tasks x 2 samples each
        assert metrics["seconds"] < 60  # the hanging tool was cut at its 1 s timeout
        # The tool broke or hung: masked, not scored as the policy's zeros.
        assert metrics["masked/infra_error"] >= 8
        assert 0 < metrics["accuracy"] < 1  # huge outputs answered wrong, fine ones right
    assert "call_errors/expert" not in steps[0]  # it answered while it lived
    assert (steps[0]["masked/episodes"], steps[0]["masked/rate"]) == (8, 8 / 20)
    assert steps[0]["calls/infra_error"] == 8 and steps[0]["call_rate/infra_error"] == 8 / 20
    assert all(metrics["call_errors/expert"] == 4 for metrics in steps[1:])  # 2 x 2
    assert all(metrics["masked/episodes"] == 12 for metrics in steps[1:])


class FlakyExpert:
    """An expert endpoint on 127.0.0.1 whose every question's calls go: 500, right, wrong,
    right, ... (the n-th call of a question: n % 4)."""

    def __init__(self) -> None:
        from support.local_http import JSONServer

        self.calls: Counter = Counter()

        def answer(path, headers, body):
            question = body["messages"][-1]["content"]
            turn = self.calls[question] % 4
            self.calls[question] += 1
            if turn == 0:
                return 500, {"error": {"message": "upstream overloaded"}}, {}
            return (
                200,
                {
                    "model": "m",
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"content": ["fine", "nope"][turn == 2]},
                        }
                    ],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1},
                },
                {},
            )

        self.server = JSONServer(answer, url_path="/v1")
        self.url = self.server.url


def test_an_expert_failing_a_share_of_its_calls_is_masked_then_stops_the_step(
    tmp_path, tiny_tokenizer
):
    from nemo_orch.call_kinds import InfrastructureError
    from nemo_orch.reward import OutcomeScorer, by_answer, group_advantages, score_group

    path = tmp_path / "tasks.jsonl"
    write_tasks(
        path,
        [Task(id=f"expert{i}", question=f"expert please {i}", answer="fine") for i in range(4)],
    )
    flaky = FlakyExpert()
    # No retry and no circuit breaker: exactly one call of four fails.
    declarations = _declarations(tmp_path, flaky.url, max_retries=0, guard={"failures": 0})

    def rollouts(max_rate: float) -> tuple[Any, Rollouts]:
        config = config_lib.load(
            [
                "env=tasks",
                f"env.path={path}",
                "env.val_fraction=0",
                f"tools.declarations=[{','.join(declarations)}]",
                "grpo.prompts_per_step=4",
                "rollout.group_size=4",
                "grpo.max_sampling_rounds=1",
                "rollout.max_turns=2",
                "rollout.max_new_tokens=64",
                "reward.min_group_std=0",
                f"rollout.max_infra_error_rate={max_rate}",
            ]
        )
        mixture = build_mixture(config)
        toolboxes = [environment.toolbox() for environment in mixture.environments]
        return config, Rollouts(
            config, ScriptedEngine(tiny_tokenizer, _reply), tiny_tokenizer, mixture, toolboxes
        )

    async def step(rollouts: Rollouts):
        for toolbox in rollouts.toolboxes.values():
            await toolbox.start()
        try:
            return await rollouts.batch(1)
        finally:
            for toolbox in rollouts.toolboxes.values():
                await toolbox.close()

    try:
        config, tolerant = rollouts(0.3)
        batch = asyncio.run(step(tolerant))
        # Past the threshold (a quarter of the episodes > 0.2), the step stops, naming the
        # endpoint, in one line.
        with pytest.raises(InfrastructureError) as stopped:
            asyncio.run(step(rollouts(0.2)[1]))
    finally:
        flaky.server.stop()
    metrics = batch.metrics()
    assert (metrics["masked/infra_error"], metrics["masked/rate"]) == (4, 0.25)
    assert metrics["calls/infra_error"] == 4 and metrics["calls/ok"] == 12
    scorer = by_answer(OutcomeScorer(config.reward))
    for group in batch.kept:
        ((masked, failure),) = group.masked  # one episode of each group
        assert failure.reason == "infra_error" and failure.endpoint == "expert(model=m)"
        assert "HTTP 500: upstream overloaded" in failure.detail
        kept = group.trajectories
        assert masked not in kept and len(kept) == 3
        # The others' rewards and advantages: those of a group where it never ran ...
        outcomes = [asyncio.run(scorer(group.task, t)) for t in kept]
        never_ran = score_group(group.task, kept, outcomes, config.reward)
        assert [b.reward for b in group.breakdowns] == [b.reward for b in never_ran]
        advantages = group_advantages([b.reward for b in group.breakdowns], config.reward)
        # ... not those it would have given them as a zero of the policy's.
        with_zero = score_group(
            group.task,
            [*kept, masked],
            [*outcomes, asyncio.run(scorer(group.task, masked))],
            config.reward,
        )
        assert advantages != group_advantages([b.reward for b in with_zero], config.reward)[:3]
    message = str(stopped.value)
    assert "\n" not in message
    assert message.startswith(
        "4 of the 16 episodes of step 1 were decided by infrastructure "
        "failures (25% > rollout.max_infra_error_rate=0.2), rather than "
        "trained on: expert(model=m): 4 x infra_error (expert 'm' failed: "
        f"POST {flaky.url}/chat/completions failed after 1 attempt; last "
        "error: HTTP 500: upstream overloaded)"
    ), message


# ----------------------------------------------------------------------------- whole runs

FINE_TUNING_STEPS = 100


@pytest.fixture(scope="module")
def fault_policy(
    tiny_tokenizer_dir: Path, tiny_tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A tiny Qwen3 (an HF directory) fine-tuned to call the tool its task names, then answer:
    whole calls of its own (an untrained one writes none), so GRPO's episodes reach the tools.
    Fine-tuned here in a plain torch loop, in seconds (``nemo-orch sft`` would spend ~20 s
    starting up)."""
    from nemo_orch.config import ModelConfig, ToolsConfig
    from nemo_orch.data.sft import tokenize_conversation
    from nemo_orch.models.hf_mapping import build_hf_model, save_hf_checkpoint
    from nemo_orch.rollout.builders import offered_schemas

    directory = tmp_path_factory.mktemp("fault-policy")
    schemas = offered_schemas(
        ToolsConfig(declarations=_declarations(directory, "http://127.0.0.1:9/v1"))
    )
    rows = [
        tokenize_conversation(
            tiny_tokenizer,
            {
                "messages": [
                    {"role": "user", "content": f"{kind} please"},
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {"type": "function", "function": {"name": name, "arguments": arguments}}
                        ],
                    },
                    {"role": "tool", "content": "fine"},
                    {"role": "assistant", "content": "<answer>fine</answer>"},
                ],
                "tools": schemas,
            },
        )
        for kind, (name, arguments) in FAULTS.items()
    ]
    length = max(len(ids) for ids, _ in rows)
    pad = [tiny_tokenizer.pad_token_id] * length
    tokens = torch.tensor([ids + pad[len(ids) :] for ids, _ in rows])
    labels = torch.tensor(
        [
            [token if learn else -100 for token, learn in zip(ids, mask)]
            + [-100] * (length - len(ids))
            for ids, mask in rows
        ]
    )
    model_config = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        vocab_size=1024,
        max_position_embeddings=2560,
    )
    torch.manual_seed(0)
    model = build_hf_model(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(FINE_TUNING_STEPS):
        model(input_ids=tokens, labels=labels).loss.backward()  # labels shift inside
        optimizer.step()
        optimizer.zero_grad()
    policy = save_hf_checkpoint(directory / "policy", model.state_dict(), model_config)
    for file in tiny_tokenizer_dir.iterdir():
        shutil.copy(file, policy / file.name)
    return policy


class RewardServer:
    """``nemo-orch serve reward`` (PyTriton) in a process of its own, on ports it keeps across
    restarts."""

    def __init__(self, workspace: Path) -> None:
        self.ports, self.workspace = free_ports(3), workspace
        self.process: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.ports[0]}"

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        http, grpc, metrics = self.ports
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nemo_orch.cli",
                "serve",
                "reward",
                f"serve.http_port={http}",
                f"serve.grpc_port={grpc}",
                f"serve.metrics_port={metrics}",
                f"serve.workspace_root={self.workspace}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        banner = self.process.stdout.readline()
        assert banner.startswith("reward: serving reward at"), banner

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@pytest.fixture(scope="module")
def reward_server():
    """One server for the module's runs; each starts it (again) as it needs."""
    # A short directory: PyTriton's UNIX sockets live in its workspace (at most 107 bytes).
    with tempfile.TemporaryDirectory(prefix="serve-") as workspace:
        server = RewardServer(Path(workspace))
        try:
            yield server
        finally:
            server.stop()


class GRPORun:
    """``nemo-orch grpo`` in a process of its own, watched while it runs."""

    def __init__(self, overrides: list[str], out: Path) -> None:
        self.stderr = out / "stderr.txt"
        self.metrics = out / "run" / "grpo-tasks" / "metrics.jsonl"
        with open(self.stderr, "w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "nemo_orch.cli", "grpo", *overrides],
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
                env={**os.environ, "PYTHONPATH": str(TESTS)},
            )

    def errors(self) -> str:
        return self.stderr.read_text()

    def wait_until(self, condition: Callable[[], bool], timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert self.process.poll() is None, f"grpo exited early\n{self.errors()[-5000:]}"
            assert time.monotonic() < deadline, f"grpo stalled\n{self.errors()[-5000:]}"
            time.sleep(0.05)

    def logged_steps(self) -> int:
        return len(self.metrics.read_text().splitlines()) if self.metrics.exists() else 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The run (its driver process) frozen while the caller changes the world."""
        self.process.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.process.send_signal(signal.SIGCONT)

    def finish(self, timeout_s: float = 300) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)


def _grpo_overrides(
    policy: Path,
    out: Path,
    reward_url: str,
    expert_url: str,
    *extra: str,
    max_infra_error_rate: float = 1.0,
) -> list[str]:
    """A GRPO run on the faulty tools; the faults are its subject, so by default it trains
    on what they leave whatever their share."""
    tasks = _write_tasks(out / "tasks.jsonl", per_kind=4)
    declarations = _declarations(out, expert_url)
    return [
        f"trainer.init_from={policy}",
        f"run.output_dir={out}",
        "run.name=run",
        f"rollout.max_infra_error_rate={max_infra_error_rate}",
        "env=tasks",
        f"env.path={tasks}",
        "env.val_fraction=0",
        f"tools.declarations=[{','.join(declarations)}]",
        f"reward.endpoint={reward_url}",
        "grpo.max_steps=2",
        "grpo.save_interval=1",
        "grpo.prompts_per_step=5",
        "rollout.group_size=2",
        "grpo.micro_batch_size=2",
        "grpo.max_sampling_rounds=1",
        # Half of each group starts with a call forced in rotation: every fault in turn.
        "grpo.explore_share=0.5",
        "rollout.max_turns=2",
        "rollout.max_new_tokens=48",
        "reward.min_group_std=0",
        "trainer.num_threads=1",
        *extra,
    ]


def _check_fault_metrics(metrics: list[dict]) -> None:
    assert [m["step"] for m in metrics] == [1, 2]
    for step in metrics:
        assert step["call_errors/faulty"] >= 1 and step["source/tasks/tool/faulty"] > 0
        assert step["masked/infra_error"] >= 1  # a tool that raised or hung: not trained on
        assert step["time/rollout_s"] < 60  # the hanging tool was cut at its 1 s timeout
    assert sum(step.get("call_errors/expert", 0) for step in metrics) >= 1  # once it died


@pytest.mark.slow
def test_grpo_stops_clearly_when_the_reward_server_is_gone_and_resumes(
    fault_policy, reward_server, tmp_path
):
    reward_server.start()
    with Expert(dies_at=2) as expert:
        overrides = _grpo_overrides(
            fault_policy, tmp_path, reward_server.url, expert.url, "reward.endpoint_max_retries=1"
        )
        run = GRPORun(overrides, tmp_path)
        run.wait_until(lambda: run.logged_steps() == 1)
        with run.paused():  # step 2 will find the reward server gone
            reward_server.stop()
        assert run.finish() == 2
        last = run.errors().strip().splitlines()[-1]
        assert last.startswith(
            "nemo-orch grpo: error: GRPO stopped in step 2: POST "
            f"{reward_server.url}/v2/models/reward/infer failed after 2 "
            "attempts"
        ), last
        assert last.endswith(
            f"resume from {tmp_path}/run/grpo-tasks/checkpoints/step_1 (step 1)."
        ), last
        assert "KServeError" not in run.errors()  # no traceback (the faulty tool's are logged)

        reward_server.start()
        resumed = run_cli("grpo", *overrides, env={"PYTHONPATH": str(TESTS)})
        assert expert.process.wait(timeout=60) == -signal.SIGKILL  # it died mid-request
    assert "grpo: env=tasks, steps 2-2" in resumed.stdout
    _check_fault_metrics(read_metrics(tmp_path / "run" / "grpo-tasks"))


@pytest.mark.slow
def test_grpo_stops_in_one_line_when_infrastructure_decides_too_many_episodes(
    fault_policy, reward_server, tmp_path
):
    reward_server.start()
    with Expert() as expert:
        run = GRPORun(
            _grpo_overrides(
                fault_policy, tmp_path, reward_server.url, expert.url, max_infra_error_rate=0.05
            ),
            tmp_path,
        )
        assert run.finish() == 2
    last = run.errors().strip().splitlines()[-1]
    assert last.startswith("nemo-orch grpo: error: GRPO stopped in step 1: "), last
    assert "were decided by infrastructure failures" in last
    assert "> rollout.max_infra_error_rate=0.05), rather than trained on: faulty: " in last
    assert last.endswith(
        "Run the same command again to resume from the start (no step was checkpointed)."
    ), last
    assert "InfrastructureError" not in run.errors()  # no traceback
    assert run.logged_steps() == 0


@pytest.mark.slow
def test_grpo_on_ray_waits_for_a_restarted_reward_server(fault_policy, reward_server, tmp_path):
    reward_server.start()
    with Expert(dies_at=2) as expert:
        run = GRPORun(
            _grpo_overrides(
                fault_policy,
                tmp_path,
                reward_server.url,
                expert.url,
                "rollout.backend=ray",
                "rollout.ray.num_workers=1",
                "rollout.ray.num_cpus_per_worker=0.5",
                "rollout.ray.object_store_mb=128",
                "reward.endpoint_max_retries=8",
            ),
            tmp_path,
        )
        run.wait_until(lambda: run.logged_steps() == 1)
        with run.paused():
            reward_server.stop()
        # Step 2's scoring meets the stopped server and retries; it comes back meanwhile.
        # (Ray forwards the scorer actor's warnings, repeated ones merged.)
        retrying = f"{reward_server.url}/v2/models/reward/infer"
        run.wait_until(
            lambda: any(retrying in line and "retry" in line for line in run.errors().splitlines())
        )
        reward_server.start()
        assert run.finish() == 0, run.errors()[-5000:]
        assert expert.process.wait(timeout=60) == -signal.SIGKILL
    _check_fault_metrics(read_metrics(tmp_path / "run" / "grpo-tasks"))


@pytest.mark.slow
def test_a_grpo_step_killed_midway_resumes_its_episodes_from_their_last_turn(
    fault_policy, reward_server, tmp_path
):
    """GRPO killed in step 1 (no checkpoint yet) and again in step 2, each time after some of
    its turns, and resumed (from the start, then from step 1's checkpoint): the same episodes
    (turns per episode, samples trained) as a run never killed, and no completed expert call
    made again: the expert's requests over the killed runs and their resumption are the
    uninterrupted run's (``grpo.journal``, on by default)."""
    reward_server.start()
    env = {"PYTHONPATH": str(TESTS)}

    def grpo(out: Path, kills: tuple[int, ...] = ()) -> list[str]:
        out.mkdir()
        with Expert(log=out / "expert.log") as expert:
            overrides = _grpo_overrides(fault_policy, out, reward_server.url, expert.url)
            for steps_logged, kill_at_turn in enumerate(kills):
                killed = run_cli(
                    "grpo", *overrides, env={**env, KILL_AT: f"turn:{kill_at_turn}"}, expect=None
                )
                assert killed.returncode == -signal.SIGKILL
                logged = read_metrics(out / "run" / "grpo-tasks") if steps_logged else []
                assert [m["step"] for m in logged] == list(range(1, steps_logged + 1))
            run_cli("grpo", *overrides, env=env)
        return sorted((out / "expert.log").read_text().splitlines())

    whole = grpo(tmp_path / "whole")
    metrics = read_metrics(tmp_path / "whole" / "run" / "grpo-tasks")
    # Turns are counted as each process generates them (replayed ones not). Killed once its 10
    # episodes' first turns (one batch) have made their calls and two second turns are written:
    # in step 1 at turn 12; resumed, step 1's other turns and 12 of step 2's.
    step_1 = round(metrics[0]["turns"] * 10)
    resumed = grpo(tmp_path / "resumed", kills=(10 + 2, step_1 - 12 + 10 + 2))
    assert resumed == whole
    again = read_metrics(tmp_path / "resumed" / "run" / "grpo-tasks")
    assert [m["turns"] for m in again] == [m["turns"] for m in metrics]
    trained = [
        (tmp_path / run / "run" / "grpo-tasks" / "trained.jsonl").read_text()
        for run in ("whole", "resumed")
    ]
    assert trained[0] == trained[1]
