"""Running the real ``nemo-orch`` command line from tests, as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

def small_sft_overrides(tokenizer_dir: Path, output_dir: Path, name: str) -> list[str]:
    """A few-second SFT configuration of the tiny model on the offline data."""
    return [f"run.output_dir={output_dir}", f"run.name={name}", f"tokenizer.path={tokenizer_dir}",
            "model.vocab_size=1024", "data.num_offline_conversations=64",
            "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
            "trainer.warmup_steps=2", "trainer.num_threads=1"]


def run_cli(*args: str, env: dict[str, str] | None = None,
            expect: int | None = 0) -> subprocess.CompletedProcess:
    """Run ``nemo-orch ARGS`` as users do; ``expect`` is the required exit code (None: any)."""
    result = subprocess.run([sys.executable, "-m", "nemo_orch.cli", *args], capture_output=True,
                            text=True, env={**os.environ, **(env or {})}, timeout=600)
    if expect is not None and result.returncode != expect:
        raise AssertionError(f"nemo-orch {' '.join(args)} exited {result.returncode}, expected "
                             f"{expect}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n"
                             f"{result.stderr[-5000:]}")
    return result


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
