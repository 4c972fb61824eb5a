"""GRPO's training samples: the kept groups' episodes as token sequences with their advantages
(:func:`samples_of`), cut into equal parts over mini-batches and DP ranks (:func:`even_split`)
and packed into micro-batches of tensors (:func:`micro_batches`). The update that trains on them
is :mod:`nemo_orch.train.grpo`'s."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from nemo_orch.config import Config
from nemo_orch.data.sft import padded_length
from nemo_orch.reward.advantages import group_advantages, step_advantages, trajectory_drop_reason
from nemo_orch.train.grpo_groups import Group
from nemo_orch.train.policy import Batch
from nemo_orch.train.prefix_sharing import packed_inputs, token_tree


@dataclass
class Sample:
    """One training sequence: token ids, which of them the loss covers, the engine's logprobs,
    the group advantage (GRPO's) and the tokens an advantage applies to (``advantage_mask``,
    within ``loss_mask``), and the trajectory's reward (PPO's GAE starts from it).
    ``sampled_mask``: the loss tokens the policy drew itself (None: all), those the KL to the
    reference is estimated on: its estimators hold for the policy's own draws, and on a token
    exploration forced, one the policy had learned to avoid, k3 grows as exp(ref - logp)."""

    token_ids: list[int]
    loss_mask: list[int]
    engine_logprobs: list[float]
    advantage: float
    advantage_mask: list[int]
    sample_id: str = ""  # <task id>/<sample>, and /<turn> with grpo.sample_mode=turn
    reward: float = 0.0
    sampled_mask: list[int] | None = None
    # Per token, the credit of the call it belongs to (grpo.step_advantage_weight times the
    # turn's step advantage), added to ``advantage``; None: no step credit.
    step_advantages: list[float] | None = None


def samples_of(groups: list[Group], config: Config) -> list[Sample]:
    """Training samples: whole trajectories (observations masked) or, with
    ``grpo.sample_mode=turn``, one per turn (the prefix up to it, loss on that turn only). With
    ``grpo.step_advantage_weight``, each turn's tokens also carry that weight times the turn's
    step advantage (:func:`~nemo_orch.reward.advantages.step_advantages`; a turn's state: the
    tokens before it)."""
    weight = config.grpo.step_advantage_weight
    samples = []
    for group in groups:
        rewards = [b.reward for b in group.breakdowns]
        advantages = group_advantages(rewards, config.reward)
        spans = [_turn_spans(t.loss_mask) for t in group.trajectories]
        steps = (
            step_advantages(
                [
                    [tuple(t.token_ids[:start]) for start, _ in turns]
                    for t, turns in zip(group.trajectories, spans)
                ],
                rewards,
                config.reward,
            )
            if weight
            else [None] * len(spans)
        )
        for trajectory, breakdown, advantage, turns, credit in zip(
            group.trajectories, group.breakdowns, advantages, spans, steps
        ):
            if trajectory_drop_reason(breakdown, config.reward) or not any(trajectory.loss_mask):
                continue
            ids, mask, logprobs = (trajectory.token_ids, trajectory.loss_mask, trajectory.logprobs)
            driven = (
                trajectory.decision_mask if config.grpo.advantage_tokens == "decisions" else mask
            )
            sampled = [
                flag * (1 - forced)
                for flag, forced in zip(mask, trajectory.forced_mask or [0] * len(mask))
            ]
            sample_id = f"{trajectory.task_id}/{trajectory.sample}"
            if config.grpo.sample_mode == "trajectory":
                per_token = None
                if credit is not None:
                    per_token = [0.0] * len(ids)
                    for (start, end), turn_credit in zip(turns, credit):
                        per_token[start:end] = [weight * turn_credit] * (end - start)
                samples.append(
                    Sample(
                        ids,
                        mask,
                        logprobs,
                        advantage,
                        driven,
                        sample_id,
                        breakdown.reward,
                        sampled,
                        per_token,
                    )
                )
                continue
            for turn, (start, end) in enumerate(turns):
                turn_mask = [1 if start <= i < end else 0 for i in range(end)]
                turn_advantage = advantage + (weight * credit[turn] if credit else 0.0)
                samples.append(
                    Sample(
                        ids[:end],
                        turn_mask,
                        logprobs[:end],
                        turn_advantage,
                        [a * b for a, b in zip(turn_mask, driven)],
                        f"{sample_id}/{turn}",
                        breakdown.reward,
                        [a * b for a, b in zip(turn_mask, sampled)],
                    )
                )
    return samples


def _turn_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for index, flag in enumerate(mask + [0]):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            spans.append((start, index))
            start = None
    return spans


def micro_batches(
    samples: list[Sample],
    micro_batch_size: int,
    pad_id: int,
    one_length: bool = False,
    share_prefixes: bool = False,
) -> list[Batch]:
    """[b, s] tensors: inputs are ids[:-1], labels ids[1:], and everything per label.

    Samples are grouped by length and each micro-batch is padded to its longest, so one long
    episode does not pad the whole batch (the loss is a token mean over the global batch: the
    grouping does not change it). ``one_length``: every micro-batch gets the longest's length,
    as pipeline stages exchange activations of one shape. ``share_prefixes``: samples are
    grouped by their tokens instead, so those that share a prefix (a group's prompt, an
    episode's earlier turns) share micro-batches, and each micro-batch's inputs are packed as
    a token tree that computes every shared prefix once
    (:mod:`~nemo_orch.train.prefix_sharing`; with ``one_length``, rows of one length too)."""
    samples = sorted(
        samples,
        key=(lambda sample: sample.token_ids) if share_prefixes else (lambda s: len(s.token_ids)),
    )
    chunks = [
        samples[start : start + micro_batch_size]
        for start in range(0, len(samples), micro_batch_size)
    ]
    step_length = padded_length(len(s.token_ids) - 1 for s in samples)
    batches = [
        _micro_batch(
            chunk,
            step_length if one_length else padded_length(len(s.token_ids) - 1 for s in chunk),
            pad_id,
        )
        for chunk in chunks
    ]
    if share_prefixes:
        trees = [token_tree([s.token_ids[:-1] for s in chunk]) for chunk in chunks]
        row_length = padded_length(len(tree) for tree in trees)
        for batch, tree in zip(batches, trees):
            length = row_length if one_length else padded_length([len(tree)])
            batch.update(packed_inputs(tree, batch["labels"].shape[1], length, pad_id))
    return batches


def _micro_batch(chunk: list[Sample], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    def column(values: list[list[float]], fill: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([row + [fill] * (length - len(row)) for row in values], dtype=dtype)

    mask = column([s.loss_mask[1:] for s in chunk], 0, torch.float)
    advantage_mask = column([s.advantage_mask[1:] for s in chunk], 0, torch.float)
    return {
        "tokens": column([s.token_ids[:-1] for s in chunk], pad_id, torch.long),
        "labels": column([s.token_ids[1:] for s in chunk], pad_id, torch.long),
        "loss_mask": mask,
        "kl_mask": column(
            [(s.loss_mask if s.sampled_mask is None else s.sampled_mask)[1:] for s in chunk],
            0,
            torch.float,
        ),
        "engine_logprobs": column([s.engine_logprobs[1:] for s in chunk], 0.0, torch.float),
        "advantage_mask": advantage_mask,
        "advantages": advantage_mask
        * (
            torch.tensor([[s.advantage] for s in chunk])
            + column(
                [(s.step_advantages or [0.0] * len(s.token_ids))[1:] for s in chunk],
                0.0,
                torch.float,
            )
        ),
        "rewards": _on_last_token(mask, [s.reward for s in chunk]),
        "position_ids": torch.arange(length).repeat(len(chunk), 1),
    }


def _on_last_token(mask: torch.Tensor, rewards: list[float]) -> torch.Tensor:
    """[b, s]: each row's reward on its last loss token, 0 elsewhere."""
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
    placed = torch.zeros_like(mask)
    placed[torch.arange(len(rewards)), last] = torch.tensor(rewards, dtype=mask.dtype)
    return placed * mask


def even_split(samples: list[Sample], parts: int, rng: random.Random) -> list[list[Sample]]:
    """Shuffled, then cut into ``parts`` chunks of equal size (the remainder is dropped, so
    every rank and every mini-batch sees the same number of micro-batches)."""
    samples = samples[:]
    rng.shuffle(samples)
    size = len(samples) // parts
    return [samples[i * size : (i + 1) * size] for i in range(parts)]
