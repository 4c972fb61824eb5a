"""Why a main-job run learned what it learned: the numbers of docs/main_job.md's diagnosis.

``python scripts/diagnose_main_job.py [--tasks N] [--samples S] [key=value ...]`` reads the run
the overrides name (``runs/<run.name>``, the main job's defaults otherwise) and prints Markdown:

1. **does the policy condition on the preference**: the first ``N`` held-out tasks, each
   restated under every preference of its family, their routes greedy (what the evaluation
   scores) and sampled ``S`` times at temperature 1 (what GRPO explores), for the SFT and the
   RL policy: the mean total-variation distance between two preferences' route distributions
   for one task, next to the oracle's (:mod:`nemo_orch.envs.offline.probe`);
2. **which groups carry no signal**: from the RL stage's metrics, per step (first and last
   eighth of the run) and per (family, preference) group, the share of task groups whose
   rewards were all equal and whose episodes all took one route;
3. **where the accuracy went**: from ``report.json``, each group's accuracy and reward, SFT
   against RL, with the routes that changed;
4. **the batch's mix**: each preference's share of the trained advantage mass.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from nemo_orch import config as config_lib
from nemo_orch.envs import build_environment
from nemo_orch.envs.offline.probe import Separation, probe
from nemo_orch.rollout.builders import build_engine, rollout_settings


def _separations(
    config: config_lib.Config, policy: Path, tasks: int, samples: int
) -> dict[str, dict[str, Separation]]:
    """The policy's :class:`Separation` greedy and sampled, per family."""
    config = dataclasses.replace(
        config, rollout=dataclasses.replace(config.rollout, policy=str(policy))
    )
    engine, tokenizer = build_engine(config)
    environment = build_environment(config)
    held_out = environment.tasks("test", None, config.eval_seed)[:tasks]
    found = {}
    for name, temperature, count in (("greedy", 0.0, 1), ("sampled", 1.0, samples)):
        settings = dataclasses.replace(rollout_settings(config, engine), temperature=temperature)
        found[name] = asyncio.run(
            probe(environment, held_out, engine, tokenizer, settings, count, seed=config.run.seed)
        )
    return found


def _mean(values: list[float]) -> str:
    return f"{statistics.mean(values):.2f}" if values else ""


def conditioning(
    config: config_lib.Config, policies: list[str], tasks: int, samples: int
) -> list[str]:
    lines = [
        f"## Does the route follow the preference? ({tasks} held-out tasks, each under "
        f"every preference of its family; sampled: {samples} episodes at temperature 1)",
        "",
        "| policy | decoding | family | pairs | route TV | first-call TV | oracle TV |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for policy in policies:
        found = _separations(config, config.run.dir / policy / "checkpoints", tasks, samples)
        for decoding, families in found.items():
            lines += [
                f"| {policy} | {decoding} | {family} | {row.pairs} | {row.policy:.2f} | "
                f"{row.first_call:.2f} | {row.oracle:.2f} |"
                for family, row in families.items()
            ]
    return lines


def signal(metrics: list[dict[str, Any]]) -> list[str]:
    steps = [m for m in metrics if "signal/flat" in m]
    if not steps:
        return [
            "## Signal: the run's metrics have no signal/* keys (a run before they were logged)"
        ]
    eighth = max(len(steps) // 8, 1)
    lines = [
        "## Which groups carry no signal (share of task groups per step)",
        "",
        "| steps | flat rewards | one route |",
        "|---|---:|---:|",
    ]
    for label, part in (
        ("first eighth", steps[:eighth]),
        ("last eighth", steps[-eighth:]),
        ("all", steps),
    ):
        lines.append(
            f"| {label} | {_mean([m['signal/flat'] for m in part])} | "
            f"{_mean([m['signal/one_route'] for m in part])} |"
        )
    groups = sorted(
        {
            key.rsplit("/", 1)[0]
            for m in steps
            for key in m
            if key.startswith("group/") and key.endswith("/one_route")
        }
    )
    lines += ["", "| group | steps drawn | flat rewards | one route |", "|---|---:|---:|---:|"]
    for group in groups:
        drawn = [m for m in steps if f"{group}/flat" in m]
        lines.append(
            f"| {group.removeprefix('group/')} | {len(drawn)} | "
            f"{_mean([m[f'{group}/flat'] for m in drawn])} | "
            f"{_mean([m[f'{group}/one_route'] for m in drawn])} |"
        )
    shares = sorted({key for m in steps for key in m if key.startswith("signal/advantage_share/")})
    lines += [
        "",
        "## The batch's mix: each preference's share of the trained advantage mass",
        "",
        "| preference | mean share | first eighth | last eighth |",
        "|---|---:|---:|---:|",
    ]
    for key in shares:
        lines.append(
            f"| {key.rsplit('/', 1)[1]} | {_mean([m.get(key, 0.0) for m in steps])} | "
            f"{_mean([m.get(key, 0.0) for m in steps[:eighth]])} | "
            f"{_mean([m.get(key, 0.0) for m in steps[-eighth:]])} |"
        )
    return lines


def _top(shares: dict[str, float]) -> str:
    route, share = max(shares.items(), key=lambda item: item[1])
    return f"`{route}` {share:.0%}"


def accuracy_loss(report: dict[str, Any], policy: str) -> list[str]:
    sft, trained, oracle = report["sft"], report[policy], report["oracle"]
    lines = [
        "## Where the accuracy went (held-out tasks, greedy)",
        "",
        f"| group | tasks | accuracy sft -> {policy} | reward sft -> {policy} (oracle) | "
        f"top route sft -> {policy} (oracle) |",
        "|---|---:|---|---|---|",
    ]
    rows = sorted(
        oracle["groups"],
        key=lambda group: trained["groups"][group]["accuracy"] - sft["groups"][group]["accuracy"],
    )
    for group in rows:
        before, after = sft["groups"][group], trained["groups"][group]
        lines.append(
            f"| {group} | {before['tasks']} | {before['accuracy']:.2f} -> "
            f"{after['accuracy']:.2f} | {before['reward']:.2f} -> "
            f"{after['reward']:.2f} ({oracle['groups'][group]['reward']:.2f}) | "
            f"{_top(sft['tool_mix'][group])} -> {_top(trained['tool_mix'][group])} "
            f"({_top(oracle['tool_mix'][group])}) |"
        )
    return lines


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=60)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--policy", default="grpo", help="the RL stage: grpo | ppo | dpo")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    config = config_lib.load(args.overrides)
    run_dir = config.run.dir
    report = json.loads((run_dir / "report.json").read_text())
    metrics = [
        json.loads(line)
        for line in (run_dir / args.policy / "metrics.jsonl").read_text().splitlines()
        if line
    ]
    config = dataclasses.replace(
        config, tokenizer=dataclasses.replace(config.tokenizer, path=str(config.tokenizer_dir))
    )
    lines = [
        f"# Diagnosis of {run_dir}",
        "",
        *conditioning(config, ["sft", args.policy], args.tasks, args.samples),
        "",
        *signal(metrics),
        "",
        *accuracy_loss(report, args.policy),
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
