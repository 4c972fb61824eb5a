"""Faults injected into GRPO's rollouts (the local backend), spread over three steps: a tool that
raises, one that hangs past its timeout, one that returns 10 MB, and an expert endpoint on
127.0.0.1 that dies after the first step. Each is a counted error in its step's metrics and an
episode scored wrong (or a group filtered), never a crash; nothing hangs.

The policy is scripted (a small untrained model does not call tools on purpose): it calls the
tool its task names, then answers from what came back."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from nemo_orch import config as config_lib
from nemo_orch.data.tasks import Task, write_tasks
from nemo_orch.envs import build_mixture
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.rollout.format import call_text
from nemo_orch.train.grpo import Rollouts, rollout_metrics

FAULTS = {"raise": ("faulty", {"mode": "raise"}), "hang": ("faulty", {"mode": "hang"}),
          "huge": ("faulty", {"mode": "huge"}), "expert": ("expert", {"model": "m"}),
          "fine": ("faulty", {"mode": "ok"})}


def _declarations(tmp_path, expert_url: str) -> list[str]:
    faulty = {"name": "faulty", "description": "A tool that fails as asked.",
              "parameters": {"type": "object", "properties": {"mode": {
                  "type": "string", "enum": ["raise", "hang", "huge", "ok"]}},
                  "required": ["mode"]},
              "timeout_s": 1.0, "deterministic": False, "class": "fixture_tools.Faulty"}
    expert = {"name": "expert", "description": "Ask the expert the task's question.",
              "parameters": {"type": "object", "properties": {"model": {
                  "type": "string", "enum": ["m"]}}, "required": ["model"]},
              "timeout_s": 10.0, "deterministic": False,
              "class": "fixture_tools.ExpertOnTheQuestion",
              "options": {"models": {"m": {"base_url": expert_url, "model": "m",
                                           "usd_per_million": [1.0, 1.0]}},
                          "timeout_s": 2.0, "max_retries": 1}}
    paths = []
    for declaration in (faulty, expert):
        path = tmp_path / f"{declaration['name']}.json"
        path.write_text(json.dumps(declaration))
        paths.append(str(path))
    return paths


def _reply(prompt: str) -> str:
    """Call the tool the task names; then answer with what came back (cut short)."""
    if "<tool_response>" in prompt:
        observed = prompt.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
        return f"<answer>{observed[:20]}</answer>"
    question = prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    return call_text(FAULTS[question.split()[0]])


# An expert endpoint in a process of its own, so that it can die as servers do (SIGKILL: every
# connection reset, kept-alive ones too). It prints its URL, then serves until killed.
EXPERT = """
import time
from nemo_orch.serve.http_server import serve_json

def chat(body):
    return {"id": "x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "fine"}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}

with serve_json({("POST", "/v1/chat/completions"): chat}, url_path="/v1") as server:
    print(server.url, flush=True)
    while True:
        time.sleep(1)
"""


def test_rollouts_count_faults_and_go_on(tmp_path, tiny_tokenizer):
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(tasks, [Task(id=f"{kind}{i}", question=f"{kind} please", answer="fine")
                        for kind in FAULTS for i in range(2)])
    expert = subprocess.Popen([sys.executable, "-c", EXPERT], stdout=subprocess.PIPE, text=True)
    try:
        url = expert.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), "the expert endpoint did not start"
        config = config_lib.load([
            "env=tasks", f"env.path={tasks}", "env.val_fraction=0",
            f"tools.declarations=[{','.join(_declarations(tmp_path, url))}]",
            "grpo.prompts_per_step=10", "rollout.group_size=2", "grpo.max_sampling_rounds=1",
            "rollout.max_turns=2", "rollout.max_new_tokens=64", "reward.min_group_std=0"])
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
                        expert.wait()
                    started = time.perf_counter()
                    kept, generated, stats = await rollouts.batch(step)
                    steps.append({**rollout_metrics(generated, stats),
                                  "seconds": time.perf_counter() - started, "kept": len(kept)})
            finally:
                for toolbox in toolboxes:
                    await toolbox.close()
            return steps

        steps = asyncio.run(three_steps())
    finally:
        expert.kill()
        expert.wait()
    for metrics in steps:
        # Every fault came back as an error observation: counted, and the step went on.
        assert metrics["call_errors/faulty"] == 8  # raise and hang: 2 tasks x 2 samples each
        assert metrics["seconds"] < 60  # the hanging tool was cut at its 1 s timeout
        assert 0 < metrics["accuracy"] < 1  # faulted episodes scored wrong, fine ones right
    assert "call_errors/expert" not in steps[0]  # it answered while it lived
    assert all(metrics["call_errors/expert"] == 4 for metrics in steps[1:])  # 2 x 2
