"""The main job, ``nemo-orch train``: the whole method on the offline environment, end to end.

1. **setup**: a tokenizer trained on the offline world's text; demonstrations: the episodes of
   ``data.demo_agent`` (the naive routers of ``data.demo_routers``) run through the real tools
   that the environment scores correct (``demonstrations.jsonl``, :mod:`nemo_orch.train.sft`);
   the offline ToolScale domains and tasks (``toolscale/``);
2. **sft**: the policy learns the call format and a first routing (``sft/``);
3. **grpo**: RL on fresh tasks with preference vectors (``grpo/``);
4. **eval**: through the evaluation harness, the SFT and GRPO policies on held-out tasks
   (greedy), next to the oracle, and the GRPO policy on the offline ToolScale domain tasks
   written in setup (``toolscale/``), next to the gold replay (episodes in ``eval/``);
   ``report.json``, ``report.md`` and plots; ``runs/latest`` points at the run.

Every stage resumes: a finished stage is skipped, an interrupted one continues from its last
checkpoint. All stages share one process group, so ``parallel.*`` layouts run the whole job.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_orch import distributed
from nemo_orch.config import GOLD_REPLAY, ORCHESTRATOR, Config, ConfigError, EnvSourceConfig
from nemo_orch.distributed import ParallelContext
from nemo_orch.models import checkpoint, weights
from nemo_orch.train import grpo, sft

log = logging.getLogger(__name__)

TOOLSCALE = "toolscale"
EVAL = "eval"  # <run>/eval/<environment>/episodes/<system>.jsonl


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
    trainer = dataclasses.replace(sections.pop("trainer", config.trainer), resume=True)
    return dataclasses.replace(config, run=run, trainer=trainer, **sections)


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


def run(config: Config) -> MainJobSummary:
    from nemo_orch.eval import main_job_report

    if config.env.kind != "offline":
        raise ConfigError(f"nemo-orch train is the offline main job (env=offline); train on "
                          f"env={config.env.label} with nemo-orch grpo")
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    with distributed.parallel_session(config.parallel, config.run.seed) as context:
        tokenizer = sft.prepare_tokenizer(config)
        demos = sft.prepare_demonstrations(config, tokenizer)
        toolscale_dir = _prepare_toolscale(config)
        seconds["setup"] = time.perf_counter() - started

        mark = time.perf_counter()
        data = dataclasses.replace(config.data, sft_path=str(demos))
        tokenizer_config = dataclasses.replace(config.tokenizer, path=str(config.tokenizer_dir))
        sft_config = stage(config, "sft", data=data, tokenizer=tokenizer_config)
        sft_summary = sft.train(sft_config, context, tokenizer)
        seconds["sft"] = time.perf_counter() - mark

        mark = time.perf_counter()
        trainer = dataclasses.replace(config.trainer, init_from=str(sft_summary.checkpoint))
        grpo_config = stage(config, "grpo", tokenizer=tokenizer_config, trainer=trainer)
        grpo_summary = grpo.train(grpo_config, context)
        seconds["grpo"] = time.perf_counter() - mark

        mark = time.perf_counter()
        report = _evaluate(config, context, {"sft": sft_summary.checkpoint,
                                             "grpo": grpo_summary.checkpoint},
                           tokenizer, toolscale_dir)
        seconds["eval"] = time.perf_counter() - mark
        if report is not None:
            report["wall_seconds"] = seconds
            main_job_report.write_report(config.run.dir, report, grpo_config.run.dir)
            _point_latest(config.run.dir)
    return MainJobSummary(config.run.dir, seconds, sft_summary, grpo_summary, report)


def _evaluate(config: Config, context: ParallelContext, checkpoints: dict[str, Path],
              tokenizer: Any, toolscale_dir: Path | None) -> dict[str, Any] | None:
    """The SFT and GRPO policies (their final ``checkpoints``) on held-out tasks, greedy, next
    to the oracle; the GRPO policy and the gold replay on ToolScale domain tasks. Both through
    the harness, the policies' weights handed over in memory (rank 0's report; every rank
    gathers)."""
    from nemo_orch.envs import build_environment
    from nemo_orch.eval import harness, main_job_report
    from nemo_orch.models import qwen3
    from nemo_orch.rollout.engines.hf import HFEngine

    policies, sources = {}, {}
    for name, source in checkpoints.items():
        module = qwen3.build_model(config.model, config.parallel,
                                   pre_process=context.is_first_stage,
                                   post_process=context.is_last_stage)
        opened = checkpoint.open_checkpoint(source)
        checkpoint.load(opened, module)
        policies[name] = weights.gather_hf_weights(module, config.model)
        sources[name] = str(opened.path)  # a cached episode is of these weights only
    if not distributed.is_writer():
        return None
    systems = {name: harness.System(name, ORCHESTRATOR,
                                    HFEngine(config.model, hf, tokenizer=tokenizer),
                                    sources[name])
               for name, hf in policies.items()}
    # Greedy, as many episodes at once as a rollout batches.
    config = dataclasses.replace(config, eval=dataclasses.replace(
        config.eval, temperature=0.0, concurrency=config.rollout.max_concurrent_episodes))
    offline = build_environment(config)
    evaluation = harness.evaluate(config, offline, list(systems.values()),
                                  config.run.dir / EVAL / offline.name, tokenizer)
    table = offline.oracle(offline.toolbox(), tokenizer)  # prices and schemas: not started
    report: dict[str, Any] = {
        name: main_job_report.policy_row(evaluation.tasks, evaluation.records[name], table)
        for name in policies}
    report["oracle"] = table.report(evaluation.tasks)
    report["gap_closed"] = main_job_report.gap_closed(report)
    report["eval_tasks"] = len(evaluation.tasks)
    if toolscale_dir is not None:
        source = EnvSourceConfig(kind="toolscale", path=str(toolscale_dir),
                                 limit=config.data.toolscale_eval_tasks)
        domains = build_environment(config, source)
        evaluation = harness.evaluate(
            config, domains, [harness.System(GOLD_REPLAY, GOLD_REPLAY), systems["grpo"]],
            config.run.dir / EVAL / TOOLSCALE, tokenizer)
        report["toolscale"] = {name: main_job_report.by_domain(evaluation.tasks, records)
                               for name, records in evaluation.records.items()}
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
                     f"{'pref.adh':>9} {'or.route':>9} {'in.budget':>9} {'fmt.err':>8}")
        for name in ("sft", "grpo", "oracle"):
            row = summary.report[name]
            budget = row.get("within_budget")
            lines.append(f"  {name:8} {row['reward']:8.3f} {row['accuracy']:9.3f} "
                         f"{row['usd_per_task']:10.6f} {row['pref_adherence']:9.3f} "
                         f"{row['oracle_route_share']:9.3f} "
                         f"{'' if budget is None else format(budget, '.3f'):>9} "
                         f"{row['format_error_rate']:8.3f}")
        closed = summary.report.get("gap_closed")
        if closed is not None:
            lines.append(f"  GRPO closed {closed:.0%} of the SFT -> oracle reward gap")
        for agent, domains in summary.report.get("toolscale", {}).items():
            lines.append(f"  ToolScale domain tasks, {agent}: accuracy " + ", ".join(
                f"{domain} {row['accuracy']:.2f}" for domain, row in domains.items()))
        lines.append(f"  report {summary.run_dir / 'report.md'}")
    return lines
