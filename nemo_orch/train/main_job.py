"""The main job, ``nemo-orch train``: the whole method on the offline environment, end to end.

1. **setup**: a tokenizer trained on the offline world's text; demonstrations from the naive
   routers of ``data.demo_routers`` run through the real tools, keeping the episodes that end
   right (``demonstrations.jsonl``); the offline ToolScale domains and tasks (``toolscale/``);
2. **sft**: the policy learns the call format and a first routing (``sft/``);
3. **grpo**: RL on fresh tasks with preference vectors (``grpo/``);
4. **eval**: the SFT and GRPO policies on held-out tasks (greedy), next to the oracle, and the
   GRPO policy on the offline ToolScale domain tasks written in setup (``toolscale/``), next to
   the gold replay; ``report.json``, ``report.md`` and plots; ``runs/latest`` points at the run.

Every stage resumes: a finished stage is skipped, an interrupted one continues from its last
checkpoint. All stages share one process group, so ``parallel.*`` layouts run the whole job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_orch import distributed
from nemo_orch.config import Config, ConfigError
from nemo_orch.envs.offline import generator as offline
from nemo_orch.data.conversations import write_conversations
from nemo_orch.envs.offline.world import demonstrations, held_out_tasks, make_tasks
from nemo_orch.distributed import ParallelContext
from nemo_orch.models import checkpoint, weights
from nemo_orch.train import grpo, sft

log = logging.getLogger(__name__)

DEMONSTRATIONS = "demonstrations.jsonl"
TOOLSCALE = "toolscale"


@dataclass
class MainJobSummary:
    run_dir: Path
    seconds: dict[str, float]
    sft: sft.SFTSummary
    grpo: grpo.GRPOSummary
    report: dict[str, Any] | None


def stage(config: Config, name: str, **sections: Any) -> Config:
    """The config of one stage: its own directory under the run, resuming by default."""
    run = dataclasses.replace(config.run, name=f"{config.run.name}/{name}")
    trainer = dataclasses.replace(config.trainer, resume=True)
    return dataclasses.replace(config, run=run, trainer=trainer, **sections)


def _prepare_demonstrations(config: Config, tokenizer_dir: Path) -> Path:
    """Rank 0 writes the demonstrations once (atomically); the other ranks wait."""
    from nemo_orch.models.tokenizer import load_tokenizer
    from nemo_orch.rollout.builders import build_toolbox

    path = config.run.dir / DEMONSTRATIONS
    if distributed.is_writer() and not path.exists():
        tokenizer = load_tokenizer(tokenizer_dir)
        wanted = config.data.num_offline_conversations
        tasks = make_tasks(2 * wanted, seed=config.run.seed, prefix="demo")

        async def generate() -> list[dict]:
            async with build_toolbox(config.tools) as toolbox:
                return await demonstrations(tasks, toolbox, tokenizer, config.resolved_rollout(),
                                            config.run.seed, config.data.demo_routers)

        conversations = asyncio.run(generate())[:wanted]
        partial = path.with_suffix(".partial")
        write_conversations(partial, conversations)
        partial.rename(path)
        log.info("wrote %d demonstrations to %s", len(conversations), path)
    distributed.barrier()
    return path


def _prepare_toolscale(config: Config) -> Path | None:
    """Rank 0 writes the offline ToolScale domains and tasks once (atomically)."""
    from nemo_orch.envs.toolscale.generator import write_offline

    if config.data.toolscale_eval_tasks == 0:
        return None
    path = config.run.dir / TOOLSCALE
    if distributed.is_writer() and not path.exists():
        partial = path.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        write_offline(partial, config.data.toolscale_tasks_per_domain, config.run.seed)
        partial.rename(path)
    distributed.barrier()
    return path


def _tokenizer(config: Config) -> Path:
    """The run's tokenizer: trained (by rank 0) on the offline world's conversations."""
    _, directory = sft.prepare_tokenizer(
        config, offline.generate_conversations(config.data.num_offline_conversations,
                                               config.run.seed))
    return directory


def run(config: Config) -> MainJobSummary:
    from nemo_orch.eval import orchestration

    if config.env.kind != "offline":
        raise ConfigError(f"nemo-orch train is the offline main job (env=offline); train on "
                          f"env={config.env.label} with nemo-orch grpo")
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    with distributed.parallel_session(config.parallel, config.run.seed) as context:
        tokenizer_dir = _tokenizer(config)
        demos = _prepare_demonstrations(config, tokenizer_dir)
        toolscale_dir = _prepare_toolscale(config)
        seconds["setup"] = time.perf_counter() - started

        mark = time.perf_counter()
        data = dataclasses.replace(config.data, sft_path=str(demos))
        tokenizer = dataclasses.replace(config.tokenizer, path=str(tokenizer_dir))
        sft_config = stage(config, "sft", data=data, tokenizer=tokenizer)
        sft_summary = sft.train(sft_config, context)
        seconds["sft"] = time.perf_counter() - mark

        mark = time.perf_counter()
        sft_checkpoint = checkpoint.latest_checkpoint(checkpoint.checkpoints_dir(sft_config))
        grpo_config = stage(config, "grpo", tokenizer=tokenizer)
        grpo_summary = grpo.train(grpo_config, context, sft_checkpoint.path, tokenizer_dir)
        seconds["grpo"] = time.perf_counter() - mark

        mark = time.perf_counter()
        report = _evaluate(config, context, sft_checkpoint.path, grpo_config, tokenizer_dir,
                           toolscale_dir)
        seconds["eval"] = time.perf_counter() - mark
        if report is not None:
            report["wall_seconds"] = seconds
            orchestration.write_report(config.run.dir, report, grpo_config.run.dir)
            _point_latest(config.run.dir)
    return MainJobSummary(config.run.dir, seconds, sft_summary, grpo_summary, report)


def _evaluate(config: Config, context: ParallelContext, sft_checkpoint: Path,
              grpo_config: Config, tokenizer_dir: Path,
              toolscale_dir: Path | None) -> dict[str, Any] | None:
    """The SFT and GRPO policies on held-out tasks, greedy, and the oracle; the GRPO policy
    and the gold replay on ToolScale domain tasks (rank 0's report)."""
    from nemo_orch.eval import orchestration, toolscale
    from nemo_orch.models import qwen3
    from nemo_orch.models.tokenizer import load_tokenizer

    policies = {}
    for name, source in (("sft", sft_checkpoint),
                         ("grpo", checkpoint.checkpoints_dir(grpo_config))):
        module = qwen3.build_model(config.model, config.parallel,
                                   pre_process=context.is_first_stage,
                                   post_process=context.is_last_stage)
        checkpoint.load(checkpoint.open_checkpoint(source), module)
        policies[name] = weights.gather_hf_weights(module, config.model)
    if not distributed.is_writer():
        return None
    tasks = held_out_tasks(config.grpo.eval_tasks, config.run.seed)
    report = orchestration.evaluate_policies(config, policies, tasks, tokenizer_dir,
                                             episodes_dir=config.run.dir / "episodes")
    if toolscale_dir is not None:
        report["toolscale"] = toolscale.evaluate_policies(
            config, {"grpo": policies["grpo"]}, toolscale_dir, config.data.toolscale_eval_tasks,
            load_tokenizer(tokenizer_dir))
    return report


def _point_latest(run_dir: Path) -> None:
    latest = run_dir.parent / "latest"
    if latest.is_symlink() or latest.exists():
        latest.unlink()
    os.symlink(run_dir.name, latest)


def summary_lines(summary: MainJobSummary) -> list[str]:
    """What ``nemo-orch train`` prints at the end."""
    lines = [f"train: run {summary.run_dir} ("
             + ", ".join(f"{k} {v:.0f} s" for k, v in summary.seconds.items()) + ")"]
    if summary.report is not None:
        lines.append(f"  {'policy':8} {'reward':>8} {'accuracy':>9} {'usd/task':>10} "
                     f"{'pref.adh':>9} {'or.route':>9} {'fmt.err':>8}")
        for name in ("sft", "grpo", "oracle"):
            row = summary.report[name]
            lines.append(f"  {name:8} {row['reward']:8.3f} {row['accuracy']:9.3f} "
                         f"{row['usd_per_task']:10.6f} {row['pref_adherence']:9.3f} "
                         f"{row['oracle_route_share']:9.3f} {row['format_error_rate']:8.3f}")
        closed = summary.report.get("gap_closed")
        if closed is not None:
            lines.append(f"  GRPO closed {closed:.0%} of the SFT -> oracle reward gap")
        for agent, domains in summary.report.get("toolscale", {}).items():
            lines.append(f"  ToolScale domain tasks, {agent}: accuracy " + ", ".join(
                f"{domain} {row['accuracy']:.2f}" for domain, row in domains.items()))
        lines.append(f"  report {summary.run_dir / 'report.md'}")
    return lines
