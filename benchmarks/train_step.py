"""Training-step throughput: the Megatron-Core policy vs. transformers' Qwen3 in plain PyTorch.

What it measures: one full training step (forward, backward, gradient clipping, optimizer step)
on the same batch, from the same initial weights, with the same optimizer settings, twice:

* **Megatron-Core**: ``nemo_orch.train.policy.Policy.train_step`` (GPTModel with the local layer
  spec, DDP wrapper, Megatron optimizer and LR scheduler) in a single-process parallel session.
* **transformers**: ``Qwen3ForCausalLM`` built from the same ``ModelConfig``, a masked per-token
  cross entropy (summed, divided by the number of loss tokens: the Megatron objective), and
  ``torch.optim.AdamW`` with ``config.trainer.optim``'s lr, betas and weight decay (not on 1-D
  parameters, as Megatron does), clipping the gradient norm at ``config.trainer.optim.grad_clip``.

Both use a constant learning rate (``config.trainer.optim.lr``: warm-up off, ``min_lr = lr``) so
their losses stay comparable. The batch is ``--batch-size`` random token sequences of
``--seq-length`` from a seeded generator, with a loss mask of about 70% ones, repeated every step.
After ``--warmup`` untimed steps, each of ``--steps`` steps is timed with ``time.perf_counter()``.

How to read the table: "median step time" is per step over the timed steps; "tokens/s" is
batch * seq_length / median step time; the last column is Megatron / transformers, so a ratio
above 1 in the tokens/s row means the Megatron path is faster. The loss rows are the loss each
path computed in its first and last step: they start equal (same weights, same batch) and should
stay in the same range, which shows both paths train the same thing. "parameters" counts each
model's parameters and should match.

Run: ``python benchmarks/train_step.py [--steps 5 --warmup 3 --batch-size 8 --seq-length 512
--threads 2 --model-override num_layers=8 hidden_size=512]``.

**``--grpo-update SFT_CHECKPOINT``**: instead, GRPO's update on the main job's real batches,
with and without prefix sharing (``grpo.prefix_sharing``). The main job's GRPO stage is set up
from its SFT checkpoint (``make train``'s ``runs/tiny-sft/sft/checkpoints``) with its config;
one step's groups (``grpo.prompts_per_step`` x ``rollout.group_size`` episodes of the offline
world, scored and filtered as the stage does) are rolled out from the SFT policy and made into
its samples (``grpo_samples.samples_of``). Then the update (``grpo._update``: old-policy and
reference forwards, the KL guard, the optimizer step) runs on them without and with sharing,
alternating which goes first, the policy's weights restored after each. Reported per way: the
positions trained on (the samples' tokens; padded to the micro-batches), the positions the
forward passes computed, their ratio, and the update's seconds (median, min-max, of ``--steps``
after ``--warmup``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import torch
import torch.nn.functional as F

from nemo_orch import config as config_lib
from nemo_orch import distributed
from nemo_orch.config import Config
from nemo_orch.models import qwen3, weights
from nemo_orch.models.hf_mapping import SeededHFWeights, build_hf_model
from nemo_orch.models.tokenizer import load_tokenizer
from nemo_orch.train import curriculum, grpo
from nemo_orch.train.grpo_loss import grpo_token_loss
from nemo_orch.train.grpo_rollouts import build_rollouts
from nemo_orch.train.grpo_samples import Sample, samples_of
from nemo_orch.train.policy import Policy, ReferenceModel, load_start_weights

Batch = dict[str, torch.Tensor]
LOSS_MASK_FRACTION = 0.7


@dataclass
class Measurement:
    parameters: int
    step_times: list[float]  # seconds, timed steps only
    losses: list[float]  # every step's loss, warm-up included

    @property
    def median_step_time(self) -> float:
        return statistics.median(self.step_times)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for both")
    parser.add_argument(
        "--model-override",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="model.* fields, e.g. num_layers=8 hidden_size=512",
    )
    parser.add_argument(
        "--grpo-update",
        metavar="SFT_CHECKPOINT",
        help="instead: GRPO's update on the main job's batches, with and without prefix sharing",
    )
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def load_config(args: argparse.Namespace) -> Config:
    """The project config at the benchmark's batch shape, with a constant learning rate."""
    config = config_lib.load(
        [
            f"trainer.micro_batch_size={args.batch_size}",
            f"trainer.global_batch_size={args.batch_size}",
            f"data.seq_length={args.seq_length}",
            *(f"model.{override}" for override in args.model_override),
        ]
    )
    optim = dataclasses.replace(
        config.trainer.optim, warmup_steps=0, min_lr=config.trainer.optim.lr
    )
    return config_lib.replace(config, trainer=dataclasses.replace(config.trainer, optim=optim))


def make_batch(config: Config, batch_size: int, seq_length: int) -> Batch:
    """Random next-token data from a seeded generator, in the layout of ``data.sft.collate``."""
    generator = torch.Generator().manual_seed(config.run.seed)
    sequence = torch.randint(
        0, config.model.vocab_size, (batch_size, seq_length + 1), generator=generator
    )
    loss_mask = (
        torch.rand(batch_size, seq_length, generator=generator) < LOSS_MASK_FRACTION
    ).float()
    return {
        "tokens": sequence[:, :-1].contiguous(),
        "labels": sequence[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(seq_length).repeat(batch_size, 1),
    }


def time_steps(
    step: Callable[[], float], warmup: int, steps: int
) -> tuple[list[float], list[float]]:
    """Run ``warmup + steps`` steps; return the timed steps' durations and every step's loss."""
    times, losses = [], []
    for index in range(warmup + steps):
        start = time.perf_counter()
        losses.append(step())
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return times, losses


def count_parameters(model: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def measure_megatron(config: Config, batch: Batch, warmup: int, steps: int) -> Measurement:
    with distributed.parallel_session(config.parallel, config.run.seed) as context:
        policy = Policy(config, context)
        policy.load_hf_weights(SeededHFWeights(config.model, config.run.seed))
        times, losses = time_steps(lambda: policy.train_step([batch]).loss, warmup, steps)
        return Measurement(count_parameters(policy.module), times, losses)


def seeded_hf_model(config: Config) -> torch.nn.Module:
    model = build_hf_model(config.model)
    # A tied lm_head has no entry of its own; it follows the embeddings after tie_weights().
    model.load_state_dict(dict(SeededHFWeights(config.model, config.run.seed)), strict=False)
    model.tie_weights()
    return model.to(qwen3.DTYPES[config.model.params_dtype]).train()


def measure_transformers(config: Config, batch: Batch, warmup: int, steps: int) -> Measurement:
    model = seeded_hf_model(config)
    optim = config.trainer.optim
    decayed = [p for p in model.parameters() if p.ndim > 1]
    not_decayed = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW(
        [
            {"params": decayed, "weight_decay": optim.weight_decay},
            {"params": not_decayed, "weight_decay": 0.0},
        ],
        lr=optim.lr,
        betas=(optim.adam_beta1, optim.adam_beta2),
    )
    mask = batch["loss_mask"]

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits
        token_losses = F.cross_entropy(
            logits.float().flatten(0, 1), batch["labels"].flatten(), reduction="none"
        ).view_as(mask)
        loss = (token_losses * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        optimizer.step()
        return loss.item()

    times, losses = time_steps(step, warmup, steps)
    return Measurement(count_parameters(model), times, losses)


def print_report(
    args: argparse.Namespace, config: Config, megatron: Measurement, hf: Measurement
) -> None:
    tokens = args.batch_size * args.seq_length
    model = config.model
    print(
        f"machine: torch {torch.__version__}, megatron-core {version('megatron-core')}, "
        f"transformers {version('transformers')}, threads {torch.get_num_threads()}, "
        f"CPUs {os.cpu_count()}, {platform.machine()}, CUDA {torch.cuda.is_available()}"
    )
    print(
        f"model: {model.preset}, {model.num_layers} layers, hidden {model.hidden_size}, "
        f"{model.params_dtype}; batch {args.batch_size} x seq {args.seq_length} = {tokens} "
        f"tokens/step; {args.warmup} warm-up + {args.steps} timed steps; "
        f"lr {config.trainer.optim.lr:g} constant\n"
    )
    last = f"loss, step {args.warmup + args.steps}"
    rows = [
        (
            "parameters",
            f"{megatron.parameters:,}",
            f"{hf.parameters:,}",
            f"{megatron.parameters / hf.parameters:.2f}",
        ),
        (
            "median step time (s)",
            f"{megatron.median_step_time:.3f}",
            f"{hf.median_step_time:.3f}",
            f"{megatron.median_step_time / hf.median_step_time:.2f}",
        ),
        (
            "tokens/s",
            f"{tokens / megatron.median_step_time:,.0f}",
            f"{tokens / hf.median_step_time:,.0f}",
            f"{hf.median_step_time / megatron.median_step_time:.2f}",
        ),
        ("loss, step 1", f"{megatron.losses[0]:.4f}", f"{hf.losses[0]:.4f}", ""),
        (last, f"{megatron.losses[-1]:.4f}", f"{hf.losses[-1]:.4f}", ""),
    ]
    print("| metric | Megatron-Core | transformers | Megatron / transformers |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


# ------------------------------------------------------------------ --grpo-update


def grpo_stage_config(sft_checkpoint: str, threads: int) -> Config:
    """The main job's GRPO stage from its SFT checkpoint (the checkpoint's tokenizer and
    architecture), as ``nemo-orch train`` runs it, with its outputs in a temporary directory."""
    config = config_lib.load(
        [
            f"trainer.init_from={sft_checkpoint}",
            f"trainer.num_threads={threads}",
            f"run.output_dir={tempfile.mkdtemp(prefix='train_step-')}",
        ]
    )
    return grpo.policy_config(grpo.start_model(config))


def main_job_samples(config: Config, policy: Policy) -> list[Sample]:
    """One step of the main job's rollouts from ``policy``: its groups, scored and filtered as
    GRPO's first step does, as training samples."""
    tokenizer = load_tokenizer(config.tokenizer_dir)
    hf = weights.gather_hf_weights(policy.module, config.model, config.rollout.refit_bucket_mb)
    config.run.dir.mkdir(parents=True)  # where the rollouts leave their notes
    with build_rollouts(config, tokenizer, hf, []) as rollouts:
        batch = rollouts.step(1, curriculum.stage_tools(config.grpo.curriculum, []))
    return samples_of(batch.kept, config)


@dataclass
class UpdateMeasurement:
    """One way of the update (shared or not): its seconds and what it stepped on and
    computed (``tokens``, ``tokens_computed``: padded positions, as the update counts them)."""

    seconds: list[float]
    tokens: int
    tokens_computed: int


def measure_grpo_update(args: argparse.Namespace) -> None:
    config = grpo_stage_config(args.grpo_update, args.threads)
    with distributed.parallel_session(config.parallel, config.run.seed) as context:
        distributed.set_intra_op_threads(config.trainer.num_threads)
        policy, reference = Policy(config, context), ReferenceModel(config, context)
        for module in (policy.module, reference.module):
            load_start_weights(module, config.model, Path(config.trainer.init_from))
        policy.optimizer.reload_model_params()
        started = time.perf_counter()
        samples = main_job_samples(config, policy)
        rollout_seconds = time.perf_counter() - started
        pad_id = load_tokenizer(config.tokenizer_dir).pad_token_id
        learners = {
            shared: grpo.Learner(
                policy,
                reference,
                grpo_token_loss(config.grpo),
                context.dp_rank,
                pad_id,
                share_prefixes=shared,
            )
            for shared in (False, True)
        }
        start = policy.copy_weights()
        measured = {shared: UpdateMeasurement([], 0, 0) for shared in learners}
        for index in range(args.warmup + args.steps):
            for shared in (False, True) if index % 2 == 0 else (True, False):
                began = time.perf_counter()
                trained = grpo._update(learners[shared], samples, config, step=1)
                seconds = time.perf_counter() - began
                policy.restore_weights(start)  # every update starts from the SFT policy
                if "skipped_update" in trained:
                    raise SystemExit(f"the update was skipped: {trained}")
                if index >= args.warmup:
                    measured[shared].seconds.append(seconds)
                measured[shared].tokens = int(trained["tokens"])
                measured[shared].tokens_computed = int(trained["tokens_computed"])
    print_grpo_report(args, config, samples, rollout_seconds, measured)


def print_grpo_report(
    args: argparse.Namespace,
    config: Config,
    samples: list[Sample],
    rollout_seconds: float,
    measured: dict[bool, UpdateMeasurement],
) -> None:
    grpo_config, tokens = config.grpo, sum(len(sample.token_ids) - 1 for sample in samples)
    groups = len({sample.sample_id.rsplit("/", 1)[0] for sample in samples})
    print(
        f"machine: torch {torch.__version__}, threads {torch.get_num_threads()}, CPUs "
        f"{os.cpu_count()}, load average {os.getloadavg()[0]:.1f}\n"
        f"the main job's GRPO step from {args.grpo_update}: {len(samples)} samples of {groups} "
        f"groups ({grpo_config.prompts_per_step} x {config.rollout.group_size} episodes "
        f"rolled out in {rollout_seconds:.0f} s, grpo.sample_mode={grpo_config.sample_mode}), "
        f"{tokens:,} sample tokens, {sum(sum(s.loss_mask) for s in samples):,} of them the "
        f"policy's; micro-batches of {grpo_config.micro_batch_size}; {args.warmup} warm-up + "
        f"{args.steps} timed updates each way, alternated\n"
    )
    print(
        "| update | positions trained (padded) | positions computed | computed / sample "
        "tokens | computed / trained | update s median (min-max) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for shared, row in measured.items():
        print(
            f"| {'prefix-shared' if shared else 'unshared'} | {row.tokens:,} | "
            f"{row.tokens_computed:,} | {row.tokens_computed / tokens:.2f} | "
            f"{row.tokens_computed / row.tokens:.2f} | {statistics.median(row.seconds):.2f} "
            f"({min(row.seconds):.2f}-{max(row.seconds):.2f}) |"
        )
    unshared, shared = measured[False], measured[True]
    print(
        f"\nshared / unshared: positions computed "
        f"{shared.tokens_computed / unshared.tokens_computed:.2f}x, update seconds "
        f"{statistics.median(shared.seconds) / statistics.median(unshared.seconds):.2f}x"
    )


def main() -> None:
    args = parse_args()
    if args.grpo_update is not None:
        measure_grpo_update(args)
        return
    torch.set_num_threads(args.threads)
    config = load_config(args)
    batch = make_batch(config, args.batch_size, args.seq_length)
    megatron = measure_megatron(config, batch, args.warmup, args.steps)
    hf = measure_transformers(config, batch, args.warmup, args.steps)
    print_report(args, config, megatron, hf)


if __name__ == "__main__":
    main()
