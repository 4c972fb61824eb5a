"""``plan`` (will the layout fit, on CPU) and ``launch`` (run a job through NeMo-Run, or show
the last SLURM job's state and logs)."""

from __future__ import annotations

import argparse
import sys

from nemo_orch import config as config_lib
from nemo_orch.cli.common import EXIT_USER_ERROR, Commands, add_command
from nemo_orch.config import Config


def cmd_plan(config: Config, args: argparse.Namespace) -> int:
    """Exit 2 on a layout problem, 1 when the estimate does not fit the GPU."""
    from nemo_orch.launcher import plan

    problems = plan.layout_problems(config)
    if problems:
        print(
            "\n".join(f"nemo-orch plan: error: {problem}" for problem in problems), file=sys.stderr
        )
        return EXIT_USER_ERROR
    result = plan.plan(config)
    print("\n".join(plan.report(config, result)))
    return 0 if result.fits() else 1


def cmd_launch(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.launcher import jobs, launch

    if args.status:
        print("\n".join(jobs.status_lines(jobs.latest(config))))
        return 0
    if args.logs:
        print(jobs.log_text(jobs.latest(config), args.lines))
        return 0
    return launch.launch(config, args.overrides, dryrun=args.dryrun)


def _executor_config(args: argparse.Namespace) -> Config:
    """``--executor`` is short for ``launcher.executor`` (and wins over an override of it)."""
    executor = [] if args.executor is None else [f"launcher.executor={args.executor}"]
    return config_lib.load([*args.overrides, *executor])


def add_commands(commands: Commands) -> None:
    """``plan`` and ``launch``."""
    add_command(
        commands,
        "plan",
        cmd_plan,
        "check the layout (world size, divisibility, batches, engine TP, FP8 "
        "shapes) and print the per-GPU memory estimate of the SFT and GRPO stages against "
        "launcher.gpu_memory_gib, on CPU; exit 1 if it does not fit. E.g. `nemo-orch plan "
        "recipe=NAME` (recipes: nemo_orch/conf/recipes/)",
    )
    launch = add_command(
        commands,
        "launch",
        cmd_launch,
        "run `nemo-orch <launcher.job>` with these overrides "
        "through NeMo-Run: under torchrun on this machine (local), or as a SLURM job "
        "in the pyxis container with the expert servers (launcher.experts) and a Ray "
        "cluster (launcher.ray) in the same job (slurm)",
        load_config=_executor_config,
    )
    launch.add_argument(
        "--executor", choices=["local", "slurm"], default=None, help="sets launcher.executor"
    )
    shown = launch.add_mutually_exclusive_group()
    shown.add_argument(
        "--dryrun",
        action="store_true",
        help="print what would run (the sbatch scripts) and submit nothing",
    )
    shown.add_argument(
        "--status",
        action="store_true",
        help="the state of the last SLURM job launched for run.name (in "
        "launcher.slurm.job_dir; the same recipe and overrides find it): "
        "scontrol's fields, the experiment's directory, the log of each attempt",
    )
    shown.add_argument(
        "--logs", action="store_true", help="the end of that job's logs (--lines), one per attempt"
    )
    launch.add_argument("--lines", type=int, default=40, help="with --logs: lines of each log")
