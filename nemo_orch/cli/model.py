"""Checkpoints in and out: ``export`` (HF, TensorRT-LLM, a built engine) and ``import`` (an HF
directory as a starting checkpoint)."""

from __future__ import annotations

import argparse
import sys

from nemo_orch import config as config_lib
from nemo_orch.cli.common import Commands, add_command
from nemo_orch.config import Config


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


def _checkpoint_config(args: argparse.Namespace) -> Config:
    """The config the checkpoint was trained with, refined by the overrides."""
    from nemo_orch.models import checkpoint, convert

    return convert.checkpoint_config(checkpoint.open_checkpoint(args.checkpoint), args.overrides)


def add_commands(commands: Commands) -> None:
    """``export`` and ``import``."""
    export = add_command(
        commands,
        "export",
        cmd_export,
        "write an HF or TensorRT-LLM checkpoint from a checkpoint,"
        " or (trtllm-engine, on a GPU) a TensorRT-LLM checkpoint in OUT/checkpoint and "
        "its engine, built with trtllm-build, in OUT/engine",
        load_config=_checkpoint_config,
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
    imp = add_command(
        commands, "import", cmd_import, "make a starting checkpoint from an HF Qwen3 directory"
    )
    imp.add_argument("--format", required=True, choices=["hf"])
    imp.add_argument("--hf-dir", required=True)
    imp.add_argument("--out", required=True)
