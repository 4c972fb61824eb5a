"""``nemo-orch``: the command line. Every subcommand takes Hydra-style ``key=value`` overrides
and ``--print-config``; user mistakes exit non-zero with one line naming the key or file."""

# (The docstring above is the top-level help's description.) Each command group's module holds
# its parsers beside its handlers; this one builds the parser and runs a command: its config
# loaded, user errors turned into one line and EXIT_USER_ERROR.

from __future__ import annotations

import argparse
import logging
import sys
import warnings

from nemo_orch import config as config_lib
from nemo_orch.cli import data, launch, model, rollout, serve, tools, train
from nemo_orch.cli import eval as evaluate  # the module, not the builtin
from nemo_orch.cli.common import EXIT_USER_ERROR, CommandParser, is_rank_zero, user_errors
from nemo_orch.clients import call_store
from nemo_orch.train import preemption

__all__ = ["EXIT_USER_ERROR", "build_parser", "main", "parse_args"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nemo-orch", description=__doc__.replace("``", ""))
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    # In the order `nemo-orch --help` lists them.
    train.add_commands(commands)
    model.add_commands(commands)
    tools.add_commands(commands)
    rollout.add_commands(commands)
    evaluate.add_commands(commands)
    serve.add_commands(commands)
    data.add_synth_command(commands)
    launch.add_commands(commands)
    data.add_index_commands(commands)
    return parser


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
    args = parse_args(argv)
    if hasattr(args, "run_without_config"):  # eval compare: nothing to load or set up
        return args.run_without_config(args)
    if args.command in train.TRAINING_COMMANDS:
        preemption.listen()  # before any thread starts: all inherit the block
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _quiet_dependencies()
    try:
        config = args.load_config(args)
        if args.print_config:
            print(config_lib.to_yaml(config), end="")
            return 0
        launched = train.launch_workers(config) if args.command in train.TRAINING_COMMANDS else None
        if launched is not None:
            return launched
        with call_store.recording(config.calls):
            return args.handler(config, args)
    except user_errors() as error:
        print(f"nemo-orch {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except preemption.StopRequested as stopped:
        if is_rank_zero():
            print(f"nemo-orch {args.command}: {stopped}", file=sys.stderr)
        return preemption.REQUEUE_EXIT_CODE
