"""Training-step throughput and MFU of the Megatron-Core Qwen3 policy on one GPU, bf16 and FP8.

What it measures: full training steps (forward, backward, gradient clipping, distributed-optimizer
step) of ``nemo_orch.train.policy.Policy`` -- the project's own model builder
(``nemo_orch.models.qwen3.build_model``), DDP wrapper and Megatron optimizer, as GRPO and SFT
use them -- on a model of ``--model`` (default ``qwen3-0.6b``: its ``conf/model/`` preset), one
micro-batch of ``--batch-size`` random sequences of ``--seq-length`` tokens per step, for each of
these precisions:

* ``bf16``: bfloat16 weights and compute; the Transformer Engine layer spec when TE is installed,
  Megatron's local spec otherwise (the table says which);
* ``fp8-<recipe>`` for each ``--fp8-recipes`` entry (default ``delayed`` and ``tensorwise``), when
  TE is installed: ``model.fp8=hybrid`` with that scaling recipe (``--fp8-param`` adds FP8 weights).

Weights come from Megatron's own initialization (their values do not matter for speed). After
``--warmup`` untimed steps, ``--steps`` steps are timed, each ending in a device synchronization.

Memory, to check ``nemo-orch plan``'s estimator (``nemo_orch.launcher.memory``) against a real
run: "resident" is ``torch.cuda.memory_allocated`` after the first step (weights, gradient
buffers, optimizer states), "activations" the peak of the later steps above it
(``max_memory_allocated`` minus resident), each beside the estimator's figure for the same model
and batch in parentheses. The ``bf16-selective-recompute`` and ``bf16-full-recompute`` rows
repeat the bf16 one with that ``model.recompute_granularity``.

How to read the table: "tokens/s" is batch * seq_length / median step time. "MFU" is
6 * N * tokens/s / peak, with N the model's parameter count (embeddings included; the attention
score FLOPs, which grow with the sequence, are not counted) and **peak the bf16 matmul rate this
script measures itself** on the same GPU (a ``--matmul-size`` square ``torch.matmul``), not a
datasheet number. FP8 rows use the same bf16 peak, so an FP8 MFU reads as "fraction of what bf16
matmuls could do": FP8 GEMMs run at up to twice that rate.

Run on a CUDA machine: ``python benchmarks/gpu_train_step.py [--steps 5 --warmup 2
--batch-size 8 --seq-length 2048 --json results.json]``. Without a CUDA GPU it exits with code 2.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import torch

EXIT_NO_GPU = 2


@dataclass
class Row:
    """One precision's result (``error`` set when it could not run)."""

    precision: str
    layer_spec: str
    tokens_per_step: int
    median_step_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    peak_memory_gib: float | None = None
    resident_gib: float | None = None
    activation_peak_gib: float | None = None
    plan_resident_gib: float | None = None
    plan_activation_gib: float | None = None
    error: str | None = None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Training-step tokens/s and MFU of the Megatron-Core Qwen3 policy on one "
        "CUDA GPU, in bf16 and (with Transformer Engine) FP8. MFU's peak is the bf16 matmul "
        "rate measured on the same GPU. Exits 2 without a CUDA GPU."
    )
    parser.add_argument("--model", default="qwen3-0.6b", help="a conf/model preset")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    parser.add_argument(
        "--fp8-recipes",
        nargs="*",
        default=["delayed", "tensorwise"],
        help="FP8 recipes to run when Transformer Engine is installed (none: bf16 only)",
    )
    parser.add_argument(
        "--fp8-param",
        action="store_true",
        help="FP8 rows also keep the weights in FP8 (model.fp8_param)",
    )
    parser.add_argument(
        "--matmul-size",
        type=int,
        default=8192,
        help="n of the n x n bf16 matmul that measures the peak",
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1 or args.batch_size < 1 or args.seq_length < 16:
        # The first (warm-up) step creates the optimizer states: memory is resident after it.
        parser.error("--steps >= 1, --warmup >= 1, --batch-size >= 1, --seq-length >= 16")
    return args


def measure_bf16_matmul_flops(n: int, iterations: int = 50) -> float:
    """FLOP/s of an n x n x n bf16 matmul on the current GPU (2 n^3 FLOPs each)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        torch.matmul(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        torch.matmul(a, b)
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * iterations / (start.elapsed_time(end) / 1000)


def load_config(args: argparse.Namespace, overrides: list[str]):
    from nemo_orch import config as config_lib

    return config_lib.load(
        [
            f"model={args.model}",
            f"trainer.micro_batch_size={args.batch_size}",
            f"trainer.global_batch_size={args.batch_size}",
            f"data.seq_length={args.seq_length}",
            "trainer.optim.warmup_steps=0",
            *overrides,
        ]
    )


def make_batch(vocab_size: int, batch_size: int, seq_length: int) -> dict[str, torch.Tensor]:
    """Random next-token data, every label in the loss, in ``data.sft.collate``'s layout."""
    generator = torch.Generator().manual_seed(0)
    sequence = torch.randint(0, vocab_size, (batch_size, seq_length + 1), generator=generator)
    batch = {
        "tokens": sequence[:, :-1],
        "labels": sequence[:, 1:],
        "loss_mask": torch.ones(batch_size, seq_length),
        "position_ids": torch.arange(seq_length).repeat(batch_size, 1),
    }
    return {key: value.contiguous().cuda() for key, value in batch.items()}


def measure(args: argparse.Namespace, precision: str, overrides: list[str], peak: float) -> Row:
    from nemo_orch import distributed
    from nemo_orch.launcher import memory
    from nemo_orch.train.policy import Policy

    config = load_config(args, overrides)
    tokens = args.batch_size * args.seq_length
    row = Row(precision, config.model.transformer_impl, tokens)
    gc.collect()  # what an earlier row left
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        with distributed.parallel_session(config.parallel, config.run.seed) as context:
            policy = Policy(config, context)
            batch = make_batch(config.model.vocab_size, args.batch_size, args.seq_length)
            times, losses = [], []
            for index in range(args.warmup + args.steps):
                torch.cuda.synchronize()
                started = time.perf_counter()
                losses.append(policy.train_step([batch]).loss)
                torch.cuda.synchronize()
                if index >= args.warmup:
                    times.append(time.perf_counter() - started)
                if index == 0:
                    resident = torch.cuda.memory_allocated() - before
                    row.peak_memory_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
                    torch.cuda.reset_peak_memory_stats()
            del policy
    except Exception as error:  # one precision failing (e.g. a TE too old for a recipe) is data
        traceback.print_exc()
        row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        return row
    finally:
        torch.cuda.empty_cache()
    row.median_step_s = statistics.median(times)
    row.tokens_per_s = tokens / row.median_step_s
    row.mfu = 6 * config.model.num_parameters() * row.tokens_per_s / peak
    row.first_loss, row.last_loss = losses[0], losses[-1]
    later_peak = torch.cuda.max_memory_allocated() - before
    row.peak_memory_gib = max(row.peak_memory_gib, later_peak / 2**30)
    row.resident_gib = resident / 2**30
    row.activation_peak_gib = (later_peak - resident) / 2**30
    estimate = memory.training_estimate(
        config.model, config.parallel, args.seq_length, args.batch_size, num_microbatches=1
    )
    row.plan_resident_gib = estimate.resident / 2**30
    row.plan_activation_gib = estimate.activations / 2**30
    return row


def runs(args: argparse.Namespace, have_te: bool) -> list[tuple[str, list[str]]]:
    """(precision label, config overrides) for each row."""
    impl = "transformer_engine" if have_te else "local"
    bf16 = [f"model.transformer_impl={impl}", "model.params_dtype=bfloat16"]
    plan = [
        ("bf16", bf16),
        ("bf16-selective-recompute", [*bf16, "model.recompute_granularity=selective"]),
        ("bf16-full-recompute", [*bf16, "model.recompute_granularity=full"]),
    ]
    if have_te:
        for recipe in args.fp8_recipes:
            plan.append(
                (
                    f"fp8-{recipe}",
                    [
                        "model.transformer_impl=transformer_engine",
                        "model.params_dtype=bfloat16",
                        "model.fp8=hybrid",
                        f"model.fp8_recipe={recipe}",
                        f"model.fp8_param={str(args.fp8_param).lower()}",
                    ],
                )
            )
    return plan


def print_report(
    args: argparse.Namespace, rows: list[Row], peak: float, parameters: int, have_te: bool
) -> None:
    print(
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; Transformer Engine "
        f"{'installed' if have_te else 'NOT installed (bf16 with the local spec only)'}"
    )
    print(
        f"model {args.model}: {parameters / 1e6:.0f}M parameters; batch {args.batch_size} x "
        f"seq {args.seq_length}; {args.warmup} warm-up + {args.steps} timed steps"
    )
    print(
        f"MFU peak = measured bf16 matmul rate ({args.matmul_size}^3): {peak / 1e12:.0f} "
        "TFLOP/s; MFU = 6 * N * tokens/s / peak\n"
    )
    print(
        "| precision | layer spec | median step (s) | tokens/s | MFU | loss first -> last "
        "| peak mem (GiB) | resident GiB (plan) | activations GiB (plan) |"
    )
    print("|---|---|---:|---:|---:|---|---:|---:|---:|")
    for row in rows:
        if row.error:
            print(f"| {row.precision} | {row.layer_spec} | failed: {row.error} | | | | | | |")
            continue
        print(
            f"| {row.precision} | {row.layer_spec} | {row.median_step_s:.3f} | "
            f"{row.tokens_per_s:,.0f} | {row.mfu:.1%} | {row.first_loss:.3f} -> "
            f"{row.last_loss:.3f} | {row.peak_memory_gib:.1f} | {row.resident_gib:.1f} "
            f"({row.plan_resident_gib:.1f}) | {row.activation_peak_gib:.1f} "
            f"({row.plan_activation_gib:.1f}) |"
        )


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_train_step.py needs a CUDA GPU (none is visible); benchmarks/train_step.py "
            "measures the CPU path",
            file=sys.stderr,
        )
        return EXIT_NO_GPU
    have_te = importlib.util.find_spec("transformer_engine") is not None
    peak = measure_bf16_matmul_flops(args.matmul_size)
    rows = [
        measure(args, precision, overrides, peak) for precision, overrides in runs(args, have_te)
    ]
    parameters = load_config(args, []).model.num_parameters()
    print_report(args, rows, peak, parameters, have_te)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "benchmark": "gpu_train_step",
                    "model": args.model,
                    "peak_bf16_flops": peak,
                    "parameters": parameters,
                    "rows": [asdict(row) for row in rows],
                },
                out,
                indent=2,
            )
    return 1 if any(row.error for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
