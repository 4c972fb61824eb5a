"""The main job, ``nemo-orch train``: the whole method on the offline environment, end to end.

1. **setup**: a tokenizer trained on the offline world's text; demonstrations: the episodes of
   ``data.demo_agent`` (the naive routers of ``data.demo_routers``) run through the real tools
   that the environment scores correct (``demonstrations.jsonl``, :mod:`nemo_orch.train.sft`);
   the offline ToolScale domains and tasks (``toolscale/``);
2. **sft**: the policy learns the call format and a first routing (``sft/``);
3. **grpo** (or, with ``grpo=ppo``, **ppo**): RL on fresh tasks with preference vectors
   (``grpo/``, ``ppo/``);
4. **eval**: through the evaluation harness, the SFT policy and every RL policy of the run
   (``grpo/``, ``ppo/``, and ``dpo/`` where ``nemo-orch dpo`` wrote one: algorithms compared
   from one SFT checkpoint) on held-out tasks (greedy), next to the oracle, and the gold replay
   of the offline ToolScale domain tasks written in setup (``toolscale/``), a check of their
   tools, whose tasks the policy never trained on (episodes in ``eval/``); ``report.json``,
   ``report.md`` and plots;
   ``runs/latest`` points at the run.

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
# The run's RL policies, each in <run>/<name>/checkpoints: GRPO's and PPO's stages, DPO's
# (nemo-orch dpo run.name=<run> trainer.init_from=runs/<run>/sft/checkpoints).
RL_POLICIES = ("grpo", "ppo", "dpo")


@dataclass
class MainJobSummary:
    run_dir: Path
    seconds: dict[str, float]
    sft: sft.SFTSummary
    rl: grpo.GRPOSummary  # the RL stage of grpo.algo
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
        raise ConfigError(
            f"nemo-orch train is the offline main job (env=offline); train on "
            f"env={config.env.label} with nemo-orch grpo"
        )
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
        algo = config.grpo.algo
        trainer = dataclasses.replace(config.trainer, init_from=str(sft_summary.checkpoint))
        rl_config = stage(config, algo, tokenizer=tokenizer_config, trainer=trainer)
        rl_summary = grpo.train(rl_config, context)
        seconds[algo] = time.perf_counter() - mark

        mark = time.perf_counter()
        policies = {
            "sft": sft_summary.checkpoint,
            **_other_policies(config),
            algo: rl_summary.checkpoint,
        }
        report = _evaluate(config, context, policies, tokenizer, toolscale_dir)
        seconds["eval"] = time.perf_counter() - mark
        if report is not None:
            report["wall_seconds"] = seconds
            main_job_report.write_report(config.run.dir, report, rl_config.run.dir)
            _point_latest(config.run.dir)
    return MainJobSummary(config.run.dir, seconds, sft_summary, rl_summary, report)


def _other_policies(config: Config) -> dict[str, Path]:
    """The run's RL policies trained before (another algorithm's stage, or ``nemo-orch dpo``'s):
    their latest checkpoints, evaluated beside this run's."""
    found = {}
    for name in RL_POLICIES:
        latest = checkpoint.latest_checkpoint(config.run.dir / name / "checkpoints")
        if name != config.grpo.algo and latest is not None:
            found[name] = latest.path
    return found


def _evaluate(
    config: Config,
    context: ParallelContext,
    checkpoints: dict[str, Path],
    tokenizer: Any,
    toolscale_dir: Path | None,
) -> dict[str, Any] | None:
    """The SFT and RL policies (their final ``checkpoints``, SFT's first and this run's RL
    stage's last) on held-out tasks, greedy, next to the oracle, through the harness, the
    policies' weights handed over in memory (rank 0's report; every rank gathers); and the gold
    replay of the ToolScale domain tasks (a check of their tools: the policies never trained on
    those domains, and a row of their zeros would say nothing)."""
    from nemo_orch.envs import build_environment
    from nemo_orch.eval import harness, main_job_report
    from nemo_orch.eval.systems import System
    from nemo_orch.models import qwen3
    from nemo_orch.rollout.engines.hf import HFEngine

    policies, sources = {}, {}
    for name, source in checkpoints.items():
        module = qwen3.build_model(
            config.model,
            config.parallel,
            pre_process=context.is_first_stage,
            post_process=context.is_last_stage,
        )
        checkpoint.load(checkpoint.open_checkpoint(source), module)
        policies[name] = weights.gather_hf_weights(
            module, config.model, config.rollout.refit_bucket_mb
        )
        sources[name] = checkpoint.identity(source)  # a cached episode is of these weights only
    if not distributed.is_writer():
        return None
    systems = {
        name: System(
            name,
            ORCHESTRATOR,
            HFEngine(
                config.model,
                hf,
                tokenizer=tokenizer,
                prefix_caching=config.rollout.prefix_caching,
                prefix_cache_mb=config.rollout.prefix_cache_mb,
            ),
            sources[name],
        )
        for name, hf in policies.items()
    }
    # Greedy, as many episodes at once as a rollout batches.
    config = dataclasses.replace(
        config,
        eval=dataclasses.replace(
            config.eval, temperature=0.0, concurrency=config.rollout.max_concurrent_episodes
        ),
    )
    offline = build_environment(config)
    evaluation = harness.evaluate(
        config, offline, list(systems.values()), config.run.dir / EVAL / offline.name, tokenizer
    )
    table = offline.oracle(offline.toolbox(), tokenizer)  # prices and schemas: not started
    report: dict[str, Any] = {
        name: main_job_report.policy_row(evaluation.tasks, evaluation.records[name], table)
        for name in policies
    }
    report["oracle"] = table.report(evaluation.tasks)
    for name in policies:
        if name != "sft":
            report[name]["gap_closed"] = main_job_report.gap_closed(report, name)
    report["eval_tasks"] = len(evaluation.tasks)
    if toolscale_dir is not None:
        source = EnvSourceConfig(
            kind="toolscale", path=str(toolscale_dir), limit=config.data.toolscale_eval_tasks
        )
        domains = build_environment(config, source)
        evaluation = harness.evaluate(
            config,
            domains,
            [System(GOLD_REPLAY, GOLD_REPLAY)],
            config.run.dir / EVAL / TOOLSCALE,
            tokenizer,
        )
        report["toolscale"] = {
            name: main_job_report.by_domain(evaluation.tasks, records)
            for name, records in evaluation.records.items()
        }
    return report


def _point_latest(run_dir: Path) -> None:
    latest = run_dir.parent / "latest"
    if latest.is_symlink() or latest.exists():
        latest.unlink()
    os.symlink(run_dir.name, latest)


def summary_lines(summary: MainJobSummary) -> list[str]:
    """What ``nemo-orch train`` prints at the end."""
    from nemo_orch.eval import main_job_report

    lines = [
        f"train: run {summary.run_dir} ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in summary.seconds.items())
        + ")"
    ]
    if summary.report is not None:
        lines.append(
            f"  {'policy':8} {'reward':>8} {'exp.rew':>8} {'accuracy':>9} "
            f"{'usd/task':>10} {'pref.adh':>9} {'or.route':>9} {'in.budget':>9} "
            f"{'fmt.err':>8}"
        )
        names = main_job_report.policies(summary.report)
        for name in names:
            row = summary.report[name]
            budget = row.get("within_budget")
            lines.append(
                f"  {name:8} {row['reward']:8.3f} {row['expected_reward']:8.3f} "
                f"{row['accuracy']:9.3f} {row['usd_per_task']:10.6f} "
                f"{row['pref_adherence']:9.3f} {row['oracle_route_share']:9.3f} "
                f"{'' if budget is None else format(budget, '.3f'):>9} "
                f"{row['format_error_rate']:8.3f}"
            )
        for name in main_job_report.trained(summary.report):
            closed = summary.report[name]["gap_closed"]
            missed = [
                target.name
                for target in main_job_report.targets(summary.report, name)
                if not target.met
            ]
            lines.append(
                f"  {name.upper()} closed "
                + ("no gap" if closed is None else f"{closed:.0%}")
                + " of the SFT -> oracle gap in expected reward; targets "
                + ("all met" if not missed else "missed: " + ", ".join(missed))
            )
        for agent, domains in summary.report.get("toolscale", {}).items():
            lines.append(
                f"  ToolScale domain tasks, {agent}: accuracy "
                + ", ".join(f"{domain} {row['accuracy']:.2f}" for domain, row in domains.items())
            )
        lines.append(f"  report {summary.run_dir / 'report.md'}")
    return lines
