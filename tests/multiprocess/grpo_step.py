"""GRPO train steps on a fixed synthetic batch, in any parallel layout.

Run in-process (one rank) by the tests, or under torchrun for TP/PP/DP layouts, one per argument,
all in one launch (a launch costs more than the steps):
``python -m torch.distributed.run --nproc_per_node 2 tests/multiprocess/grpo_step.py parallel.tp=2
parallel.pp=2``; rank 0 prints JSON: per layout, per step the loss, loss tokens, grad norm and the
loss's metrics.

The batch is a pure function of the seed and the global batch, split over DP ranks and
micro-batches after it is drawn, so every layout trains on the same tokens. Old log-probabilities
are the policy's own plus fixed per-token offsets (ratios from ~0.67 to ~4.5: unclipped, clipped
low and high, dual-clipped) and the reference is a differently seeded model, so every branch of the
loss and the KL term take part.

Each sequence ends at its own length (loss-masked padding after it). Without pipeline
parallelism every micro-batch is cut to its longest sequence, as GRPO's micro-batches are, so the
TP and DP layouts train on micro-batches of different lengths and must still match one process
(which cuts them the same way) and PP (which cannot: its stages exchange one shape).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from nemo_orch import config as config_lib
from nemo_orch.config import Config
from nemo_orch.distributed import ParallelContext
from nemo_orch.models.hf_mapping import SeededHFWeights
from nemo_orch.train.grpo_loss import grpo_token_loss
from nemo_orch.train.policy import Batch, Policy, ReferenceModel

# A ~100k-parameter Qwen3 that splits in two along TP and PP; the LR moves it visibly in one step.
OVERRIDES = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
             "model.num_attention_heads=4", "model.num_query_groups=2", "model.kv_channels=16",
             "model.vocab_size=512", "tokenizer.vocab_size=512", "trainer.lr=1e-3",
             "trainer.warmup_steps=0", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
             "grpo.micro_batch_size=2"]
NUM_SEQUENCES, SEQ_LENGTH = 8, 24
OLD_LOGPROB_OFFSETS = torch.tensor([-1.5, -0.4, 0.0, 0.05, 0.4])


def synthetic_batch(config: Config, seed: int = 7) -> dict[str, torch.Tensor]:
    """The global batch: random tokens, a response after a random prompt length, one advantage per
    sequence, and per-token offsets for old (``old_offset``) and engine (``engine_offset``)
    log-probabilities."""
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_SEQUENCES, SEQ_LENGTH)
    ids = torch.randint(0, config.model.vocab_size, (NUM_SEQUENCES, SEQ_LENGTH + 1),
                        generator=generator)
    prompt_lengths = torch.randint(2, SEQ_LENGTH // 2, (NUM_SEQUENCES, 1), generator=generator)
    ends = torch.tensor([[SEQ_LENGTH if index % 4 == 3 else SEQ_LENGTH // 2 + 2 * (index % 4)]
                         for index in range(NUM_SEQUENCES)])
    positions = torch.arange(SEQ_LENGTH)
    loss_mask = ((positions >= prompt_lengths) & (positions < ends)).float()
    advantages = torch.randn(NUM_SEQUENCES, 1, generator=generator).expand(shape) * loss_mask
    choice = torch.randint(0, len(OLD_LOGPROB_OFFSETS), shape, generator=generator)
    return {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": loss_mask, "end": ends,
            "position_ids": torch.arange(SEQ_LENGTH).repeat(NUM_SEQUENCES, 1),
            "advantages": advantages.contiguous(), "old_offset": OLD_LOGPROB_OFFSETS[choice],
            "engine_offset": 0.01 * torch.randn(shape, generator=generator)}


def micro_batches(batch: Batch, context: ParallelContext, micro_batch_size: int) -> list[Batch]:
    """This DP rank's share of a global batch, cut into micro-batches, each cut to its longest
    sequence unless pipelined."""
    per_rank = len(batch["tokens"]) // context.parallel.dp
    start = context.dp_rank * per_rank
    chunks = []
    for i in range(start, start + per_rank, micro_batch_size):
        chunk = {key: value[i:i + micro_batch_size] for key, value in batch.items()}
        length = SEQ_LENGTH if context.parallel.pp > 1 else int(chunk.pop("end").max())
        chunk.pop("end", None)
        chunks.append({key: value[:, :length] for key, value in chunk.items()})
    return chunks


def grpo_steps(config: Config, context: ParallelContext, steps: int = 2) -> list[dict]:
    """``steps`` GRPO updates on the synthetic batch (old and reference log-probabilities fixed
    before the first), each step's loss, tokens, grad norm and metrics."""
    policy = Policy(config, context)
    policy.load_hf_weights(SeededHFWeights(config.model, config.run.seed))
    reference = ReferenceModel(config, context)
    reference.load_hf_weights(SeededHFWeights(config.model, config.run.seed + 1))
    batches = micro_batches(synthetic_batch(config), context, config.grpo.micro_batch_size)
    old_logprobs = policy.forward_logprobs(batches)
    for batch, old, ref in zip(batches, old_logprobs, reference.forward_logprobs(batches)):
        if old is not None:  # the last pipeline stage, where the loss is computed
            batch.update(old_logprobs=old + batch["old_offset"], ref_logprobs=ref,
                         engine_logprobs=old + batch["old_offset"] + batch["engine_offset"])
    loss = grpo_token_loss(config.grpo)
    results = [policy.train_step(batches, loss) for _ in range(steps)]
    return [{"loss": r.loss, "num_tokens": r.num_tokens, "grad_norm": r.grad_norm, **r.metrics}
            for r in results]


def main(layouts: list[str]) -> None:
    from megatron.core import parallel_state

    from nemo_orch import distributed

    torch.set_num_threads(1)
    results = {}
    try:
        for layout in layouts:
            config = config_lib.load([*OVERRIDES, layout])
            # The process group outlives the layouts; Megatron's groups are rebuilt for each.
            context = distributed.initialize(config.parallel, config.run.seed)
            results[layout] = grpo_steps(config, context)
            parallel_state.destroy_model_parallel()
    finally:
        distributed.shutdown()
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
