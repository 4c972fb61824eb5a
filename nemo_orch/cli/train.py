"""The training commands: ``train`` (the main job), ``sft``, ``grpo`` and ``dpo``; a layout of
several processes re-runs the command under torchrun."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from nemo_orch.cli.common import Commands, add_command, is_rank_zero
from nemo_orch.config import Config

TRAINING_COMMANDS = ("train", "sft", "grpo", "dpo")


def launch_workers(config: Config) -> int | None:
    """Re-run this command under torchrun on this machine when the layout needs several
    processes and none were launched; returns the exit code, or None to run in-process."""
    world = config.parallel.world_size
    if world == 1 or "RANK" in os.environ:
        return None
    from nemo_orch.distributed import free_port

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "nemo_orch.cli",
        *sys.argv[1:],
    ]
    return subprocess.call(command)


def _summarize_sft(summary, job: str) -> None:
    if summary.start_step >= summary.end_step:
        print(f"{job}: already complete at step {summary.end_step} ({summary.run_dir})")
        return
    print(
        f"{job}: supervised fine-tuning of the policy, steps {summary.start_step + 1}-"
        f"{summary.end_step} on {summary.num_samples} conversations "
        f"({summary.num_dropped} longer than data.seq_length dropped)"
    )
    print(
        f"  loss {summary.first_loss:.4f} -> {summary.last_loss:.4f}, "
        f"{summary.mean_tokens_per_s or 0:.0f} tokens/s"
    )
    print(f"  checkpoint {summary.checkpoint}")
    print(
        f"  metrics    {summary.run_dir / 'metrics.jsonl'} (TensorBoard: "
        f"{summary.run_dir / 'tensorboard'})"
    )


def cmd_sft(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.train import sft

    summary = sft.run(config)
    if is_rank_zero():
        _summarize_sft(summary, args.command)
    return 0


def cmd_train(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.train import main_job

    summary = main_job.run(config)
    if is_rank_zero():
        print("\n".join(main_job.summary_lines(summary)))
    return 0


def cmd_grpo(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.train import grpo, main_job

    stage = main_job.stage(grpo.start_model(config), f"grpo-{config.env.label}")
    summary = grpo.run(stage)
    if is_rank_zero():
        if summary.start_step >= summary.end_step:
            print(f"grpo: already complete at step {summary.end_step} ({summary.run_dir})")
            return 0

        def reward(value: float | None) -> str:
            return "none (no group kept)" if value is None else f"{value:.3f}"

        print(
            f"grpo: env={config.env.label}, steps {summary.start_step + 1}-{summary.end_step} "
            f"from {stage.trainer.init_from}; reward {reward(summary.first_reward)} -> "
            f"{reward(summary.last_reward)}"
        )
        print(f"  checkpoint {summary.checkpoint}")
        print(f"  metrics    {summary.run_dir / 'metrics.jsonl'} (per source: source/<name>/...)")
    return 0


def cmd_dpo(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.train import dpo, grpo, main_job

    stage = main_job.stage(grpo.start_model(config, command="dpo"), "dpo")
    summary = dpo.run(stage)
    if is_rank_zero():
        if summary.start_step >= summary.end_step:
            print(f"dpo: already complete at step {summary.end_step} ({summary.run_dir})")
            return 0
        print(
            f"dpo: steps {summary.start_step + 1}-{summary.end_step} from "
            f"{stage.trainer.init_from} on {summary.num_pairs} pairs of {summary.pairs_path} "
            f"({summary.num_dropped} longer than the policy's context dropped)"
        )
        print(
            f"  loss {summary.first_loss:.4f} -> {summary.last_loss:.4f}, reward accuracy "
            f"{summary.first_accuracy:.3f} -> {summary.last_accuracy:.3f}"
        )
        print(f"  checkpoint {summary.checkpoint}")
        print(f"  metrics    {summary.run_dir / 'metrics.jsonl'}")
    return 0


def add_commands(commands: Commands) -> None:
    """``train``, ``sft``, ``grpo`` and ``dpo``."""
    add_command(
        commands,
        "train",
        cmd_train,
        "the main job: demonstrations, SFT, GRPO, evaluation and report",
    )
    add_command(
        commands,
        "sft",
        cmd_sft,
        "supervised fine-tuning on chat conversations (assistant-token loss)",
    )
    add_command(
        commands,
        "grpo",
        cmd_grpo,
        "GRPO alone on the configured environment (env=NAME: offline, "
        "toolscale, tau2, qa, hle, frames, tasks, or a mixture such as toolscale_qa) from "
        "trainer.init_from (a checkpoint or an HF directory), into <run>/grpo-<env>/ (resumes)",
    )
    add_command(
        commands,
        "dpo",
        cmd_dpo,
        "DPO from trainer.init_from against its frozen copy, on the pairs of "
        "dpo.pairs_path or, with none, on pairs of its own rollouts on env=NAME (the best and "
        "worst episode of each task, dpo.min_margin apart), into <run>/dpo/ (resumes)",
    )
