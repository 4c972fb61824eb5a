"""``rollout``: episodes of the policy on a task file, written as trajectories (JSONL), in this
process or over Ray actors."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import time
from pathlib import Path

from nemo_orch.cli.common import Commands, add_command
from nemo_orch.config import Config


def cmd_rollout(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.data.tasks import read_tasks
    from nemo_orch.rollout import builders
    from nemo_orch.rollout.runner import run_rollouts

    tasks = read_tasks(args.tasks)
    samples = args.n or config.rollout.group_size

    if config.rollout.backend == "ray":
        from nemo_orch.rollout import ray_workers

        async def rollouts():
            pool = ray_workers.build_ray_pool(
                config, ray_workers.policy_engine(config), scoring=False
            )
            async with pool:
                return await pool.run(tasks, samples, seed=config.run.seed)
    else:
        engine, tokenizer = builders.build_engine(config)

        async def rollouts():
            async with builders.build_toolbox(config.tools) as toolbox:
                return await run_rollouts(
                    tasks,
                    samples,
                    engine,
                    toolbox,
                    tokenizer,
                    builders.rollout_settings(config, engine),
                    seed=config.run.seed,
                )

    started = time.perf_counter()
    trajectories = asyncio.run(rollouts())
    seconds = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        "".join(json.dumps(t.to_json(), ensure_ascii=False) + "\n" for t in trajectories)
    )
    ended = collections.Counter(str(t.termination) for t in trajectories)
    mean_cost = statistics.mean(t.cost_usd for t in trajectories)
    mean_turns = statistics.mean(len(t.turns) for t in trajectories)
    print(
        f"rollout: {len(trajectories)} episodes ({len(tasks)} tasks x {samples}) in "
        f"{seconds:.1f} s -> {out}"
    )
    print(f"  ended by {dict(ended)}; mean cost ${mean_cost:.6f}, mean turns {mean_turns:.1f}")
    return 0


def add_commands(commands: Commands) -> None:
    """``rollout``."""
    rollout = add_command(
        commands,
        "rollout",
        cmd_rollout,
        "run episodes of the policy on a task file and "
        "write trajectories (JSONL); rollout.backend=ray spreads them over Ray actors",
    )
    rollout.add_argument("--tasks", required=True, help="JSONL task file")
    rollout.add_argument(
        "--n", type=int, default=None, help="episodes per task (default: rollout.group_size)"
    )
    rollout.add_argument("--out", required=True, help="JSONL file for the trajectories")
