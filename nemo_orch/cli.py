"""``nemo-orch``: the command line. Every subcommand takes Hydra-style ``key=value`` overrides
and ``--print-config``; user mistakes exit non-zero with one line naming the key or file."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_orch import config as config_lib
from nemo_orch.config import ORCHESTRATOR, Config, hub
from nemo_orch.train import preemption

EXIT_USER_ERROR = 2
TRAINING_COMMANDS = ("train", "sft", "grpo", "dpo")


def _user_errors() -> tuple[type[BaseException], ...]:
    from nemo_orch.call_kinds import InfrastructureError
    from nemo_orch.clients.http import HTTPError
    from nemo_orch.data.conversations import DataError
    from nemo_orch.models.checkpoint import CheckpointError
    from nemo_orch.models.tokenizer import TokenizerError
    from nemo_orch.rollout.engines.base import EngineError
    from nemo_orch.tools.base import ToolError

    return (
        config_lib.ConfigError,
        CheckpointError,
        DataError,
        TokenizerError,
        ToolError,
        EngineError,
        HTTPError,
        InfrastructureError,
        FileNotFoundError,
    )


def _launch_workers(config: Config) -> int | None:
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


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def cmd_sft(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.train import sft

    summary = sft.run(config)
    if _is_rank_zero():
        _summarize_sft(summary, args.command)
    return 0


def cmd_train(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.train import main_job

    summary = main_job.run(config)
    if _is_rank_zero():
        print("\n".join(main_job.summary_lines(summary)))
    return 0


def cmd_grpo(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.train import grpo, main_job

    stage = main_job.stage(grpo.start_model(config), f"grpo-{config.env.label}")
    summary = grpo.run(stage)
    if _is_rank_zero():
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
    if _is_rank_zero():
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


def cmd_export(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.models import convert, trtllm

    if args.format != "hf" and args.max_shard_size is not None:
        raise config_lib.ConfigError("--max-shard-size applies to --format hf only")
    if args.format != "trtllm-engine":
        if args.max_batch_size is not None or args.max_seq_len is not None:
            raise config_lib.ConfigError(
                "--max-batch-size and --max-seq-len apply to --format trtllm-engine only"
            )
        out = convert.export(
            args.checkpoint,
            args.format,
            args.out,
            tp=args.tp,
            dtype=args.dtype,
            overrides=args.overrides,
            max_shard_size=args.max_shard_size or convert.DEFAULT_MAX_SHARD_SIZE,
        )
        print(f"export: wrote a {args.format} checkpoint to {out}")
        return 0
    try:
        built = convert.export_engine(
            args.checkpoint,
            args.out,
            tp=args.tp,
            dtype=args.dtype,
            max_batch_size=args.max_batch_size or convert.DEFAULT_ENGINE_MAX_BATCH_SIZE,
            max_seq_len=args.max_seq_len,
            overrides=args.overrides,
        )
    except trtllm.EngineBuildError as error:
        print(f"nemo-orch export: error: {error}", file=sys.stderr)
        return 1
    print(
        f"export: wrote a TensorRT-LLM checkpoint to {built.checkpoint_dir} and built its "
        f"engine in {built.engine_dir} ({built.build_seconds:.1f} s)"
    )
    return 0


def cmd_import(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.models import convert

    out = convert.import_hf(args.hf_dir, args.out, overrides=args.overrides)
    print(
        f"import: wrote a model-only checkpoint to {out}; train from it with "
        f"trainer.init_from={out}"
    )
    return 0


def _print_json(value: object) -> None:
    """One line of JSON: readable text, escaped where it holds what UTF-8 cannot carry (a lone
    surrogate a JSON escape in a tool call can produce)."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value)
    print(text)


def cmd_tools_list(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.rollout.builders import offered_schemas

    _print_json(offered_schemas(config.tools))
    return 0


def _call_tool(config: Config, name: str, raw_arguments: str) -> dict:
    from nemo_orch.rollout.builders import build_toolbox
    from nemo_orch.tools.base import ToolResult

    try:
        arguments = json.loads(raw_arguments)
    except json.JSONDecodeError as error:
        return ToolResult(error=f"--args is not JSON: {error}").to_json()
    if not isinstance(arguments, dict):
        return ToolResult(error="--args must be a JSON object").to_json()

    async def call() -> dict:
        toolbox = build_toolbox(config.tools)
        if name not in toolbox.tools:  # no need to start every tool to say so
            return (await toolbox.call(name, arguments)).to_json()
        toolbox = toolbox.subset([name])
        async with toolbox:
            return (await toolbox.call(name, arguments)).to_json()

    return asyncio.run(call())


def cmd_tools_call(config: Config, args: argparse.Namespace) -> int:
    """Exit 0 whenever the tool ran or refused: its failure is in ``error``."""
    _print_json(_call_tool(config, args.name, args.args))
    return 0


def _stdin_text() -> str:
    """Standard input as text, whatever its bytes: invalid UTF-8 reads as U+FFFD."""
    raw = getattr(sys.stdin, "buffer", None)
    return sys.stdin.read() if raw is None else raw.read().decode("utf-8", errors="replace")


def cmd_tools_parse(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.rollout.builders import offered_schemas
    from nemo_orch.rollout.format import TurnFormat, parse_turn

    fmt = TurnFormat.for_tools(
        offered_schemas(config.tools),
        answer_format=config.rollout.answer_format,
        multiple_calls=config.rollout.multiple_calls,
    )
    turn = parse_turn(_stdin_text(), fmt)
    _print_json(
        {
            "calls": [{"name": c.name, "arguments": c.arguments} for c in turn.calls if c.valid],
            "error": turn.error or next((c.error for c in turn.calls if c.error), None),
            "answer": turn.answer,
            "format_errors": turn.format_errors,
            "invalid_calls": [c.to_json() for c in turn.calls if not c.valid],
        }
    )
    return 0


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
    ended = collections.Counter(t.termination for t in trajectories)
    mean_cost = statistics.mean(t.cost_usd for t in trajectories)
    mean_turns = statistics.mean(len(t.turns) for t in trajectories)
    print(
        f"rollout: {len(trajectories)} episodes ({len(tasks)} tasks x {samples}) in "
        f"{seconds:.1f} s -> {out}"
    )
    print(f"  ended by {dict(ended)}; mean cost ${mean_cost:.6f}, mean turns {mean_turns:.1f}")
    return 0


def _serve_until_stopped(start: Callable[[], Any], describe: Callable[[Any], str]) -> int:
    """Start a server (``start()``), print ``describe(server)`` and serve until SIGTERM or
    SIGINT, then close it (waiting at most ``serve.shutdown_timeout_s`` for requests in flight).
    The signals are caught before the server starts, so a stop during start-up still cleans
    up (PyTriton's workspace, sandbox workers)."""
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    with start() as server:
        print(describe(server), flush=True)
        while not stopped.wait(0.5):
            pass
        print("serve: stopping", flush=True)
    return 0


def _metrics_address(server: Any) -> str:
    return (
        ""
        if server.metrics_port is None
        else f"; metrics http://{server.host}:{server.metrics_port}/metrics"
    )


def _triton_banner(kind: str, models: list[str]) -> Callable[[Any], str]:
    return lambda server: (
        f"{kind}: serving {', '.join(models)} at {server.url}/v2/models/<name>/infer (KServe v2; "
        f"gRPC {server.grpc_url}{_metrics_address(server)}); SIGTERM or Ctrl-C stops"
    )


def cmd_serve_reward(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.serve.triton import serve_models
    from nemo_orch.serve.triton_models import reward_model

    model = reward_model(config)
    return _serve_until_stopped(
        lambda: serve_models([model], config.serve), _triton_banner("reward", [model.name])
    )


def cmd_serve_tool(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.serve.triton import serve_models
    from nemo_orch.serve.triton_models import tool_models

    names = [name for name in args.name.split(",") if name]
    models, toolbox = tool_models(config, names)
    return _serve_until_stopped(
        lambda: serve_models(models, config.serve, toolbox), _triton_banner("tool", names)
    )


def cmd_serve_orchestrator(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.serve.orchestrator import start_orchestrator

    return _serve_until_stopped(
        lambda: start_orchestrator(config),
        lambda server: (
            f"orchestrator: serving {config.run.name} at {server.url} (/chat/completions with "
            f"tools, /completions, /orchestrate{_metrics_address(server)}); SIGTERM or Ctrl-C "
            "stops"
        ),
    )


def cmd_serve_mcp(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.serve import mcp

    if config.serve.mcp_transport == "stdio":  # stdout is the protocol's: no banner
        mcp.run_mcp_stdio(config)
        return 0
    return _serve_until_stopped(
        lambda: mcp.start_mcp_http(config),
        lambda server: (
            f"mcp: serving {config.run.name} as the MCP tool solve at {server.url} (streamable "
            f"HTTP{_metrics_address(server)}); SIGTERM or Ctrl-C stops"
        ),
    )


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


def eval_compare(argv: list[str]) -> int:
    """``nemo-orch eval compare RUN...``: the systems of several evaluations side by side."""
    from nemo_orch.eval.report import compare

    parser = argparse.ArgumentParser(
        prog="nemo-orch eval compare",
        description="put the systems of several evaluations "
        "(their eval.out_dir) side by side, with the Pareto front "
        "over all of them",
    )
    parser.add_argument("runs", nargs="+", help="evaluation directories (holding report.json)")
    args = parser.parse_args(argv)
    try:
        print(compare(args.runs), end="")
    except ValueError as error:
        print(f"nemo-orch eval compare: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def cmd_synth(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.envs.toolscale import generator, synth

    if not args.offline:
        print("\n".join(synth.summary_lines(synth.run(config.synth))))
        return 0
    summary = generator.write_offline(config.synth.out_dir, args.tasks_per_domain, args.seed)
    print(f"synth --offline: {len(summary['domains'])} domains -> {summary['out_dir']}")
    for domain in summary["domains"]:
        dropped = domain["validation"]["dropped"]
        print(
            f"  {domain['name']}: {domain['tools']} tools, {domain['tasks']} tasks -> "
            f"{domain['tasks_file']} (drafts dropped: {dropped})"
        )
    return 0


def _encoder_choice(args: argparse.Namespace) -> str | dict[str, Any]:
    """``--encoder`` with ``--preset`` / ``--pooling`` / prefixes (an HF encoder's settings)."""
    encoder = hub.resolve_path(args.encoder, hub.MODEL, "--encoder")
    settings = {
        "preset": args.preset,
        "pooling": args.pooling,
        "query_prefix": args.query_prefix,
        "document_prefix": args.document_prefix,
    }
    if encoder == "hashing" or all(value is None for value in settings.values()):
        return encoder
    return {"model_dir": encoder, **settings}


def cmd_index_build(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.tools.retrieval_index import build_index

    out = build_index(args.corpus, args.out, encoder=_encoder_choice(args))
    print(f"index: built {out} from {args.corpus} (encoder {args.encoder})")
    return 0


def cmd_index_import(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.tools.retrieval_index import import_index, load_index

    out = import_index(args.faiss, args.corpus, args.out, _encoder_choice(args), bm25=args.bm25)
    index = load_index(out, _encoder_choice(args))
    print(
        f"index: imported {args.faiss} ({len(index)} documents of {args.corpus}, "
        f"{index.dense.d} dimensions, {'dense + BM25' if index.has_sparse else 'dense only'}) "
        f"-> {out}"
    )
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nemo-orch", description=__doc__.replace("``", ""))
    commands = parser.add_subparsers(dest="command", required=True)

    def add(
        name: str,
        handler: Callable[[Config, argparse.Namespace], int],
        help_text: str,
        group=commands,
        positionals: tuple[str, ...] = (),
    ) -> argparse.ArgumentParser:
        # help is %-formatted by argparse (hence 95%% in it), the description is not
        sub = group.add_parser(name, help=help_text, description=help_text.replace("%%", "%"))
        for positional in positionals:  # before the overrides, which take the rest
            sub.add_argument(positional)
        sub.add_argument("overrides", nargs="*", help="config overrides: key=value, group=option")
        sub.add_argument(
            "--print-config", action="store_true", help="print the resolved config as YAML and exit"
        )
        sub.set_defaults(handler=handler)
        return sub

    add("train", cmd_train, "the main job: demonstrations, SFT, GRPO, evaluation and report")
    add("sft", cmd_sft, "supervised fine-tuning on chat conversations (assistant-token loss)")
    add(
        "grpo",
        cmd_grpo,
        "GRPO alone on the configured environment (env=NAME: offline, "
        "toolscale, tau2, qa, hle, frames, tasks, or a mixture such as toolscale_qa) from "
        "trainer.init_from (a checkpoint or an HF directory), into <run>/grpo-<env>/ (resumes)",
    )
    add(
        "dpo",
        cmd_dpo,
        "DPO from trainer.init_from against its frozen copy, on the pairs of "
        "dpo.pairs_path or, with none, on pairs of its own rollouts on env=NAME (the best and "
        "worst episode of each task, dpo.min_margin apart), into <run>/dpo/ (resumes)",
    )
    export = add(
        "export",
        cmd_export,
        "write an HF or TensorRT-LLM checkpoint from a checkpoint,"
        " or (trtllm-engine, on a GPU) a TensorRT-LLM checkpoint in OUT/checkpoint and "
        "its engine, built with trtllm-build, in OUT/engine",
    )
    export.add_argument("--format", required=True, choices=["hf", "trtllm", "trtllm-engine"])
    export.add_argument(
        "--checkpoint",
        required=True,
        help="a step_<N> directory, or a checkpoints/ directory (latest step)",
    )
    export.add_argument("--out", required=True)
    export.add_argument("--tp", type=int, default=1, help="TensorRT-LLM tensor-parallel ranks")
    export.add_argument("--dtype", default=None, help="float32|bfloat16|float16 (default: model's)")
    export.add_argument(
        "--max-shard-size",
        default=None,
        help="hf: the largest safetensors file (5GB, 500MiB or bytes); a larger "
        "model is written in shards with model.safetensors.index.json "
        "(default 5GB)",
    )
    export.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="trtllm-engine: the most requests the engine schedules at once (default 256)",
    )
    export.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="trtllm-engine: prompt + generated tokens of one request (default: "
        "the model's max_position_embeddings)",
    )
    imp = add("import", cmd_import, "make a starting checkpoint from an HF Qwen3 directory")
    imp.add_argument("--format", required=True, choices=["hf"])
    imp.add_argument("--hf-dir", required=True)
    imp.add_argument("--out", required=True)

    tools = commands.add_parser("tools", help="list, call and parse tools")
    tool_commands = tools.add_subparsers(dest="tools_command", required=True)
    add("list", cmd_tools_list, "print the configured tools' schemas as a JSON list", tool_commands)
    call = add(
        "call",
        cmd_tools_call,
        "call one tool; prints {output, error, cost_usd, latency_s, ...} as JSON",
        tool_commands,
        positionals=("name",),
    )
    call.add_argument("--args", required=True, help="the arguments as a JSON object")
    add(
        "parse",
        cmd_tools_parse,
        "parse assistant text from stdin into tool calls (JSON)",
        tool_commands,
    )
    rollout = add(
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

    from nemo_orch.config import AGENT_KINDS, BENCHMARKS

    evaluate = add(
        "eval",
        cmd_eval,
        "run agents on a benchmark, side by side: accuracy (95%% CI), "
        "USD and seconds per task, tool mix; report.json, report.md and plots under "
        "eval.out_dir (resumable). `nemo-orch eval compare RUN...` puts several "
        "evaluations side by side",
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

    serve = commands.add_parser(
        "serve",
        help="serve the reward, tools or the orchestrator "
        "(OpenAI-compatible or MCP) (serve.*: host, ports, batching, "
        "metrics)",
    )
    serve_commands = serve.add_subparsers(dest="serve_command", required=True)
    add(
        "reward",
        cmd_serve_reward,
        "PyTriton: outcome scoring and the judge (reward.*) as the "
        "Triton model 'reward'; training, rollout and eval use it with reward.endpoint=URL",
        serve_commands,
    )
    add(
        "tool",
        cmd_serve_tool,
        "PyTriton: configured tools as Triton models named after them "
        "(e.g. retriever, sandbox); declarations elsewhere reach them with endpoint: URL",
        serve_commands,
        positionals=("name",),
    )
    add(
        "orchestrator",
        cmd_serve_orchestrator,
        "OpenAI-compatible /v1/chat/completions (with "
        "function calling) and /v1/orchestrate (a question in, the answer and its ledger out) "
        "for the policy of rollout.policy=CHECKPOINT|HF_DIR (null: the run's latest "
        "checkpoint), on serve.host:serve.http_port (127.0.0.1:8000), e.g. `nemo-orch serve "
        "orchestrator rollout.policy=runs/latest/grpo/checkpoints serve.http_port=8080`",
        serve_commands,
    )
    add(
        "mcp",
        cmd_serve_mcp,
        "the orchestrator of rollout.policy=CHECKPOINT|HF_DIR as an MCP "
        "server with one tool, solve(question, preference?), answering with the answer, its "
        "cost and calls (the loop of /v1/orchestrate), over serve.mcp_transport=stdio (the "
        "client starts the process) or http (streamable HTTP at /mcp on serve.http_port), e.g. "
        "`nemo-orch serve mcp rollout.policy=runs/latest/grpo/checkpoints "
        "serve.mcp_transport=http`",
        serve_commands,
    )

    synthesize = add(
        "synth",
        cmd_synth,
        "synthesize ToolScale domains and tasks with an LLM "
        "(synth.*), or generate them offline (--offline): write <domain>/domain.json,"
        " <domain>/tasks.jsonl and summary.json under synth.out_dir",
    )
    synthesize.add_argument(
        "--offline",
        action="store_true",
        help="the seeded generator (3 domains, no LLM) instead of the LLM",
    )
    synthesize.add_argument(
        "--tasks-per-domain", type=int, default=200, help="--offline: tasks per domain"
    )
    synthesize.add_argument("--seed", type=int, default=0, help="--offline: the seed")

    add(
        "plan",
        cmd_plan,
        "check the layout (world size, divisibility, batches, engine TP, FP8 "
        "shapes) and print the per-GPU memory estimate of the SFT and GRPO stages against "
        "launcher.gpu_memory_gib, on CPU; exit 1 if it does not fit. E.g. `nemo-orch plan "
        "recipe=NAME` (recipes: nemo_orch/conf/recipes/)",
    )
    launch = add(
        "launch",
        cmd_launch,
        "run `nemo-orch <launcher.job>` with these overrides "
        "through NeMo-Run: under torchrun on this machine (local), or as a SLURM job "
        "in the pyxis container with the expert servers (launcher.experts) and a Ray "
        "cluster (launcher.ray) in the same job (slurm)",
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

    index = commands.add_parser("index", help="retrieval indexes")
    index_commands = index.add_subparsers(dest="index_command", required=True)
    build = add(
        "build",
        cmd_index_build,
        "build a dense (FAISS) + BM25 index from a JSONL corpus",
        index_commands,
    )
    build.add_argument("--corpus", required=True, help='JSONL: {"id": ..., "text": ...}')
    imported = add(
        "import",
        cmd_index_import,
        "an existing FAISS index (inner product; row i "
        "embeds line i of its JSONL corpus) as an index of ours: dimension and count "
        "checked, dense-only unless --bm25",
        index_commands,
    )
    imported.add_argument("--faiss", required=True, help="the FAISS index file")
    imported.add_argument(
        "--corpus",
        required=True,
        help='its JSONL corpus: {"id": str|int, "text" or "contents": ..., "title"?: ...}',
    )
    imported.add_argument(
        "--bm25", action="store_true", help="also build a BM25 side from the corpus (hybrid search)"
    )
    for command in (build, imported):
        command.add_argument("--out", required=True, help="index directory")
        command.add_argument(
            "--encoder",
            default="hashing",
            required=command is imported,
            help="'hashing' (offline default), a local HF encoder directory "
            "or a Hub id (org/name[@revision]): the encoder the index is (was) "
            "built with",
        )
        command.add_argument(
            "--preset", default=None, help="an HF encoder's settings: qwen3-embedding, e5 or bge"
        )
        command.add_argument(
            "--pooling",
            default=None,
            choices=["mean", "last_token", "cls"],
            help="an HF encoder's pooling over the preset's (default: mean)",
        )
        command.add_argument(
            "--query-prefix", default=None, help="written before each query (over the preset's)"
        )
        command.add_argument(
            "--document-prefix",
            default=None,
            help="written before each document (over the preset's)",
        )
    return parser


def _config_for(args: argparse.Namespace) -> Config:
    if args.command == "export":
        from nemo_orch.models import checkpoint, convert

        return convert.checkpoint_config(
            checkpoint.open_checkpoint(args.checkpoint), args.overrides
        )
    if args.command == "eval":  # the benchmark is the environment preset; overrides refine it
        return config_lib.load([f"env={args.benchmark}", *args.overrides])
    if args.command == "launch" and args.executor is not None:
        return config_lib.load([*args.overrides, f"launcher.executor={args.executor}"])
    return config_lib.load(args.overrides)


def _quiet_dependencies() -> None:
    """Keep megatron-core's start-up chatter (missing Apex/TE, per-parameter listings) and the MCP
    client's reconnection notices out of the user's terminal; real warnings from our own code
    still show."""
    for noisy in ("megatron", "faiss", "bm25s", "httpx", "pytriton", "mcp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    # Raised inside megatron-core calls that pass through the CPU compatibility layer.
    warnings.filterwarnings(
        "ignore", message=r"The \.grad attribute of a Tensor that is not a leaf"
    )
    warnings.filterwarnings("ignore", message=r"Please use DTensor instead")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line; ``key=value`` overrides may also follow the options (``tools call NAME
    --args '{...}' key=value``), where argparse alone would stop at them."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [item for item in extra if "=" in item and not item.startswith("-")]
    if len(overrides) < len(extra) or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["eval", "compare"]:
        return eval_compare(argv[2:])
    args = parse_args(argv)
    if args.command in TRAINING_COMMANDS:
        preemption.listen()  # before any thread starts: all inherit the block
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _quiet_dependencies()
    try:
        config = _config_for(args)
        if args.print_config:
            print(config_lib.to_yaml(config), end="")
            return 0
        launched = _launch_workers(config) if args.command in TRAINING_COMMANDS else None
        if launched is not None:
            return launched
        return args.handler(config, args)
    except _user_errors() as error:
        print(f"nemo-orch {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except preemption.StopRequested as stopped:
        if _is_rank_zero():
            print(f"nemo-orch {args.command}: {stopped}", file=sys.stderr)
        return preemption.REQUEUE_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
