"""``eval``: agents side by side on a benchmark; ``eval compare RUN...``: several evaluations'
reports side by side (no config: the reports hold all it reads)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nemo_orch import config as config_lib
from nemo_orch.cli.common import EXIT_USER_ERROR, Commands, add_command
from nemo_orch.clients import call_store
from nemo_orch.config import AGENT_KINDS, BENCHMARKS, ORCHESTRATOR, Config


def cmd_eval(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.eval import harness

    tokenizer = None
    if ORCHESTRATOR not in args.agent:
        # Rule agents write no policy tokens, but their prompts are rendered with the run's
        # tokenizer: trained here when there is none yet, the one `nemo-orch train` trains and
        # keeps, so baselines run on a fresh clone and count as they will after training.
        from nemo_orch.train.sft import prepare_tokenizer

        tokenizer = prepare_tokenizer(config)
    summary = harness.run(config, args.agent, tokenizer)
    print(
        f"eval: {summary.benchmark}, {len(summary.systems)} systems in "
        f"{summary.seconds:.1f} s -> {summary.report.parent}"
    )
    print(
        f"  {'system':16} {'tasks':>6} {'accuracy':>9} {'95% CI':>13} {'usd/task':>10} "
        f"{'s/task':>7} {'calls':>6} {'failed':>6} {'infra':>5} {'judge.err':>9}"
    )

    def figure(value: float | None, width: int, digits: int) -> str:
        return f"{'n/a':>{width}}" if value is None else f"{value:{width}.{digits}f}"

    for name, row in summary.systems.items():
        low, high = row["accuracy_ci95"]
        print(
            f"  {name:16} {row['tasks']:6d} {figure(row['accuracy'], 9, 3)} "
            f"{low:6.3f}-{high:<6.3f} {figure(row['usd_per_task'], 10, 6)} "
            f"{figure(row['seconds_per_task'], 7, 2)} {figure(row['calls_per_task'], 6, 2)} "
            f"{row['failed_calls_per_task']:6.2f} {row['infra_decided']:5d} "
            f"{row['judge_errors']:9d}"
        )
    recording = call_store.active()
    if recording is not None:  # --record, --replay (calls.*)
        print(
            f"  call store {config.calls.store} ({config.calls.mode}): "
            f"{recording.replayed} calls answered from it (billed at their recorded cost, "
            f"$0 spent on them now), {recording.recorded} recorded, "
            f"{recording.missed} not in it"
        )
    for name, counts in summary.journaled.items():
        if counts["replayed"]:  # a resumed evaluation
            print(
                f"  {name}: {counts['replayed']} turns and calls of unfinished episodes "
                f"answered from its journal, {counts['missed']} made"
            )
    decided = sum(row["infra_decided"] for row in summary.systems.values())
    if decided:
        print(
            f"  {decided} episodes decided by infrastructure failures, left out of accuracy "
            f"and listed in {summary.report.parent / 'report.md'}; run the same command "
            "again to run them again"
        )
    unscored = [name for name, row in summary.systems.items() if not row["scored"]]
    if unscored:  # a report of nothing: no script may take it for a result
        print(
            f"nemo-orch eval: error: no episode of {', '.join(unscored)} was scored: "
            "infrastructure failures decided every one (see the report); run the same "
            "command again once the endpoints are back",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    return 0


def cmd_eval_compare(args: argparse.Namespace) -> int:
    """``nemo-orch eval compare RUN...``: the systems of several evaluations side by side."""
    from nemo_orch.eval.report import compare

    try:
        print(compare(args.runs), end="")
    except ValueError as error:
        print(f"nemo-orch eval compare: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def _compare_parser() -> argparse.ArgumentParser:
    """A parser of its own (not a subparser of ``eval``, whose usage would then show it): it
    takes run directories only, no overrides or ``--print-config``."""
    parser = argparse.ArgumentParser(
        prog="nemo-orch eval compare",
        description="put the systems of several evaluations "
        "(their eval.out_dir) side by side, with the Pareto front "
        "over all of them",
    )
    parser.add_argument("runs", nargs="+", help="evaluation directories (holding report.json)")
    parser.set_defaults(run_without_config=cmd_eval_compare)
    return parser


def cmd_eval_extract(args: argparse.Namespace) -> int:
    """``nemo-orch eval extract STORE EPISODE OUT``: one episode's calls out of a call store or
    journal, into a store of their own (what a bug report ships)."""
    if not Path(args.store).is_file():
        print(f"nemo-orch eval extract: error: no call store {args.store}", file=sys.stderr)
        return EXIT_USER_ERROR
    copied = call_store.CallStore(args.store).copy_episode(
        args.episode, call_store.CallStore(args.out)
    )
    if not copied:
        print(
            f"nemo-orch eval extract: error: {args.store} holds no call of episode "
            f"{args.episode} (an episode id is <task>#<trial>, as episodes/<agent>.jsonl "
            "names its task_id and trial)",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    print(f"{copied} calls of episode {args.episode} -> {args.out}")
    return 0


def _extract_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nemo-orch eval extract",
        description="copy one episode's calls out of a call store (--record STORE) or an "
        "evaluation's journal (episodes/<agent>.db) into a store of their own: replayed "
        "with --replay OUT, that episode runs as it did",
    )
    parser.add_argument("store", help="the call store or journal")
    parser.add_argument("episode", help="the episode: <task_id>#<trial>, e.g. eval-0003#0")
    parser.add_argument("out", help="the store to write (made where missing)")
    parser.set_defaults(run_without_config=cmd_eval_extract)
    return parser


def _benchmark_config(args: argparse.Namespace) -> Config:
    """The benchmark is the environment preset; the overrides refine it. ``--record`` and
    ``--replay`` name the call store (``calls.*``)."""
    stored = []
    if args.record or args.replay:
        mode = "record" if args.record else "replay"
        stored = [f"calls.mode={mode}", f"calls.store={args.record or args.replay}"]
    return config_lib.load([f"env={args.benchmark}", *stored, *args.overrides])


def add_commands(commands: Commands) -> None:
    """``eval``, whose first word ``compare`` hands the rest to ``eval compare``."""
    evaluate = add_command(
        commands,
        "eval",
        cmd_eval,
        "run agents on a benchmark, side by side: accuracy (95%% CI), "
        "USD and seconds per task, tool mix; report.json, report.md and plots under "
        "eval.out_dir (resumable). `nemo-orch eval compare RUN...` puts several "
        "evaluations side by side; `nemo-orch eval extract STORE EPISODE OUT` copies one "
        "episode's calls out of a call store",
        load_config=_benchmark_config,
    )
    evaluate.add_argument(
        "--benchmark",
        required=True,
        choices=BENCHMARKS,
        help="the environment preset (nemo_orch/conf/env/NAME.yaml): short for env=NAME",
    )
    evaluate.add_argument(
        "--agent",
        required=True,
        action="append",
        choices=AGENT_KINDS,
        help="repeat to compare several: orchestrator (rollout.*: a checkpoint "
        "or an endpoint), monolith (eval.monolith.*), fixed:cheapest, "
        "fixed:strongest, random (the expert tool's models), gold-replay "
        "(toolscale, tau2)",
    )
    stores = evaluate.add_mutually_exclusive_group()
    stores.add_argument(
        "--record",
        metavar="STORE",
        help="keep every call outside the policy (experts, judges, users, search) in the call "
        "store STORE (calls.mode=record calls.store=STORE)",
    )
    stores.add_argument(
        "--replay",
        metavar="STORE",
        help="answer every call outside the policy from the call store STORE, no network; a "
        "call it does not hold fails as an infrastructure error (calls.mode=replay)",
    )
    evaluate.word_parsers["compare"] = _compare_parser()
    evaluate.word_parsers["extract"] = _extract_parser()
