"""GRPO train steps on a fixed synthetic batch, in any parallel layout.

Run in-process (one rank) by the tests, or under torchrun for TP/PP/DP layouts, one per argument,
all in one launch (a launch costs more than the steps), each layout also with its micro-batches
packed to share prefixes (``grpo.prefix_sharing=on``):
``python -m torch.distributed.run --nproc_per_node 2 tests/multiprocess/grpo_step.py parallel.tp=2
parallel.pp=2``; rank 0 prints JSON: per layout, per step the loss, loss tokens, grad norm and the
loss's metrics, what GRPO's update (``grpo._update``) reports, and whether the bucketed
refit delivers exactly what the pickled gather did.

The batch is a list of GRPO samples, a pure function of the seed, split over DP ranks and cut
into micro-batches by GRPO's own functions (``even_split``, ``micro_batches``: each micro-batch
cut to its longest sequence unless pipelined), so every layout trains on the same tokens and the
TP and DP layouts on micro-batches of different lengths, which must still match one process. Old
log-probabilities are the policy's own plus per-token offsets (ratios from ~0.67 to ~4.5:
unclipped, clipped low and high, dual-clipped) that are a function of the label, so they follow a
token wherever it is cut to; the reference is a differently seeded model, so every branch of the
loss and the KL term take part. Then ``_update`` itself runs: two mini-batches, two passes, its
old and reference log-probabilities computed by the policy; and PPO's (``ppo_update``): the same
with a critic (values, GAE, whitening across DP ranks, the return statistics, the clipped value
loss) and the KL in the reward.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
from pathlib import Path

import torch

from nemo_orch import config as config_lib
from nemo_orch.config import Config, PPOConfig
from nemo_orch.distributed import ParallelContext
from nemo_orch.models.hf_mapping import SeededHFWeights
from nemo_orch.train import grpo, grpo_samples, ppo
from nemo_orch.train.grpo_loss import grpo_token_loss
from nemo_orch.train.policy import Batch, Critic, Policy, ReferenceModel

# A ~100k-parameter Qwen3 that splits in two along TP and PP; the LR moves it visibly in one step.
OVERRIDES = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.kv_channels=16",
    "model.vocab_size=512",
    "tokenizer.vocab_size=512",
    "trainer.optim.lr=1e-3",
    "trainer.optim.warmup_steps=0",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4",
    "grpo.micro_batch_size=2",
    "grpo.prefix_sharing=off",  # the unshared computation, which the shared must reproduce
]
NUM_SEQUENCES, SEQ_LENGTH, PAD = 8, 24, 0
OLD_LOGPROB_OFFSETS = torch.tensor([-1.5, -0.4, 0.0, 0.05, 0.4])


def synthetic_samples(
    config: Config, count: int = NUM_SEQUENCES, seed: int = 7, step_credit: bool = False
) -> list[grpo_samples.Sample]:
    """Random tokens (each pair's prompt shared), a response after a random prompt length up to
    the sequence's own end, one advantage per sequence; with ``step_credit``, every other sequence's response also carries
    per-token step advantages (``grpo.step_advantage_weight``'s credit per call), in two
    calls of their own."""
    generator = torch.Generator().manual_seed(seed)
    credit = torch.Generator().manual_seed(seed + 1)
    samples = []
    for index in range(count):
        ids = torch.randint(1, config.model.vocab_size, (SEQ_LENGTH + 1,), generator=generator)
        prompt = int(torch.randint(2, SEQ_LENGTH // 2, (1,), generator=generator))
        if index % 2:  # pairs share their prompt, as a GRPO group's samples do
            ids[:prompt] = torch.tensor(samples[-1].token_ids[:prompt])
        end = SEQ_LENGTH if index % 4 == 3 else SEQ_LENGTH // 2 + 2 * (index % 4)
        # Token i + 1 is the label of position i: the loss covers positions prompt .. end - 1.
        mask = [0] * (prompt + 1) + [1] * (end - prompt)
        advantage = float(torch.randn(1, generator=generator))
        steps = None
        if step_credit and index % 2:
            middle = (prompt + 1 + end + 1) // 2
            first, second = torch.randn(2, generator=credit).tolist()
            steps = (
                [0.0] * (prompt + 1)
                + [first] * (middle - prompt - 1)
                + [second] * (end + 1 - middle)
            )
        samples.append(
            grpo_samples.Sample(
                ids[: end + 1].tolist(),
                mask,
                [0.0] * (end + 1),
                advantage,
                mask,
                reward=advantage + 0.5,
                step_advantages=steps,
            )
        )
    return samples


def rank_batches(
    samples: list[grpo_samples.Sample], config: Config, context: ParallelContext
) -> list[Batch]:
    """This DP rank's micro-batches of ``samples``, as GRPO's update cuts them."""
    mine = grpo_samples.even_split(samples, context.parallel.dp, random.Random(0))[context.dp_rank]
    return grpo_samples.micro_batches(
        mine,
        config.grpo.micro_batch_size,
        PAD,
        one_length=context.parallel.pp > 1,
        share_prefixes=grpo.shares_prefixes(config),
    )


def _offsets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token offsets of the old and the engine's log-probabilities, from the labels."""
    old = OLD_LOGPROB_OFFSETS[labels % len(OLD_LOGPROB_OFFSETS)]
    return old, old + 0.01 * ((labels % 7).float() - 3)


def _models(config: Config, context: ParallelContext) -> tuple[Policy, ReferenceModel]:
    policy = Policy(config, context)
    policy.load_hf_weights(SeededHFWeights(config.model, config.run.seed))
    reference = ReferenceModel(config, context)
    reference.load_hf_weights(SeededHFWeights(config.model, config.run.seed + 1))
    return policy, reference


def refit_results(config: Config, context: ParallelContext) -> dict | None:
    """The bucketed refit (a bucket per layer) against the pickled gather, on rank 0: the
    buckets themselves, and an HF engine refitted from the stream as GRPO refits its own."""
    from nemo_orch.models import weights
    from nemo_orch.rollout.engines.hf import HFEngine

    # The refit before its buckets is the benchmark's baseline; one copy serves both.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from refit import pickled_gather

    policy, _ = _models(config, context)
    with torch.no_grad():  # weights of no seed's: each rank's shard moves differently
        for parameter in policy.module.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    old = pickled_gather(policy.module, config, bucket_mb=0)
    buckets = list(weights.hf_weight_buckets(policy.module, config.model, bucket_bytes=1))
    stream = weights.hf_weight_buckets(policy.module, config.model, bucket_bytes=1)
    if old is None:
        assert not buckets and not list(stream)  # only rank 0 receives
        return None
    engine = HFEngine(config.model, seed=config.run.seed + 7)
    engine.update_weights(stream)
    refitted = dict(engine.model.named_parameters())
    new = {name: tensor for bucket in buckets for name, tensor in bucket.items()}
    return {
        "exact": new.keys() == old.keys()
        and all(torch.equal(new[name], old[name]) for name in old),
        "engine_exact": all(torch.equal(refitted[name], old[name]) for name in refitted),
        "buckets": len(buckets),
    }


def grpo_steps(config: Config, context: ParallelContext, steps: int = 2) -> list[dict]:
    """``steps`` GRPO updates on the synthetic batch (old and reference log-probabilities fixed
    before the first), each step's loss, tokens, grad norm and metrics."""
    policy, reference = _models(config, context)
    batches = rank_batches(synthetic_samples(config, step_credit=True), config, context)
    old_logprobs = policy.forward_logprobs(batches)
    for batch, old, ref in zip(batches, old_logprobs, reference.forward_logprobs(batches)):
        if old is not None:  # the last pipeline stage, where the loss is computed
            old_offset, engine_offset = _offsets(batch["labels"])
            batch.update(
                old_logprobs=old + old_offset, ref_logprobs=ref, engine_logprobs=old + engine_offset
            )
    loss = grpo_token_loss(config.grpo)
    results = [policy.train_step(batches, loss) for _ in range(steps)]
    return [
        {"loss": r.loss, "num_tokens": r.num_tokens, "grad_norm": r.grad_norm, **r.metrics}
        for r in results
    ]


def update_results(config: Config, context: ParallelContext) -> dict[str, float]:
    """What GRPO's update reports for 16 samples in two mini-batches, two passes over them."""
    config = config_lib.replace(
        config, grpo=dataclasses.replace(config.grpo, mini_batches=2, updates_per_step=2)
    )
    policy, reference = _models(config, context)
    learner = grpo.Learner(
        policy,
        reference,
        grpo_token_loss(config.grpo),
        context.dp_rank,
        PAD,
        share_prefixes=grpo.shares_prefixes(config),
    )
    return grpo._update(learner, synthetic_samples(config, count=16, step_credit=True), config, 1)


def ppo_update_results(config: Config, context: ParallelContext) -> dict[str, float]:
    """What PPO's update reports for 16 samples in two mini-batches, two passes over them, the
    KL in the reward, from a critic whose head is not zero (so its trunk learns from the
    first step)."""
    config = config_lib.replace(
        config,
        grpo=dataclasses.replace(
            config.grpo,
            algo="ppo",
            dynamic_sampling=False,
            mini_batches=2,
            updates_per_step=2,
            ppo=PPOConfig(gamma=0.99, lam=0.9, use_kl_in_reward=True),
        ),
    )
    policy, reference = _models(config, context)
    critic = Critic(ppo.critic_config(config), context)
    critic.load_hf_weights(SeededHFWeights(config.model, config.run.seed + 2))
    if critic.head is not None:
        with torch.no_grad():
            head = torch.Generator().manual_seed(3)
            critic.head.weight.copy_(0.1 * torch.randn(critic.head.weight.shape, generator=head))
        critic.optimizer.reload_model_params()
    loss = grpo_token_loss(dataclasses.replace(config.grpo, kl_coef=0.0))
    learner = grpo.Learner(
        policy,
        reference,
        loss,
        context.dp_rank,
        PAD,
        critic=critic,
        share_prefixes=grpo.shares_prefixes(config),
    )
    return grpo._update(learner, synthetic_samples(config, count=16), config, 1)


def training_results(config: Config, context: ParallelContext) -> dict:
    """The train steps', GRPO's and PPO's update results."""
    return {
        "steps": grpo_steps(config, context),
        "update": update_results(config, context),
        "ppo_update": ppo_update_results(config, context),
    }


def with_prefix_sharing(config: Config) -> Config:
    """``config`` with its micro-batches packed to share prefixes."""
    return config_lib.replace(config, grpo=dataclasses.replace(config.grpo, prefix_sharing="on"))


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
            results[layout] = {
                **training_results(config, context),
                "refit": refit_results(config, context),
                "shared": training_results(with_prefix_sharing(config), context),
            }
            parallel_state.destroy_model_parallel()
    finally:
        distributed.shutdown()
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
