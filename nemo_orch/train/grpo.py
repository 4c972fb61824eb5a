"""GRPO recipe: the RL stage of ``nemo-orch train``, on the Megatron policy.

Read top to bottom. Each step: rank 0 rolls out ``grpo.prompts_per_step`` tasks x
``rollout.group_size`` episodes with the rollout engine (``rollout.engine``; on Ray's workers with
``rollout.backend=ray``; :mod:`nemo_orch.train.grpo_rollouts`) and the real tools, scores the
groups (:mod:`nemo_orch.reward`), filters them and, with dynamic sampling, rolls out more until the
batch is full; the samples (:mod:`nemo_orch.train.grpo_samples`) go to every rank; the trainer
recomputes the old log-probabilities (and logs their mismatch with the engine's), the frozen
reference's, and runs ``updates_per_step`` passes over ``mini_batches`` optimizer steps
(:func:`_update`); then the new weights are synced into the engine and, every
``save_interval`` steps, checkpointed. A resumed run continues from its last checkpoint;
tasks and sampling seeds depend on the step only.

With ``grpo.async_grpo.enabled`` the rollouts of the next steps run ahead on the rollout loop's
thread while the trainer trains (at most ``max_trajectory_age_steps`` updates behind); the
refit reaches episodes in flight, every turn records the weights' version, groups too old for
the trainer are dropped, and a killed run resumes from its checkpoint with nothing in flight
(``trained.jsonl`` lists each step's samples).

With ``grpo.algo=ppo`` (``grpo=ppo``) the advantages come from a critic instead of the group:
GAE over the policy's tokens, the critic trained beside the policy on the same micro-batches and
checkpointed with it (:mod:`nemo_orch.train.ppo`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_orch import config as config_lib
from nemo_orch import distributed, faults
from nemo_orch.config import Config, ConfigError, GRPOConfig
from nemo_orch.distributed import ParallelContext
from nemo_orch.models import checkpoint, qwen3, weights
from nemo_orch.models.tokenizer import load_tokenizer
from nemo_orch.seeding import derive_seed
from nemo_orch.train import curriculum, ppo, preemption
from nemo_orch.train.grpo_loss import grpo_token_loss, kl_penalty
from nemo_orch.train.grpo_rollouts import build_rollouts
from nemo_orch.train.grpo_samples import Sample, even_split, micro_batches, samples_of
from nemo_orch.train.metrics import MetricsLogger, TrainedLog, logged_steps
from nemo_orch.train.policy import (
    Batch,
    Critic,
    Policy,
    ReferenceModel,
    TokenLossFn,
    load_start_weights,
    start_architecture,
)

log = logging.getLogger(__name__)


@dataclass
class GRPOSummary:
    start_step: int
    end_step: int
    first_reward: float | None
    last_reward: float | None
    checkpoint: Path | None
    run_dir: Path


def policy_config(config: Config) -> Config:
    """The config the Megatron policy is built from for this stage: the optimizer of
    ``grpo.optim``, its schedule over GRPO's optimizer steps."""
    grpo = config.grpo
    trainer = dataclasses.replace(
        config.trainer,
        optim=grpo.optim,
        max_steps=grpo.max_steps * grpo.updates_per_step * grpo.mini_batches,
        micro_batch_size=grpo.micro_batch_size,
        global_batch_size=grpo.micro_batch_size * config.parallel.dp,
        save_interval=grpo.save_interval,
    )
    return dataclasses.replace(config, trainer=trainer)


# ----------------------------------------------------------------------------- the loop


def _start(policy: Policy, config: Config) -> checkpoint.Checkpoint | None:
    """Resume from this stage's latest checkpoint (returned), or start from
    ``trainer.init_from`` (the SFT checkpoint, or an HF directory; None returned)."""
    latest = checkpoint.latest_checkpoint(checkpoint.checkpoints_dir(config))
    if latest is not None:
        checkpoint.load(latest, policy.module, policy.optimizer, policy.scheduler)
        log.info("resumed GRPO from %s", latest.path)
        return latest
    load_start_weights(policy.module, config.model, Path(config.trainer.init_from))
    policy.optimizer.reload_model_params()
    return None


def run(config: Config) -> GRPOSummary:
    """GRPO from ``trainer.init_from`` into ``config.run.dir``, in its own process group."""
    with distributed.parallel_session(config.parallel, config.run.seed) as context:
        return train(config, context)


def start_model(config: Config, command: str = "grpo") -> Config:
    """``config`` starting from its resolved starting point (:func:`start_point`: the
    checkpoint or HF directory in ``trainer.init_from``, the tokenizer in ``tokenizer.path``),
    with the architecture of those weights (an HF directory's ``config.json``, or the model
    section a nemo-orch checkpoint saved): the weights decide the shape, so ``model.*`` need not
    repeat it; the fields taken are logged. ``command``: the ``nemo-orch`` command an error
    names."""
    init_from, tokenizer_dir = start_point(config, command)
    architecture = start_architecture(init_from, config.model)
    changed = [
        f"{name} {getattr(config.model, name)} -> {value}"
        for name, value in architecture.items()
        if getattr(config.model, name) != value
    ]
    if changed:
        log.info("model.* from the starting weights %s: %s", init_from, ", ".join(changed))
    tokenizer = dataclasses.replace(
        config.tokenizer, path=str(tokenizer_dir), vocab_size=len(load_tokenizer(tokenizer_dir))
    )
    return config_lib.replace(
        config,
        model=dataclasses.replace(config.model, **architecture),
        tokenizer=tokenizer,
        trainer=dataclasses.replace(config.trainer, init_from=str(init_from)),
    )


def start_point(config: Config, command: str = "grpo") -> tuple[Path, Path]:
    """``nemo-orch grpo``'s (or ``command``'s) starting weights (``trainer.init_from``) and the
    tokenizer their token ids belong to: the checkpoint's own, the HF directory's, else
    ``tokenizer.path``."""
    if config.trainer.init_from is None:
        raise ConfigError(
            f"nemo-orch {command} needs trainer.init_from: a nemo-orch checkpoint "
            "(e.g. runs/tiny-sft/sft/checkpoints) or an HF model directory"
        )
    source = Path(config.trainer.init_from)
    if (source / "tokenizer.json").is_file():
        return source, source
    if not (source / "config.json").is_file():
        opened = checkpoint.open_checkpoint(source)
        if (opened.tokenizer_path / "tokenizer.json").is_file():
            return opened.path, opened.tokenizer_path
        source = opened.path
    if config.tokenizer.path is None:
        raise ConfigError(f"trainer.init_from={source} has no tokenizer: set tokenizer.path")
    return source, Path(config.tokenizer.path)


def train(config: Config, context: ParallelContext) -> GRPOSummary:
    """GRPO inside a running parallel session (see :func:`run`), from ``trainer.init_from`` with
    the tokenizer of ``config.tokenizer_dir``."""
    _check_backend(config)
    config = policy_config(config)
    grpo = config.grpo
    distributed.set_intra_op_threads(config.trainer.num_threads)
    tokenizer = load_tokenizer(config.tokenizer_dir)
    policy = Policy(config, context)
    resumed = _start(policy, config)
    start_step = resumed.step if resumed is not None else 0
    reference = ReferenceModel(config, context)
    # The reference is the stage's starting point (the SFT policy), also on resume.
    load_start_weights(reference.module, config.model, Path(config.trainer.init_from))
    critic = (
        ppo.start_critic(config, context, resumed.step if resumed is not None else None)
        if grpo.algo == "ppo"
        else None
    )
    hf = weights.gather_hf_weights(policy.module, config.model, config.rollout.refit_bucket_mb)
    # What a resumed run needs from the steps before it: every step's mean reward (the
    # curriculum's stage depends on them) and the last step's choices (exploration's).
    logged = logged_steps(config.run.dir, start_step)
    history = [record.get("reward", math.nan) for record in logged]
    # Rank 0 rolls out; every rank trains on what it broadcasts.
    rollouts = build_rollouts(config, tokenizer, hf, logged) if distributed.is_writer() else None
    metrics = MetricsLogger.for_stage(
        config,
        grpo.algo,
        enabled=context.is_logging_rank,
        start_step=start_step,
        max_steps=grpo.max_steps,
        shown=("reward", "kl", "loss"),
    )
    # PPO with the KL in the reward: none in the policy loss.
    loss_fn = grpo_token_loss(
        dataclasses.replace(grpo, kl_coef=0.0)
        if grpo.ppo is not None and grpo.ppo.use_kl_in_reward
        else grpo
    )
    learner = Learner(
        policy,
        reference,
        loss_fn,
        context.dp_rank,
        tokenizer.pad_token_id,
        critic=critic,
        share_prefixes=shares_prefixes(config),
    )
    rewards, saved = [], resumed.path if resumed is not None else None
    before_update = None  # the weights before the last update (with grpo.kl_guard)
    ahead = grpo.async_grpo.enabled
    trained_log = TrainedLog(config.run.dir, start_step, enabled=distributed.is_writer())
    preemption.listen()
    with rollouts or contextlib.nullcontext(), contextlib.closing(metrics):
        if rollouts is not None and ahead:
            rollouts.run_ahead(
                start_step + 1,
                grpo.max_steps,
                lambda: curriculum.stage_tools(grpo.curriculum, history),
            )
        for step in range(start_step + 1, grpo.max_steps + 1):
            faults.maybe_kill("step", step)
            started = time.perf_counter()
            shared = [None]
            if rollouts is not None:
                batch = (
                    rollouts.take(step)
                    if ahead
                    else rollouts.step(step, curriculum.stage_tools(grpo.curriculum, history))
                )
                shared = [
                    (
                        samples_of(batch.kept, config),
                        {
                            **batch.metrics(),
                            "curriculum/stage": curriculum.stage_index(grpo.curriculum, history),
                        },
                    )
                ]
                trained_log.add(
                    step,
                    [sample.sample_id for sample in shared[0][0]],
                    [group.task.id for group in batch.dropped_stale],
                )
                rollouts.sleep()
            if dist.get_world_size() > 1:
                dist.broadcast_object_list(shared, src=0)
            samples, step_metrics = shared[0]
            rollout_seconds = time.perf_counter() - started

            train_started = time.perf_counter()
            start = policy.copy_weights() if grpo.kl_guard is not None else None
            trained = _update(learner, samples, config, step, rollback=before_update)
            if "skipped_update" not in trained:  # what the guard rolls back to
                before_update = start
            train_seconds = time.perf_counter() - train_started

            step_metrics.update(trained)
            step_metrics.update(
                {
                    "time/rollout_s": rollout_seconds,
                    "time/train_s": train_seconds,
                    "samples": len(samples),
                }
            )
            # Before the refit: rollouts run ahead read the curriculum's stage from it.
            history.append(step_metrics.get("reward", math.nan))
            refit_started = time.perf_counter()
            stream = weights.hf_weight_buckets(
                policy.module, config.model, config.rollout.refit_bucket_mb << 20
            )
            if rollouts is not None:
                rollouts.refit(stream, version=step)
            else:
                for _ in stream:  # the other ranks send their shards (rank 0 yields buckets)
                    pass
            step_metrics["time/refit_s"] = time.perf_counter() - refit_started
            step_metrics["time/step_s"] = time.perf_counter() - started
            metrics.log(step, step_metrics)
            if "reward" in step_metrics:
                rewards.append(step_metrics["reward"])
            stopping = step < grpo.max_steps and preemption.agreed()
            if step % grpo.save_interval == 0 or step == grpo.max_steps or stopping:
                if critic is not None:
                    ppo.save_critic(config, step, critic)
                saved = checkpoint.save(
                    config,
                    step,
                    policy.module,
                    policy.optimizer,
                    policy.scheduler,
                    tokenizer_dir=config.tokenizer_dir,
                )
            if stopping:
                raise preemption.StopRequested(step, saved)
    return GRPOSummary(
        start_step,
        max(start_step, grpo.max_steps),
        rewards[0] if rewards else None,
        rewards[-1] if rewards else None,
        saved,
        config.run.dir,
    )


def _check_backend(config: Config) -> None:
    """What runs only on one source of declared tools: Ray's workers build the configured
    tools (no domain's, no tau2's), and exploration forces choices of one toolbox."""
    sources = config.env.source_list()
    if config.rollout.backend == "ray" and (
        len(sources) > 1 or sources[0].kind not in ("offline", "qa", "tasks")
    ):
        raise ConfigError(
            "rollout.backend=ray runs one environment with declared tools only "
            "(env=offline|qa|tasks); use rollout.backend=local for "
            f"env={config.env.label}"
        )
    if config.grpo.explore_share > 0 and len(sources) > 1:
        raise ConfigError(
            "grpo.explore_share forces routing choices of one toolbox: it needs a "
            "single environment, not a mixture"
        )


@dataclass(frozen=True)
class Learner:
    """What every update of the run trains and reads on this rank, built once by :func:`train`:
    the policy and its loss, the frozen reference, PPO's critic (None for GRPO), and what cuts
    this rank's micro-batches (its DP rank, the tokenizer's pad id, whether they are packed to
    share prefixes: :func:`shares_prefixes`)."""

    policy: Policy
    reference: ReferenceModel
    loss_fn: TokenLossFn
    dp_rank: int
    pad_id: int
    critic: Critic | None = None
    share_prefixes: bool = False


def shares_prefixes(config: Config) -> bool:
    """Whether the update packs prefix-shared micro-batches: ``grpo.prefix_sharing``, whose
    ``auto`` is on where the policy's attention takes their tree mask."""
    refusal = qwen3.tree_mask_refusal(config.model, on_gpu=torch.cuda.is_available())
    if config.grpo.prefix_sharing == "on" and refusal is not None:
        raise ConfigError(
            f"grpo.prefix_sharing=on needs an attention that takes a token tree's mask, the "
            f"local layer spec on CPU: {refusal}. Use auto or off here"
        )
    return config.grpo.prefix_sharing == "on" or (
        config.grpo.prefix_sharing == "auto" and refusal is None
    )


# Per metric, its value at each optimizer step (and PPO's advantages), averaged at the end.
Totals = defaultdict[str, list[float]]


def _update(
    learner: Learner,
    samples: list[Sample],
    config: Config,
    step: int,
    rollback: list[torch.Tensor] | None = None,
) -> dict[str, float]:
    """``updates_per_step`` passes of ``mini_batches`` optimizer steps over this DP rank's share
    of the samples (:func:`_rank_mini_batches`), with old and reference logprobs (and PPO's
    values) computed before the first update (:func:`_attach_forward_passes`); none with
    ``grpo.kl_guard`` passed by the samples' mean KL to the reference before it
    (:func:`_kl_guard`, which also rolls back to the ``rollback`` weights). With PPO's critic,
    the GAE advantages and value targets come next (:func:`ppo.attach_advantages`), then the
    optimizer steps (:func:`_optimizer_passes`). A step the guard skips trains neither the
    policy nor the critic. Returns each metric's mean over the optimizer steps, the tokens
    stepped on and computed, and the guard's metrics."""
    grpo = config.grpo
    if len(samples) < grpo.mini_batches * config.parallel.dp * grpo.micro_batch_size:
        return {"skipped_update": 1.0}
    minis = _rank_mini_batches(samples, config, step, learner)
    kl_terms = _attach_forward_passes(minis, learner, grpo)
    guard: dict[str, float] = {}
    if grpo.kl_guard is not None:
        guard = _kl_guard(kl_terms, grpo.kl_guard, learner.policy, rollback)
        if "skipped_update" in guard:
            return guard
    totals: Totals = defaultdict(list)
    if learner.critic is not None:
        _collect(
            totals, ppo.attach_advantages(minis, learner.critic, grpo.ppo, grpo.kl_coef).items()
        )
    tokens, computed = _optimizer_passes(minis, learner, config, step, totals)
    return {
        **{key: statistics.mean(values) for key, values in totals.items()},
        "tokens": tokens,
        "tokens_computed": computed,
        **guard,
    }


def _rank_mini_batches(
    samples: list[Sample], config: Config, step: int, learner: Learner
) -> list[list[Batch]]:
    """This DP rank's micro-batches of each mini-batch: the samples shuffled by the step's seed
    into ``mini_batches`` equal parts, each cut into equal DP shares (one fixed shuffle, alike
    on every rank) and trimmed to whole micro-batches, so that every rank runs as many
    micro-batches in every mini-batch (of one length under pipeline parallelism). Sharing
    prefixes changes which samples share a micro-batch, never which a mini-batch holds."""
    grpo = config.grpo
    split = random.Random(derive_seed(config.run.seed, "mini", step))
    minis = []
    for mini in even_split(samples, grpo.mini_batches, split):
        mine = even_split(mini, config.parallel.dp, random.Random(0))[learner.dp_rank]
        mine = mine[: len(mine) // grpo.micro_batch_size * grpo.micro_batch_size]
        minis.append(
            micro_batches(
                mine,
                grpo.micro_batch_size,
                learner.pad_id,
                one_length=config.parallel.pp > 1,
                share_prefixes=learner.share_prefixes,
            )
        )
    return minis


def _attach_forward_passes(
    minis: list[list[Batch]], learner: Learner, grpo: GRPOConfig
) -> list[torch.Tensor]:
    """Before the first update, each mini-batch's forward passes, attached to its micro-batches:
    the policy's (:func:`_attach_old_logprobs`), then the reference's with the KL between them
    (:func:`_attach_reference_and_kl`), then PPO's critic's (:func:`_attach_values`). Returns
    the guard's [KL sum, token count] of each micro-batch, in order (none without the guard)."""
    kl_in_reward = learner.critic is not None and grpo.ppo.use_kl_in_reward
    kl_terms = []
    # One mini-batch after the other and in this order on every rank: under tensor or pipeline
    # parallelism each forward pass is a collective.
    for batches in minis:
        olds = _attach_old_logprobs(batches, learner.policy, grpo, kl_in_reward)
        kl_terms += _attach_reference_and_kl(batches, olds, learner.reference, grpo, kl_in_reward)
        if learner.critic is not None:
            _attach_values(batches, learner.critic)
    return kl_terms


def _attach_old_logprobs(
    batches: list[Batch], policy: Policy, grpo: GRPOConfig, kl_in_reward: bool
) -> list[torch.Tensor | None]:
    """The loss's ``old_logprobs``: the engine's with ``grpo.old_logprobs=engine``, else the
    policy's before the update. Returns the policy's (None off the last pipeline stage, and
    where its forward pass was not needed)."""
    # The trainer's old logprobs, unless the engine's are the old ones or, with one update per
    # batch, this pass's own detached values are (see grpo_loss): that saves a forward pass,
    # unless the KL (the guard's or the reward's) needs the policy's logprobs anyway.
    trainer_old = grpo.old_logprobs == "trainer" and not (
        grpo.updates_per_step == 1 and grpo.mini_batches == 1
    )
    needed = trainer_old or grpo.kl_guard is not None or kl_in_reward
    olds = policy.forward_logprobs(batches) if needed else [None] * len(batches)
    for batch, old in zip(batches, olds):
        if grpo.old_logprobs == "engine":
            batch["old_logprobs"] = batch["engine_logprobs"]
        elif old is not None and trainer_old:
            batch["old_logprobs"] = old
    return olds


def _attach_reference_and_kl(
    batches: list[Batch],
    olds: list[torch.Tensor | None],
    reference: ReferenceModel,
    grpo: GRPOConfig,
    kl_in_reward: bool,
) -> list[torch.Tensor]:
    """The reference's logprobs (with a KL term or the guard): the loss's ``ref_logprobs``, or,
    with PPO's KL in the reward, the per-token KL of the policy's ``olds`` to them on the tokens
    the policy drew (``reward_kl``). Returns the guard's [KL sum, token count] per micro-batch
    that has them (the last pipeline stage's)."""
    guarded = grpo.kl_guard is not None
    refs = (
        reference.forward_logprobs(batches)
        if grpo.kl_coef > 0 or guarded
        else [None] * len(batches)
    )
    kl_terms = []
    for batch, old, ref in zip(batches, olds, refs):
        if ref is not None and not kl_in_reward:
            batch["ref_logprobs"] = ref
        if old is None or ref is None or not (kl_in_reward or guarded):
            continue  # off the last pipeline stage, or no KL wanted
        kl = kl_penalty(old, ref, grpo.kl_type) * batch["kl_mask"]
        if kl_in_reward:
            batch["reward_kl"] = kl
        if guarded:
            kl_terms.append(torch.stack([kl.sum(), batch["kl_mask"].sum()]).double())
    return kl_terms


def _attach_values(batches: list[Batch], critic: Critic) -> None:
    """PPO's critic's values before the update (``values``; none off the last pipeline stage),
    which :func:`ppo.attach_advantages` turns into GAE advantages and value targets."""
    for batch, value in zip(batches, critic.forward_values(batches)):
        if value is not None:
            batch["values"] = value


def _kl_guard(
    kl_terms: list[torch.Tensor],
    threshold: float,
    policy: Policy,
    rollback: list[torch.Tensor] | None,
) -> dict[str, float]:
    """The samples' mean KL to the reference before the update (``kl_guard/kl``, a collective).
    Past ``threshold`` the update is skipped (``kl_guard/skipped``, ``skipped_update``) and the
    policy goes back to the ``rollback`` weights (those before the update that produced the
    samples' policy; ``kl_guard/rolled_back``). The rollback restores the policy only: PPO's
    critic learned values, not a policy that jumped."""
    kl_sums = torch.zeros(2, dtype=torch.float64)
    for term in kl_terms:  # one at a time, in order: the sums' rounding stays the same
        kl_sums += term
    # Every rank decides alike: the sums of all ranks (a tensor-parallel group's ranks hold the
    # same tokens, which leaves the mean as it is; other pipeline stages hold none).
    if dist.is_initialized():
        dist.all_reduce(kl_sums)
    guard = {"kl_guard/kl": float(kl_sums[0] / kl_sums[1]) if kl_sums[1] > 0 else 0.0}
    if guard["kl_guard/kl"] > threshold:
        if rollback is not None:
            policy.restore_weights(rollback)
            guard["kl_guard/rolled_back"] = 1.0
        return {**guard, "kl_guard/skipped": 1.0, "skipped_update": 1.0}
    return guard


def _optimizer_passes(
    minis: list[list[Batch]], learner: Learner, config: Config, step: int, totals: Totals
) -> tuple[int, int]:
    """``updates_per_step`` passes over the mini-batches, an optimizer step of the policy on
    each (:func:`_policy_step`) followed, with PPO, by one of the critic on the same
    micro-batches (:func:`_critic_step`; only the critic's in the first
    ``grpo.ppo.critic_warmup_steps`` steps). Their metrics go into ``totals``; returns the
    tokens stepped on and those the forward passes computed, over every DP rank (padding
    included; fewer computed than stepped on where prefixes are shared)."""
    grpo, critic = config.grpo, learner.critic
    trains_policy = critic is None or step > grpo.ppo.critic_warmup_steps
    value_loss = ppo.value_loss(grpo.ppo) if critic is not None else None
    tokens = computed = 0
    for _ in range(grpo.updates_per_step):
        for batches in minis:
            tokens += sum(batch["labels"].numel() for batch in batches) * config.parallel.dp
            computed += sum(batch["tokens"].numel() for batch in batches) * config.parallel.dp
            if trains_policy:
                _collect(totals, _policy_step(learner.policy, batches, learner.loss_fn))
            if critic is not None:
                _collect(totals, _critic_step(critic, batches, value_loss))
    return tokens, computed


def _policy_step(
    policy: Policy, batches: list[Batch], loss_fn: TokenLossFn
) -> list[tuple[str, float]]:
    """One optimizer step of the policy; its loss, grad norm, learning rate and loss metrics."""
    result = policy.train_step(batches, loss_fn)
    return [
        ("loss", result.loss),
        ("grad_norm", result.grad_norm),
        ("lr", result.lr),
        *result.metrics.items(),
    ]


def _critic_step(
    critic: Critic, batches: list[Batch], value_loss: TokenLossFn
) -> list[tuple[str, float]]:
    """One optimizer step of PPO's critic; its grad norm and value-loss metrics."""
    result = critic.train_step(batches, value_loss)
    return [("critic/grad_norm", result.grad_norm), *result.metrics.items()]


def _collect(totals: Totals, metrics: Iterable[tuple[str, float]]) -> None:
    # Appended one by one: a key that comes twice counts twice, as it always has.
    for key, value in metrics:
        totals[key].append(value)
