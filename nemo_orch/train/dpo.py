"""DPO recipe (``nemo-orch dpo``): preference pairs against the frozen starting policy.

Read top to bottom. The pairs: a pair file (``dpo.pairs_path``, :mod:`nemo_orch.data.pairs`), or
the starting policy's own rollouts on ``env``: GRPO's
:class:`~nemo_orch.train.grpo_rollouts.Rollouts` rolls out ``dpo.tasks`` training tasks
``rollout.group_size`` times each and scores them with the configured reward, and each task whose
best and worst episodes' rewards differ by ``dpo.min_margin`` or more gives one pair
(:func:`group_pair`), written once to ``<run>/dpo/pairs.jsonl`` with the episodes' token-level
history. Then the policy and the reference (both from ``trainer.init_from``; the policy from the
stage's last checkpoint on resume), and the step loop: each step reads ``dpo.global_batch_size``
pairs from seeded epochs (a pure function of the step, so a resumed run sees the same pairs),
computes the reference's sequence log-probabilities, takes one optimizer step on the DPO loss
(:mod:`nemo_orch.train.dpo_loss`), logs and checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from nemo_orch import distributed, faults
from nemo_orch.config import Config, ConfigError
from nemo_orch.data.pairs import (
    SIDES,
    DataError,
    Pair,
    PairTokens,
    SideTokens,
    read_pairs,
    write_pairs,
)
from nemo_orch.data.sft import collate, global_batch, padded_length, tokenize_conversation
from nemo_orch.distributed import ParallelContext
from nemo_orch.models import checkpoint, weights
from nemo_orch.models.tokenizer import load_tokenizer
from nemo_orch.rollout.episode import RolloutError
from nemo_orch.rollout.trajectory import Trajectory
from nemo_orch.train import sft
from nemo_orch.train.dpo_loss import dpo_token_loss, sequence_logprobs
from nemo_orch.train.grpo_groups import Group
from nemo_orch.train.grpo_rollouts import Rollouts, build_rollouts
from nemo_orch.train.metrics import MetricsLogger
from nemo_orch.train.policy import Batch, Policy, ReferenceModel, load_start_weights

log = logging.getLogger(__name__)

PAIRS = "pairs.jsonl"

# One sequence of a pair, as an SFT sample: ``tokens``, ``labels`` (the next token at each
# position) and ``loss_mask`` (1.0 where the label is a policy token), unpadded.
Sample = dict[str, torch.Tensor]


@dataclass
class DPOSummary:
    start_step: int
    end_step: int
    pairs_path: Path
    num_pairs: int
    num_dropped: int
    first_loss: float | None
    last_loss: float | None
    first_accuracy: float | None
    last_accuracy: float | None
    checkpoint: Path | None
    run_dir: Path


def policy_config(config: Config) -> Config:
    """The config the Megatron policy is built from for this stage: the optimizer of
    ``dpo.optim``, its schedule over ``dpo.max_steps``."""
    return dataclasses.replace(
        config,
        trainer=dataclasses.replace(
            config.trainer, optim=config.dpo.optim, max_steps=config.dpo.max_steps
        ),
    )


# ----------------------------------------------------------------------------- pairs from rollouts


def rollout_config(config: Config) -> Config:
    """GRPO's rollouts as one sampling round of ``dpo.tasks`` tasks with the policy's own
    choices: no refill of groups without spread (a task gives a pair or it does not), no
    validation, no forced exploration."""
    grpo = dataclasses.replace(
        config.grpo,
        prompts_per_step=config.dpo.tasks,
        dynamic_sampling=False,
        val_interval=0,
        explore_share=0.0,
        explore_models=0.0,
    )
    return dataclasses.replace(config, grpo=grpo)


def prompt_messages(trajectory: Trajectory, tokenizer: PreTrainedTokenizerBase) -> int:
    """How many of the trajectory's leading messages its prompt tokens hold: those whose
    rendering (with the generation prompt) is the prompt's text."""
    prompt = tokenizer.decode(
        trajectory.token_ids[: trajectory.prompt_length], skip_special_tokens=False
    )
    for size in range(1, len(trajectory.messages) + 1):
        rendered = tokenizer.apply_chat_template(
            trajectory.messages[:size],
            tools=trajectory.tools or None,
            tokenize=False,
            add_generation_prompt=True,
        )
        if rendered == prompt:
            return size
    raise RolloutError(
        f"episode {trajectory.task_id}#{trajectory.sample}: no leading messages "
        "render as its prompt tokens"
    )


def group_pair(group: Group, min_margin: float, tokenizer: PreTrainedTokenizerBase) -> Pair | None:
    """The pair of one task's scored group, None if it has none: the best episode (the first
    of them in sample order) is chosen, the worst of those that continue the same prompt with
    other tokens is rejected, if its reward is ``min_margin`` or more below. The extremes give
    the clearest preference the group holds, and one pair per task keeps every prompt's weight
    equal. An episode the same as the chosen one token for token cannot be rejected (a scorer
    that is not deterministic can score the same text twice differently), nor one whose prompt
    differs (a user who opened differently); episodes without a policy token (an engine failure
    at the first turn) take no part, nor do those a failure outside the policy decided (which
    rollouts mask out of their groups already: a failing endpoint, user or judge)."""
    episodes = [
        (trajectory, breakdown.reward)
        for trajectory, breakdown in zip(group.trajectories, group.breakdowns)
        if any(trajectory.loss_mask) and trajectory.infra_failure() is None
    ]
    if not episodes:
        return None
    chosen, chosen_reward = max(episodes, key=lambda episode: episode[1])
    prompt = chosen.token_ids[: chosen.prompt_length]
    rivals = [
        (trajectory, reward)
        for trajectory, reward in episodes
        if trajectory.token_ids[: trajectory.prompt_length] == prompt
        and trajectory.token_ids != chosen.token_ids
    ]
    if not rivals:
        return None
    rejected, rejected_reward = min(rivals, key=lambda episode: episode[1])
    if chosen_reward - rejected_reward < min_margin:
        return None
    size = prompt_messages(chosen, tokenizer)
    tokens = PairTokens(
        prompt,
        *(
            SideTokens(t.token_ids[t.prompt_length :], t.loss_mask[t.prompt_length :])
            for t in (chosen, rejected)
        ),
    )
    return Pair(
        group.task.id,
        chosen.messages[:size],
        chosen.messages[size:],
        rejected.messages[size:],
        chosen.tools,
        chosen_reward,
        rejected_reward,
        tokens,
    )


def rollout_pairs(
    rollouts: Rollouts, min_margin: float, tokenizer: PreTrainedTokenizerBase
) -> tuple[list[Pair], int]:
    """One round of ``rollouts`` (built from :func:`rollout_config`): the pairs of its groups
    and how many tasks were rolled out."""
    groups = rollouts.step(0, None).generated
    pairs = [pair for group in groups if (pair := group_pair(group, min_margin, tokenizer))]
    return pairs, len(groups)


def prepare_pairs(
    config: Config, tokenizer: PreTrainedTokenizerBase, reference: ReferenceModel
) -> Path:
    """The pair file: ``dpo.pairs_path``, else the stage's ``pairs.jsonl``, which rank 0 writes
    once (atomically; a resumed run reads it back) from the rollouts of the ``reference``, the
    starting policy, while the other ranks wait."""
    if config.dpo.pairs_path is not None:
        return Path(config.dpo.pairs_path)
    path = config.run.dir / PAIRS
    if path.exists():
        return path
    # every rank takes part
    hf = weights.gather_hf_weights(reference.module, config.model, config.rollout.refit_bucket_mb)
    if distributed.is_writer():
        dpo = config.dpo
        path.parent.mkdir(parents=True, exist_ok=True)  # the rollouts' notes.json goes there
        with build_rollouts(rollout_config(config), tokenizer, hf, []) as rollouts:
            pairs, tasks = rollout_pairs(rollouts, dpo.min_margin, tokenizer)
        if not pairs:
            raise ConfigError(
                f"none of the {tasks} env={config.env.label} tasks' {config.rollout.group_size} "
                f"episodes had rewards dpo.min_margin={dpo.min_margin} apart: no pairs; roll out "
                "more tasks (dpo.tasks) or episodes (rollout.group_size), or lower "
                "dpo.min_margin"
            )
        partial = path.with_suffix(".partial")
        write_pairs(partial, pairs)
        partial.rename(path)
        log.info("wrote %d pairs from %d tasks to %s", len(pairs), tasks, path)
    distributed.barrier()
    return path


# ----------------------------------------------------------------------------- samples


def _sample(ids: list[int], mask: list[int]) -> Sample:
    return {
        "tokens": torch.tensor(ids[:-1], dtype=torch.long),
        "labels": torch.tensor(ids[1:], dtype=torch.long),
        "loss_mask": torch.tensor(mask[1:], dtype=torch.float),
    }


def pair_sequences(
    tokenizer: PreTrainedTokenizerBase, pair: Pair, where: str
) -> list[tuple[list[int], list[int]]]:
    """The chosen and the rejected sequence as (token ids, loss mask), the mask 1 on the
    side's policy tokens only. A pair with ``tokens`` keeps them (its prompt must be this
    tokenizer's rendering of the prompt messages); the others are rendered with the chat
    template, the loss on the sides' assistant tokens."""
    if pair.tokens is not None:
        prompt = pair.tokens.prompt
        rendered = tokenizer.apply_chat_template(
            pair.prompt, tools=pair.tools or None, tokenize=False, add_generation_prompt=True
        )
        if tokenizer.decode(prompt, skip_special_tokens=False) != rendered:
            raise DataError(
                f"{where}: tokens.prompt does not decode to the prompt messages' "
                "rendering: the tokens are another tokenizer's, or another prompt's"
            )
        return [
            (prompt + side.ids, [0] * len(prompt) + side.loss_mask)
            for side in (pair.tokens.chosen, pair.tokens.rejected)
        ]
    prompt = list(
        tokenizer.apply_chat_template(
            pair.prompt, tools=pair.tools or None, tokenize=True, return_dict=True
        )["input_ids"]
    )
    sequences = []
    for side in SIDES:
        ids, mask = tokenize_conversation(tokenizer, pair.conversation(side))
        if ids[: len(prompt)] != prompt:
            raise DataError(
                f"{where}: the chat template does not render the prompt as the "
                f"start of the {side} conversation"
            )
        # An assistant message inside the prompt is context, not something to compare.
        mask = [0] * len(prompt) + mask[len(prompt) :]
        if not any(mask):
            raise DataError(f"{where}: the {side} side has no assistant token to compare")
        sequences.append((ids, mask))
    return sequences


class PairDataset(Dataset[tuple[Sample, Sample]]):
    """(chosen, rejected) samples, one per pair whose two sequences fit in ``max_length`` inputs
    (the rest are dropped and counted: a truncated side would compare what was never written)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        pairs: Sequence[Pair],
        max_length: int,
        source: Path,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise DataError("the tokenizer has no pad token")
        self.pad_id = tokenizer.pad_token_id
        self.num_dropped = 0
        self.pairs: list[tuple[Sample, Sample]] = []
        for pair in pairs:
            (chosen, chosen_mask), (rejected, rejected_mask) = pair_sequences(
                tokenizer, pair, f"{source}: pair {pair.id}"
            )
            # max_length inputs predict max_length labels: one token more than a side holds.
            if max(len(chosen), len(rejected)) > max_length + 1:
                self.num_dropped += 1
                continue
            self.pairs.append((_sample(chosen, chosen_mask), _sample(rejected, rejected_mask)))
        if not self.pairs:
            raise DataError(
                f"{source}: all {len(pairs)} pairs are longer than the policy's "
                f"{max_length} positions"
            )

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[Sample, Sample]:
        return self.pairs[index]


def micro_batches(
    pairs: Sequence[tuple[Sample, Sample]], micro_batch_size: int, pad_id: int, max_length: int
) -> list[Batch]:
    """Micro-batches of ``micro_batch_size`` pairs, [2 x pairs, s]: chosen at row 2i, rejected
    at 2i + 1 (the loss pairs them up). All are padded to one length: a pipeline's micro-batches
    must share their shape."""
    length = padded_length((len(side["tokens"]) for pair in pairs for side in pair), cap=max_length)
    return [
        collate(
            [side for pair in pairs[start : start + micro_batch_size] for side in pair],
            length,
            pad_id,
        )
        for start in range(0, len(pairs), micro_batch_size)
    ]


def add_reference_sums(batches: list[Batch], reference: ReferenceModel) -> None:
    """Each micro-batch's ``ref_logprob_sums`` [b]: the reference's sequence log-probabilities
    over the loss mask (on the last pipeline stage, where the loss runs)."""
    for batch, logprobs in zip(batches, reference.forward_logprobs(batches)):
        if logprobs is not None:
            batch["ref_logprob_sums"] = sequence_logprobs(logprobs, batch["loss_mask"])


# ----------------------------------------------------------------------------- the loop


def run(config: Config) -> DPOSummary:
    """DPO from ``trainer.init_from`` into ``config.run.dir``, in its own process group. A pair
    file is read first, so a bad one fails before any model is built."""
    pairs = read_pairs(config.dpo.pairs_path) if config.dpo.pairs_path is not None else None
    with distributed.parallel_session(config.parallel, config.run.seed) as context:
        return train(config, context, pairs)


def train(config: Config, context: ParallelContext, pairs: list[Pair] | None = None) -> DPOSummary:
    """DPO inside a running parallel session (see :func:`run`); ``pairs``: those of
    ``dpo.pairs_path`` when already read."""
    config = policy_config(config)
    dpo = config.dpo
    distributed.set_intra_op_threads(config.trainer.num_threads)
    tokenizer = load_tokenizer(config.tokenizer_dir)
    policy = Policy(config, context)
    resumed = sft.initialize_weights(policy, config)
    start_step = resumed.step if resumed is not None else 0
    reference = ReferenceModel(config, context)
    # The reference is the stage's starting point, also on resume.
    load_start_weights(reference.module, config.model, Path(config.trainer.init_from))
    pairs_path = prepare_pairs(config, tokenizer, reference)
    max_length = config.model.max_position_embeddings
    dataset = PairDataset(
        tokenizer, read_pairs(pairs_path) if pairs is None else pairs, max_length, pairs_path
    )
    loss_fn = dpo_token_loss(dpo)
    metrics = MetricsLogger.for_stage(
        config,
        "dpo",
        enabled=context.is_logging_rank,
        start_step=start_step,
        max_steps=dpo.max_steps,
    )
    per_rank = dpo.global_batch_size // config.parallel.dp
    records: list[dict[str, Any]] = []
    saved = resumed.path if resumed is not None else None
    with contextlib.closing(metrics):
        for step in range(start_step + 1, dpo.max_steps + 1):
            faults.maybe_kill("step", step)
            indices = global_batch(dataset, step, dpo.global_batch_size, config.run.seed)
            mine = indices[context.dp_rank * per_rank : (context.dp_rank + 1) * per_rank]
            batches = micro_batches(
                [dataset[i] for i in mine], dpo.micro_batch_size, dataset.pad_id, max_length
            )
            add_reference_sums(batches, reference)
            result = policy.train_step(batches, loss_fn)
            record = {
                "loss": result.loss,
                **result.metrics,
                "grad_norm": result.grad_norm,
                "lr": result.lr,
                "pairs": result.num_tokens,
                "tokens": sum(batch["tokens"].numel() for batch in batches) * config.parallel.dp,
            }
            metrics.log(step, record)
            records.append(record)
            if step % dpo.save_interval == 0 or step == dpo.max_steps:
                saved = checkpoint.save(
                    config,
                    step,
                    policy.module,
                    policy.optimizer,
                    policy.scheduler,
                    tokenizer_dir=config.tokenizer_dir,
                )
    first, last = (records[0], records[-1]) if records else ({}, {})
    return DPOSummary(
        start_step,
        max(start_step, dpo.max_steps),
        pairs_path,
        len(dataset),
        dataset.num_dropped,
        first.get("loss"),
        last.get("loss"),
        first.get("rewards/accuracies"),
        last.get("rewards/accuracies"),
        saved,
        config.run.dir,
    )
