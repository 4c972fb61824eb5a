"""The README's walkthrough, run: its commands as a newcomer pastes them, from the directory of a
(small) main job whose ``runs/latest`` they name. A command the README shows is the command
tested: change one there and this test runs the change."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from support.cli_helpers import ENDED, TINY_MAIN_JOB, free_ports, job_state, run_cli, wait_for

ROOT = Path(__file__).resolve().parents[2]
# What makes the walkthrough's commands small here, by subcommand: the tiny run's shapes, four
# held-out tasks, short turns.
SMALL = {
    "eval": ["eval.tasks=4", "rollout.max_turns=2", "rollout.max_new_tokens=8"],
    "serve": ["rollout.max_turns=2", "rollout.max_new_tokens=8"],
    "launch": [
        override for override in TINY_MAIN_JOB if override.startswith(("model.", "tokenizer."))
    ],
}


def walkthrough() -> tuple[list[list[str]], str]:
    """The walkthrough's ``nemo-orch`` commands, split as the shell splits them, and its Python
    client."""
    section = (ROOT / "README.md").read_text().split("\n## Walkthrough", 1)[1].split("\n## ")[0]
    blocks = re.findall(r"```(bash|python)\n(.*?)```", section, re.DOTALL)
    commands = [
        shlex.split(line)
        for language, body in blocks
        if language == "bash"
        for line in body.replace("\\\n", " ").splitlines()
        if line.startswith("nemo-orch ")
    ]
    (client,) = [body for language, body in blocks if language == "python"]
    return commands, client


def run(command: list[str], directory: Path, *extra: str) -> subprocess.CompletedProcess:
    """A walkthrough command in ``directory`` (``$PWD`` is it), made small."""
    arguments = [argument.replace("$PWD", str(directory)) for argument in command[1:]]
    return run_cli(*arguments, *SMALL.get(arguments[0], []), *extra, cwd=directory)


def by_subcommand(commands: list[list[str]], name: str) -> list[list[str]]:
    return [command for command in commands if command[1] == name]


def test_the_walkthrough_trains_evaluates_exports_serves_and_answers(tiny_main_job):
    directory, _ = tiny_main_job
    commands, client = walkthrough()
    assert [command[1] for command in commands] == ["eval", "export", "export", "serve", "launch"]

    (evaluate,) = by_subcommand(commands, "eval")
    evaluated = run(evaluate, directory).stdout
    for agent in ("orchestrator", "fixed:cheapest", "fixed:strongest"):
        assert re.search(rf"^  {re.escape(agent)} +4 ", evaluated, re.MULTILINE), evaluated
    assert (directory / "runs" / "eval" / "offline" / "report.md").is_file()

    to_hf, to_trtllm = by_subcommand(commands, "export")
    run(to_hf, directory)
    hf_dir = directory / to_hf[to_hf.index("--out") + 1]
    loaded = subprocess.run(  # transformers, alone in a process, loads the export as it is
        [
            sys.executable,
            "-c",
            "import sys, transformers as t; "
            "m = t.AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
            "k = t.AutoTokenizer.from_pretrained(sys.argv[1]); "
            "print(type(m).__name__, m.config.vocab_size, len(k('What is 2 + 2?').input_ids))",
            str(hf_dir),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    model, vocab_size, tokens = loaded.stdout.split()
    assert (model, vocab_size) == ("Qwen3ForCausalLM", "1024") and int(tokens) > 0
    run(to_trtllm, directory)
    trt_dir = directory / to_trtllm[to_trtllm.index("--out") + 1]
    assert (trt_dir / "config.json").is_file() and (trt_dir / "rank0.safetensors").is_file()

    (serve,) = by_subcommand(commands, "serve")
    (port,) = free_ports(1)
    served = [
        argument.replace("serve.http_port=8000", f"serve.http_port={port}") for argument in serve
    ]
    server = subprocess.Popen(
        [sys.executable, "-m", "nemo_orch.cli", *served[1:], *SMALL["serve"]],
        cwd=directory,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_until_up(f"http://127.0.0.1:{port}/v1/models", server)
        called = subprocess.run(  # as from the activated environment: nemo-orch on PATH
            [sys.executable, "-c", client.replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=directory,
            env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
        )
        assert called.returncode == 0, called.stderr
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert_client_output(called.stdout)


def assert_client_output(printed: str) -> None:
    """What the README's client prints: the policy's first call (or what it wrote instead),
    then how the served episode ended, its answer and cost, and its first calls."""
    decision, episode, *calls = printed.strip().splitlines()
    assert decision.startswith("first call: "), printed
    assert re.fullmatch(
        r"orchestrate: (answer|max_turns|context_limit), answer .+, USD \d\.\d{6}", episode
    ), printed
    assert len(calls) <= 2 and all(call.startswith("  ") and " -> " in call for call in calls)


def _wait_until_up(url: str, server: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert server.poll() is None, server.stdout.read()
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            assert time.monotonic() < deadline, f"{url} did not come up"
            time.sleep(0.5)


@pytest.mark.slurm
@pytest.mark.slow
def test_the_walkthrough_launches_on_slurm(slurm_cluster, tiny_main_job):
    directory, _ = tiny_main_job
    (launch,) = by_subcommand(walkthrough()[0], "launch")
    submitted = run(launch, directory).stdout
    job = re.search(r"launch: submitted SLURM job (\d+)", submitted)
    assert job, submitted
    wait_for(lambda: job_state(job.group(1))["JobState"] in ENDED, "the job to end", 300)
    assert job_state(job.group(1))["JobState"] == "COMPLETED"
