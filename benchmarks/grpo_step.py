"""GRPO step throughput when tools are slow: synchronous vs. asynchronous GRPO.

What it measures: ``nemo-orch grpo`` on the main job (its SFT policy, the offline world's tools
and SIMULATED experts, ``grpo.prompts_per_step`` x ``rollout.group_size`` episodes a step),
with every tool call first waiting ``tools.simulated_latency_s`` (``--latencies``, default 0,
0.5 and 2 s: the reference's experts take 10 to 100 s), twice per latency:

* **sync**: roll out, then train, then refit (the default);
* **async**: ``grpo.async_grpo.enabled`` with ``max_trajectory_age_steps=1`` and truncated
  importance sampling: the next step's rollouts run while the trainer trains, refitted in
  flight.

Each configuration is its own ``nemo-orch grpo`` process of ``--steps`` steps from the same
checkpoint; the first step (engine and tool warm-up, and for async the step with nothing ahead)
is left out, and each later step's wall time (``time/step_s`` in ``metrics.jsonl``: from the
step's start to its refit, the wait for its batch included) is kept.

How to read the table: "s/step" is the median step time; "samples/s" is the mean of samples
trained per step over the median step time; "vs sync" is async's samples/s over sync's at the
same latency (above 1: async is faster). "trainer idle" is the median time an async trainer
waited for its batch, "ages" the trained groups by how many updates older than the trainer's
their oldest weights were.

Run: ``python benchmarks/grpo_step.py [--init-from runs/tiny-sft/sft/checkpoints --steps 5
--latencies 0 0.5 2] [-- key=value ...]`` after ``make train`` (its SFT checkpoint is the
starting policy; the settings after ``--`` apply to both modes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ASYNC = [
    "grpo.async_grpo.enabled=true",
    "grpo.async_grpo.max_trajectory_age_steps=1",
    "grpo.importance_sampling_cap=2.0",
]


def run_grpo(
    init_from: Path, out: Path, steps: int, latency: float, mode: str, extra: list[str]
) -> list[dict]:
    """One ``nemo-orch grpo`` run; its per-step metrics."""
    overrides = [
        f"trainer.init_from={init_from}",
        f"run.output_dir={out}",
        f"run.name={mode}",
        f"grpo.max_steps={steps}",
        f"grpo.save_interval={steps}",
        f"tools.simulated_latency_s={latency}",
        *(ASYNC if mode == "async" else []),
        *extra,
    ]
    done = subprocess.run(
        [sys.executable, "-m", "nemo_orch.cli", "grpo", *overrides], capture_output=True, text=True
    )
    if done.returncode:
        sys.exit(
            f"nemo-orch grpo ({mode}, {latency:g} s) exited {done.returncode}:\n"
            f"{done.stderr[-3000:]}"
        )
    (metrics,) = (out / mode).glob("grpo-*/metrics.jsonl")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def summary(metrics: list[dict]) -> dict[str, float | str]:
    timed = metrics[1:]  # the first step warms up
    step_s = statistics.median(m["time/step_s"] for m in timed)
    ages = Counter(
        {
            key.removeprefix("async/age_"): value
            for m in timed
            for key, value in m.items()
            if key.startswith("async/age_")
        }
    )
    idle = [m["async/trainer_idle_s"] for m in timed if "async/trainer_idle_s" in m]
    return {
        "step_s": step_s,
        "samples_per_s": statistics.mean(m["samples"] for m in timed) / step_s,
        "trainer_idle_s": statistics.median(idle) if idle else float("nan"),
        "ages": " ".join(f"{age}:{count}" for age, count in sorted(ages.items())) or "-",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--init-from",
        type=Path,
        default=Path("runs/tiny-sft/sft/checkpoints"),
        help="the SFT checkpoint GRPO starts from (make train writes it)",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--latencies", type=float, nargs="+", default=[0.0, 0.5, 2.0])
    parser.add_argument("overrides", nargs="*", help="more key=value settings for both modes")
    args = parser.parse_args()
    if not args.init_from.exists():
        parser.error(f"{args.init_from}: no checkpoint; run make train first or pass --init-from")
    rows = []
    with tempfile.TemporaryDirectory(prefix="grpo-step-") as scratch:
        for latency in args.latencies:
            for mode in ("sync", "async"):
                out = Path(scratch) / f"{latency:g}"
                rows.append(
                    (
                        latency,
                        mode,
                        summary(
                            run_grpo(args.init_from, out, args.steps, latency, mode, args.overrides)
                        ),
                    )
                )
    print(
        f"# GRPO step throughput ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs; {args.steps - 1} timed steps each, from {args.init_from})"
    )
    print("| tool latency | mode | s/step | samples/s | vs sync | trainer idle s | ages |")
    print("|---:|---|---:|---:|---:|---:|---|")
    sync = {latency: result for latency, mode, result in rows if mode == "sync"}
    for latency, mode, result in rows:
        ratio = result["samples_per_s"] / sync[latency]["samples_per_s"]
        idle = "" if mode == "sync" else f"{result['trainer_idle_s']:.2f}"
        print(
            f"| {latency:g} s | {mode} | {result['step_s']:.2f} | "
            f"{result['samples_per_s']:.2f} | {ratio:.2f}x | {idle} | {result['ages']} |"
        )


if __name__ == "__main__":
    main()
