"""``nemo-orch``: the command line. Every subcommand takes Hydra-style ``key=value`` overrides
and ``--print-config``; user mistakes exit non-zero with one line naming the key or file."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Callable

from nemo_orch import config as config_lib
from nemo_orch.config import Config

EXIT_USER_ERROR = 2


def _user_errors() -> tuple[type[BaseException], ...]:
    from nemo_orch.data.conversations import DataError
    from nemo_orch.models.checkpoint import CheckpointError
    from nemo_orch.models.tokenizer import TokenizerError

    return (config_lib.ConfigError, CheckpointError, DataError, TokenizerError, FileNotFoundError)


def _launch_workers(config: Config) -> int | None:
    """Re-run this command under torchrun on this machine when the layout needs several
    processes and none were launched; returns the exit code, or None to run in-process."""
    world = config.parallel.world_size
    if world == 1 or "RANK" in os.environ:
        return None
    from nemo_orch.distributed import free_port

    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
               "--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               "-m", "nemo_orch.cli", *sys.argv[1:]]
    return subprocess.call(command)


def _summarize_sft(summary, job: str) -> None:
    if summary.start_step >= summary.end_step:
        print(f"{job}: already complete at step {summary.end_step} ({summary.run_dir})")
        return
    print(f"{job}: supervised fine-tuning of the policy, steps {summary.start_step + 1}-"
          f"{summary.end_step} on {summary.num_samples} conversations "
          f"({summary.num_dropped} longer than data.seq_length dropped)")
    print(f"  loss {summary.first_loss:.4f} -> {summary.last_loss:.4f}, "
          f"{summary.mean_tokens_per_s or 0:.0f} tokens/s")
    print(f"  checkpoint {summary.checkpoint}")
    print(f"  metrics    {summary.run_dir / 'metrics.jsonl'} (TensorBoard: "
          f"{summary.run_dir / 'tensorboard'})")


def cmd_sft(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.train import sft

    summary = sft.run(config)
    if "RANK" not in os.environ or os.environ["RANK"] == "0":
        if args.command == "train":
            print("train: the main job runs its supervised stage (the GRPO stage is not built "
                  "yet)")
        _summarize_sft(summary, args.command)
    return 0


def cmd_export(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.models import convert

    out = convert.export(args.checkpoint, args.format, args.out, tp=args.tp, dtype=args.dtype,
                         overrides=args.overrides)
    print(f"export: wrote a {args.format} checkpoint to {out}")
    return 0


def cmd_import(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.models import convert

    out = convert.import_hf(args.hf_dir, args.out, overrides=args.overrides)
    print(f"import: wrote a model-only checkpoint to {out}; train from it with "
          f"trainer.init_from={out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nemo-orch", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    def add(name: str, handler: Callable[[Config, argparse.Namespace], int],
            help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("overrides", nargs="*", help="config overrides: key=value, group=option")
        sub.add_argument("--print-config", action="store_true",
                         help="print the resolved config as YAML and exit")
        sub.set_defaults(handler=handler)
        return sub

    add("train", cmd_sft, "the main job (today: its SFT stage on the configured data)")
    add("sft", cmd_sft, "supervised fine-tuning on chat conversations (assistant-token loss)")
    export = add("export", cmd_export, "write an HF or TensorRT-LLM checkpoint from a checkpoint")
    export.add_argument("--format", required=True, choices=["hf", "trtllm"])
    export.add_argument("--checkpoint", required=True,
                        help="a step_<N> directory, or a checkpoints/ directory (latest step)")
    export.add_argument("--out", required=True)
    export.add_argument("--tp", type=int, default=1, help="TensorRT-LLM tensor-parallel ranks")
    export.add_argument("--dtype", default=None, help="float32|bfloat16|float16 (default: model's)")
    imp = add("import", cmd_import, "make a starting checkpoint from an HF Qwen3 directory")
    imp.add_argument("--format", required=True, choices=["hf"])
    imp.add_argument("--hf-dir", required=True)
    imp.add_argument("--out", required=True)
    return parser


def _config_for(args: argparse.Namespace) -> Config:
    if args.command == "export":
        from nemo_orch.models import checkpoint, convert

        return convert.checkpoint_config(checkpoint.open_checkpoint(args.checkpoint),
                                         args.overrides)
    return config_lib.load(args.overrides)


def _quiet_dependencies() -> None:
    """Keep megatron-core's start-up chatter (missing Apex/TE, per-parameter listings) out of
    the user's terminal; real warnings from our own code still show."""
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    # Raised inside megatron-core calls that pass through the CPU compatibility layer.
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf")
    warnings.filterwarnings("ignore", message=r"Please use DTensor instead")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _quiet_dependencies()
    try:
        config = _config_for(args)
        if args.print_config:
            print(config_lib.to_yaml(config), end="")
            return 0
        launched = _launch_workers(config) if args.command in ("train", "sft") else None
        if launched is not None:
            return launched
        return args.handler(config, args)
    except _user_errors() as error:
        print(f"nemo-orch {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
