"""Stopping on SIGUSR1 (what SLURM sends before a time limit) without SLURM: the run finishes
its step, checkpoints it, exits 75, and the same command resumes from there."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from support.cli_helpers import read_metrics, run_cli, small_sft_overrides

from nemo_orch.train.preemption import REQUEUE_EXIT_CODE


@pytest.mark.slow
def test_a_signalled_run_checkpoints_its_step_exits_75_and_resumes(tiny_tokenizer_dir, tmp_path):
    overrides = [
        *small_sft_overrides(tiny_tokenizer_dir, tmp_path, "run"),
        "model.num_layers=2",
        "trainer.save_interval=1000",
    ]
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "nemo_orch.cli", "sft", *overrides, "trainer.max_steps=500"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir):
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.2)
        os.kill(process.pid, signal.SIGUSR1)
        _, stderr = process.communicate(timeout=300)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == REQUEUE_EXIT_CODE, stderr
    (stopped,) = map(int, re.findall(r"stopped on request \(SIGUSR1\) after step (\d+)", stderr))
    assert stopped < 500 and (run_dir / "checkpoints" / f"step_{stopped}").is_dir()
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, stopped + 1))

    resumed = run_cli("sft", *overrides, f"trainer.max_steps={stopped + 1}", "trainer.resume=true")
    assert f"steps {stopped + 1}-{stopped + 1}" in resumed.stdout
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, stopped + 2))
