"""Running the real ``nemo-orch`` command line from tests, as a user would."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# A tiny Qwen3 with enough positions for the environments' longest prompts (ToolScale's domain
# policies and tool lists): the policy GRPO starts from in the environment tests.
TINY_LONG_MODEL = [
    "model.max_position_embeddings=2560",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.kv_channels=16",
]

# The main job (`nemo-orch train`) in seconds: a few steps of each stage on a handful of tasks.
TINY_MAIN_JOB = [
    "run.name=e2e",
    "data.num_offline_conversations=24",
    "data.num_copy_conversations=24",
    "tokenizer.vocab_size=1000",
    "model.vocab_size=1024",
    "trainer.max_steps=2",
    "trainer.global_batch_size=4",
    "trainer.micro_batch_size=2",
    "trainer.num_threads=1",
    "grpo.max_steps=2",
    "grpo.prompts_per_step=2",
    "rollout.group_size=2",
    "grpo.mini_batches=1",
    "grpo.micro_batch_size=2",
    "eval.tasks=4",
    "rollout.max_turns=2",
    "rollout.max_new_tokens=8",
    "data.toolscale_tasks_per_domain=6",
    "data.toolscale_eval_tasks=2",
    "reward.min_group_std=0",
]  # a random policy's groups all score 0: keep them


def grpo_overrides(start: Path, out: Path, *extra: str) -> list[str]:
    """A few-second ``nemo-orch grpo`` from the ``start`` checkpoint (run dir ``out/run``)."""
    return [
        f"trainer.init_from={start}",
        f"run.output_dir={out}",
        "run.name=run",
        "model.vocab_size=1024",
        "tokenizer.vocab_size=1000",
        *TINY_LONG_MODEL,
        "grpo.max_steps=2",
        "grpo.prompts_per_step=2",
        "rollout.group_size=2",
        "grpo.micro_batch_size=2",
        "rollout.max_turns=2",
        "rollout.max_new_tokens=8",
        "reward.min_group_std=0",
        "trainer.num_threads=1",
        *extra,
    ]


def sum_task_overrides(directory: Path) -> list[str]:
    """``env=tasks`` on twelve sums written to ``directory/tasks.jsonl``, scored by the answer
    alone: what a short ``nemo-orch grpo`` trains on."""
    from nemo_orch.data.tasks import Task, write_tasks

    path = directory / "tasks.jsonl"
    write_tasks(
        path,
        [Task(id=f"t{i}", question=f"What is {i} + {i}?", answer=str(2 * i)) for i in range(12)],
    )
    return ["env=tasks", f"env.path={path}", "reward.combination=linear", "reward.linear_gamma=0"]


def grpo_stage(out: Path) -> Path:
    """The stage directory of the run ``grpo_overrides`` wrote under ``out``."""
    (stage,) = (out / "run").glob("grpo-*")
    return stage


def small_sft_overrides(tokenizer_dir: Path, output_dir: Path, name: str) -> list[str]:
    """A few-second SFT configuration of the default (micro) model on the offline data."""
    return [
        f"run.output_dir={output_dir}",
        f"run.name={name}",
        f"tokenizer.path={tokenizer_dir}",
        "model.vocab_size=1024",
        "data.num_offline_conversations=64",
        "data.num_copy_conversations=64",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=2",
        "trainer.optim.warmup_steps=2",
        "trainer.num_threads=1",
    ]


def run_cli(
    *args: str, env: dict[str, str] | None = None, expect: int | None = 0, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run ``nemo-orch ARGS`` as users do (in ``cwd``, default this one); ``expect`` is the
    required exit code (None: any).

    The command gets its own session, killed afterwards: a SIGKILLed run orphans
    megatron-core's checkpoint-writer manager process, which would otherwise linger (and hold
    pipes open, hence files rather than pipes for the output).
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "nemo_orch.cli", *args],
            stdout=out,
            stderr=err,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            cwd=cwd,
        )
        try:
            returncode = process.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        out.seek(0), err.seek(0)
        result = subprocess.CompletedProcess(args, returncode, out.read(), err.read())
    if expect is not None and result.returncode != expect:
        raise AssertionError(
            f"nemo-orch {' '.join(args)} exited {result.returncode}, expected "
            f"{expect}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n"
            f"{result.stderr[-5000:]}"
        )
    return result


def run_cli_here(
    *args: str, stdin: str | bytes = "", expect: int | None = 0
) -> subprocess.CompletedProcess:
    """``nemo-orch ARGS`` in this process (``cli.main``): the same parsing, config loading, error
    handling and exit codes as :func:`run_cli` without the seconds an interpreter start costs.
    For checks of what a command answers; keep :func:`run_cli` where the process itself matters
    (signals, kills, environment). ``stdin`` bytes arrive as bytes, as from a pipe."""
    from nemo_orch import cli

    out, err = io.StringIO(), io.StringIO()
    stream = (
        io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
        if isinstance(stdin, bytes)
        else io.StringIO(stdin)
    )
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _stdin(stream):
        returncode = cli.main(list(args))
    result = subprocess.CompletedProcess(args, returncode, out.getvalue(), err.getvalue())
    if expect is not None and returncode != expect:
        raise AssertionError(
            f"nemo-orch {' '.join(args)} returned {returncode}, expected "
            f"{expect}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n"
            f"{result.stderr[-5000:]}"
        )
    return result


@contextlib.contextmanager
def _stdin(stream: io.TextIOBase):
    saved, sys.stdin = sys.stdin, stream
    try:
        yield
    finally:
        sys.stdin = saved


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def free_ports(count: int) -> list[int]:
    """Ports on 127.0.0.1 nothing listens on (held open together, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


# SLURM's own view of a job (scontrol), for the tests that launch on the local slurmctld.
ENDED = (
    "COMPLETED",
    "FAILED",
    "TIMEOUT",
    "CANCELLED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
)


def job_state(job_id: str) -> dict[str, str]:
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True
    ).stdout
    return dict(item.partition("=")[::2] for item in shown.split() if "=" in item)


def wait_for(predicate, what: str, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1.0)
