"""The data commands: ``synth`` (ToolScale domains and tasks) and ``index build|import``
(retrieval indexes)."""

from __future__ import annotations

import argparse
from typing import Any

from nemo_orch.cli.common import Commands, add_command
from nemo_orch.config import Config, hub


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


def add_synth_command(commands: Commands) -> None:
    """``synth``."""
    synthesize = add_command(
        commands,
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


def add_index_commands(commands: Commands) -> None:
    """``index`` with ``build`` and ``import``, which share the encoder's options."""
    index = commands.add_parser("index", help="retrieval indexes")
    index_commands = index.add_subparsers(dest="index_command", required=True)
    build = add_command(
        index_commands,
        "build",
        cmd_index_build,
        "build a dense (FAISS) + BM25 index from a JSONL corpus",
    )
    build.add_argument("--corpus", required=True, help='JSONL: {"id": ..., "text": ...}')
    imported = add_command(
        index_commands,
        "import",
        cmd_index_import,
        "an existing FAISS index (inner product; row i "
        "embeds line i of its JSONL corpus) as an index of ours: dimension and count "
        "checked, dense-only unless --bm25",
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
