"""Supervised fine-tuning recipe: chat conversations, loss on assistant tokens only.

Read top to bottom: tokenizer and data (a conversation file, or demonstrations: an agent's
correct episodes on the configured environment), policy and its initial weights (resume, an HF
directory or a checkpoint, or seeded), then the step loop with metrics and atomic checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_orch import distributed, faults
from nemo_orch.config import ORCHESTRATOR, Config, ConfigError
from nemo_orch.data.conversations import read_conversations, write_conversations
from nemo_orch.data.sft import SFTDataset, collate, global_batch, padded_length
from nemo_orch.distributed import ParallelContext
from nemo_orch.envs import build_environment
from nemo_orch.models import checkpoint
from nemo_orch.models import tokenizer as tokenization
from nemo_orch.models.hf_mapping import SeededHFWeights
from nemo_orch.rollout.builders import offered_schemas
from nemo_orch.train import preemption
from nemo_orch.train.metrics import MetricsLogger
from nemo_orch.train.policy import Policy, load_start_weights

log = logging.getLogger(__name__)

DEMONSTRATIONS = "demonstrations.jsonl"


@dataclass
class SFTSummary:
    start_step: int
    end_step: int
    first_loss: float | None
    last_loss: float | None
    mean_tokens_per_s: float | None
    num_samples: int
    num_dropped: int
    checkpoint: Path | None
    run_dir: Path


def tokenizer_corpus(config: Config) -> list[dict]:
    """What a tokenizer trained for the run learns: the conversation file's conversations, or
    ``env``'s own (:meth:`~nemo_orch.envs.interfaces.Environment.tokenizer_conversations`)
    offering the configured tools (their names and model aliases)."""
    data = config.data
    if data.sft_path is not None:
        return read_conversations(data.sft_path)
    schemas = offered_schemas(config.tools)
    conversations = build_environment(config).tokenizer_conversations(
        data.num_offline_conversations, config.run.seed
    )
    return [{**conversation, "tools": schemas} for conversation in conversations]


def prepare_tokenizer(config: Config) -> Any:
    """The tokenizer of ``config.tokenizer_dir``: the configured one, or one trained on
    :func:`tokenizer_corpus` into the run directory (by rank 0; kept across resumes so token ids
    never change under a checkpoint)."""
    directory = config.tokenizer_dir
    if config.tokenizer.path is None:
        if distributed.is_writer() and not (directory / "tokenizer.json").exists():
            chat_format = config.tokenizer.chat_format
            texts = (
                tokenization.render_conversation(c["messages"], c["tools"], chat_format=chat_format)
                for c in tokenizer_corpus(config)
            )
            tokenization.train_tokenizer(
                texts,
                vocab_size=config.tokenizer.vocab_size,
                min_frequency=config.tokenizer.min_frequency,
                out_dir=directory,
                chat_format=chat_format,
            )
        distributed.barrier()
    tokenizer = tokenization.load_tokenizer(directory)
    if len(tokenizer) > config.model.vocab_size:
        raise ConfigError(
            f"tokenizer {directory} has {len(tokenizer)} tokens but "
            f"model.vocab_size is {config.model.vocab_size}"
        )
    return tokenizer


def demonstrations(config: Config, tokenizer: Any) -> list[dict]:
    """The correct episodes of ``data.demo_agent`` on ``env``'s train split as conversations
    (see :class:`~nemo_orch.config.DataConfig`); ``tokenizer`` renders the episodes of every
    agent but an orchestrator, which uses its policy's."""
    from nemo_orch.eval import harness
    from nemo_orch.eval.systems import System

    data = config.data
    engine = None
    if data.demo_agent == ORCHESTRATOR:
        from nemo_orch.rollout.builders import build_engine

        engine, tokenizer = build_engine(config, max_requests=config.eval.max_requests_per_endpoint)
    system = System(data.demo_agent, data.demo_agent, engine)
    episodes = harness.successful_episodes(
        config, build_environment(config), system, 2 * data.num_offline_conversations, tokenizer
    )
    return [
        {"messages": episode.messages, "tools": episode.tools}
        for episode in episodes[: data.num_offline_conversations]
    ]


def prepare_demonstrations(config: Config, tokenizer: Any) -> Path:
    """``<run>/demonstrations.jsonl``, written once by rank 0 (atomically; a resumed run reads
    it back), the other ranks waiting."""
    path = config.run.dir / DEMONSTRATIONS
    if distributed.is_writer() and not path.exists():
        conversations = demonstrations(config, tokenizer)
        if not conversations:
            raise ConfigError(
                f"data.demo_agent={config.data.demo_agent} answered none of its "
                f"env={config.env.label} tasks right: no demonstrations"
            )
        partial = path.with_suffix(".partial")
        write_conversations(partial, conversations)
        partial.rename(path)
        log.info("wrote %d demonstrations to %s", len(conversations), path)
    distributed.barrier()
    return path


def load_conversations(config: Config, tokenizer: Any) -> list[dict]:
    """The SFT data: the configured file or the run's demonstrations, plus ``env``'s copy
    conversations (``data.num_copy_conversations``)."""
    data = config.data
    path = data.sft_path or prepare_demonstrations(config, tokenizer)
    copies = (
        build_environment(config).copy_conversations(
            data.num_copy_conversations, config.run.seed + 1
        )
        if data.num_copy_conversations
        else []
    )
    return read_conversations(path) + copies


def check_no_stale_run(config: Config) -> None:
    existing = checkpoint.latest_checkpoint(checkpoint.checkpoints_dir(config))
    if existing is not None and not config.trainer.resume:
        raise ConfigError(
            f"{existing.path.parent} already holds checkpoints (latest step "
            f"{existing.step}); set trainer.resume=true to continue, or pick another "
            f"run.name"
        )


def initialize_weights(policy: Policy, config: Config) -> checkpoint.Checkpoint | None:
    """Load the starting weights; returns the checkpoint resumed from (None: a fresh start)."""
    if config.trainer.resume:
        latest = checkpoint.latest_checkpoint(checkpoint.checkpoints_dir(config))
        if latest is not None:
            checkpoint.load(latest, policy.module, policy.optimizer, policy.scheduler)
            log.info("resumed from %s", latest.path)
            return latest
    if config.trainer.init_from is None:
        policy.load_hf_weights(SeededHFWeights(config.model, config.run.seed))
    else:
        load_start_weights(policy.module, config.model, Path(config.trainer.init_from))
        # The distributed optimizer keeps fp32 main params: refresh them from the model.
        policy.optimizer.reload_model_params()
    return None


def run(config: Config) -> SFTSummary:
    """SFT in its own process group (the ``sft`` command)."""
    with distributed.parallel_session(config.parallel, config.run.seed) as context:
        check_no_stale_run(config)
        return train(config, context, prepare_tokenizer(config))


def train(config: Config, context: ParallelContext, tokenizer: Any) -> SFTSummary:
    """SFT inside a running parallel session (see :func:`run`), with the prepared tokenizer of
    ``config.tokenizer_dir``."""
    distributed.set_intra_op_threads(config.trainer.num_threads)
    conversations = load_conversations(config, tokenizer)
    dataset = SFTDataset(tokenizer, conversations, config.data.seq_length)

    policy = Policy(config, context)
    resumed = initialize_weights(policy, config)
    start_step = resumed.step if resumed is not None else 0
    trainer = config.trainer
    metrics = MetricsLogger.for_stage(
        config,
        "sft",
        enabled=context.is_logging_rank,
        start_step=start_step,
        max_steps=trainer.max_steps,
    )
    per_rank = trainer.global_batch_size // config.parallel.dp
    losses, saved = [], resumed.path if resumed is not None else None
    preemption.listen()
    with contextlib.closing(metrics):
        for step in range(start_step + 1, trainer.max_steps + 1):
            faults.maybe_kill("step", step)
            indices = global_batch(dataset, step, trainer.global_batch_size, config.run.seed)
            mine = indices[context.dp_rank * per_rank : (context.dp_rank + 1) * per_rank]
            samples = [dataset[i] for i in mine]
            # One length for the step: a pipeline's micro-batches must share their shape.
            length = padded_length((len(s["tokens"]) for s in samples), cap=config.data.seq_length)
            micro_batches = [
                collate(samples[j : j + trainer.micro_batch_size], length, dataset.pad_id)
                for j in range(0, per_rank, trainer.micro_batch_size)
            ]
            result = policy.train_step(micro_batches)
            tokens = trainer.global_batch_size * length
            metrics.log(
                step,
                {
                    "loss": result.loss,
                    "grad_norm": result.grad_norm,
                    "lr": result.lr,
                    "loss_tokens": result.num_tokens,
                    "tokens": tokens,
                },
            )
            losses.append(result.loss)
            stopping = step < trainer.max_steps and preemption.agreed()
            if step % trainer.save_interval == 0 or step == trainer.max_steps or stopping:
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
    speeds = metrics.tokens_per_s[1:]  # the first step includes warm-up
    return SFTSummary(
        start_step=start_step,
        end_step=max(start_step, trainer.max_steps),
        first_loss=losses[0] if losses else None,
        last_loss=losses[-1] if losses else None,
        mean_tokens_per_s=sum(speeds) / len(speeds) if speeds else None,
        num_samples=len(dataset),
        num_dropped=dataset.num_dropped,
        checkpoint=saved,
        run_dir=config.run.dir,
    )
