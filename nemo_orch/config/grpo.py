"""``grpo.*``: the RL stage and its curriculum."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from nemo_orch.config.base import _require
from nemo_orch.config.optim import OptimizerConfig


@dataclass
class CurriculumStage:
    """One stage of the GRPO curriculum: the tools every task offers (null: all declared), until
    step ``until_step`` is done or until a step's mean reward reaches ``until_reward``
    (whichever comes first; neither: to the end, which only the last stage may do)."""

    # The names of the tools every task offers in this stage (null: all declared).
    tools: Optional[list[str]] = None
    until_step: Optional[int] = None
    until_reward: Optional[float] = None

    def __post_init__(self) -> None:
        _require(
            self.tools is None or len(self.tools) > 0,
            "grpo.curriculum: a stage's tools must be null (all) or non-empty",
        )
        _require(
            self.until_step is None or self.until_step >= 1,
            "grpo.curriculum: until_step must be >= 1",
        )


@dataclass
class AsyncGRPOConfig:
    """``grpo.async_grpo``: rollouts run ahead of training (NeMo-RL's async GRPO).

    The rollouts of step ``s`` start once the engine holds the weights of step
    ``s - 1 - max_trajectory_age_steps`` or later, on a background event loop (or the Ray pool's
    workers), while the trainer trains; the weights are refitted when each step ends, into
    episodes in flight (which continue on them from their next turn: in-flight weight
    updates). A group whose oldest turn was written by weights more than
    ``max_trajectory_age_steps`` updates older than the trainer's is dropped
    (``async/dropped_groups``); 0 is synchronous GRPO on a background loop. Stale
    samples need an old-policy term that knows them: ``grpo.old_logprobs=engine``, or
    ``grpo.importance_sampling_cap`` (decoupled PPO, as NeMo-RL's)."""

    # Run the rollouts ahead of training.
    enabled: bool = False
    max_trajectory_age_steps: int = 1

    def __post_init__(self) -> None:
        _require(
            self.max_trajectory_age_steps >= 0,
            "grpo.async_grpo.max_trajectory_age_steps must be >= 0",
        )


@dataclass
class PPOConfig:
    """``grpo.ppo``: PPO's critic and advantages (``grpo.algo=ppo``; verl's and NeMo-Aligner's
    PPO with a critic).

    The critic is a model of its own: the policy's Qwen3 trunk with a scalar value head in place
    of the vocabulary projection, the same TP/PP layout, its own optimizer (``critic_optim``)
    and checkpoints (``<run>/critic/``). It starts from ``critic_init_from`` (a critic
    checkpoint) or, when null, from the policy's starting trunk with a zero head. Advantages are
    GAE (``gamma``, ``lam``) over the tokens the policy wrote, the trajectory's reward on its last
    policy token; observation tokens are skipped (the next policy token's value bootstraps
    across them), not zeroed. The KL to the reference (``grpo.kl_coef``, ``grpo.kl_type``) is a
    per-token penalty in the reward (``use_kl_in_reward``, as verl's) or a term of the policy
    loss (as GRPO's). ``whiten_advantages``: zero mean, unit variance over the global batch's
    policy tokens; ``whiten_values``: the critic predicts returns normalized by their running
    mean and variance (kept with its checkpoints), de-normalized for GAE. The value loss is
    clipped to ``value_clip`` around the values before the update (null: unclipped).
    ``critic_warmup_steps``: the first steps train the critic only."""

    gamma: float = 1.0
    lam: float = 1.0
    use_kl_in_reward: bool = False
    whiten_advantages: bool = True
    whiten_values: bool = True
    value_clip: Optional[float] = 0.2
    critic_optim: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=1e-3, min_lr=1e-3, warmup_steps=0)
    )
    critic_init_from: Optional[str] = None
    critic_warmup_steps: int = 0

    def __post_init__(self) -> None:
        _require(
            0 < self.gamma <= 1 and 0 <= self.lam <= 1,
            "grpo.ppo.gamma must be in (0, 1] and grpo.ppo.lam in [0, 1]",
        )
        _require(
            self.value_clip is None or self.value_clip > 0,
            "grpo.ppo.value_clip must be null or > 0",
        )
        _require(self.critic_warmup_steps >= 0, "grpo.ppo.critic_warmup_steps must be >= 0")
        self.critic_optim.check("grpo.ppo.critic_optim")


@dataclass
class GRPOConfig:
    """The RL stage of ``nemo-orch train``: GRPO on the Megatron policy.

    Per step, ``prompts_per_step`` tasks x ``rollout.group_size`` episodes are rolled out;
    groups are filtered and, with ``dynamic_sampling``, more are generated (at most
    ``max_sampling_rounds`` rounds) until the batch is full; then ``updates_per_step`` optimizer
    steps run over ``mini_batches`` of the samples. Loss: clipped ratio (``clip_low``,
    ``clip_high``), dual clip ``dual_clip`` (0: off), KL to the frozen start policy (``kl_type``
    k3|mse, ``kl_coef``), token-mean aggregation. ``importance_sampling_cap``: weight each
    token's clipped surrogate by the truncated importance ratio min(p_trainer / p_engine, cap) of
    the old policy to the engine that sampled it (truncated IS, as NeMo-RL's and verl's
    correction of the engine-vs-trainer mismatch, and of staleness under ``async_grpo``; null:
    off, the mismatch only logged). ``old_logprobs``: the ratio's old policy, the trainer's
    log-probabilities before the update (``trainer``) or the behaviour policy's, as the engine
    reported them (``engine``: standard off-policy PPO, the clip then bounds the step from the
    policy that sampled). ``kl_guard``: a step whose samples' mean KL to
    the start policy, measured before its update, passes this skips the update and rolls back
    the one before it, whose weights sampled them (a rejected step, as a trust region; counted;
    the optimizer's moments are kept; null: off).
    ``sample_mode``: whole trajectories, or one sample per turn. ``advantage_tokens``: the
    advantage drives every policy token (``all``), or only the routing decisions (``decisions``: which tool, which expert, or to answer now; see
    ``rollout.format.decision_end``), leaving the copying of arguments and answers to what SFT
    taught, held by the KL term, so a costly route's negative advantage does not erode the
    copying that a cheap route needs. ``explore_share``: the share of each group's episodes
    whose first turn is forced to start with the routing choice (a tool, or a tool with one
    value of its choice argument) the policy itself chose least in the previous step (directed
    exploration: choices it has stopped making keep being tried, and scored).
    ``explore_models``: the chance that any other turn whose call has a choice argument (an
    expert model) is written again from a call of the same tool with another value, drawn
    uniformly (exploration of the model at every call, not only the first). Forced tokens are
    trained on with their episode's advantage but kept out of the KL term.
    ``preference_sets``: each task drawn is rolled out under every preference its environment
    can state (the offline world's: the family's), a group each, until the step's
    ``prompts_per_step`` groups: the same question with each instruction side by side in one
    batch, so the update learns what the preference changes, not what a preference's share of
    the batch favours (environments without preferences draw as usual).
    ``step_advantage_weight``: credit per call as well as per episode (GiGPO's step-level
    advantage): the turns of a group's episodes that start from the same state (the same tokens
    so far: prompt, earlier calls, their observations) are compared among themselves, and each
    turn's tokens get this weight times that advantage on top of the episode's (0: off), so the
    choice at each call has a signal of its own. ``prefix_sharing``: the samples of a
    micro-batch that share a prefix (a group's prompt, an episode's earlier turns) are packed
    as a token tree, so the policy's, the reference's and the critic's forward and backward
    passes compute each shared prefix once, with the same log-probabilities and gradients
    (:mod:`nemo_orch.train.prefix_sharing`): ``on``, ``off``, or ``auto``: on where the
    policy's attention takes a tree mask (the local layer spec's fused attention, on CPU; not
    Transformer Engine's yet). ``curriculum``:
    stages that widen the tool set (e.g. basic tools, then experts); empty: all tools always.
    Every ``val_interval`` steps (0: never) the policy runs greedily on ``val_tasks`` tasks of
    each source's validation split (``val/<source>/...`` metrics).

    ``algo``: ``grpo`` (group-relative advantages) or ``ppo`` (a critic and GAE). Only PPO has
    ``ppo``; only GRPO has ``dynamic_sampling`` (a group whose rewards are all alike has no
    signal for a group baseline; a critic learns from it) and ``async_grpo``;
    ``conf/grpo/ppo.yaml`` sets them for PPO. Both share the rollouts, the clipped policy loss,
    the KL to the start policy and its guard.
    """

    algo: str = "grpo"
    # GRPO steps (rollouts, then updates).
    max_steps: int = 40
    prompts_per_step: int = 8
    updates_per_step: int = 1
    mini_batches: int = 1
    # Samples per forward/backward pass.
    micro_batch_size: int = 8
    # A constant learning rate; weight decay, betas and clipping as SFT's.
    optim: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=2.5e-4, min_lr=2.5e-4, warmup_steps=0)
    )
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 3.0
    importance_sampling_cap: Optional[float] = None
    old_logprobs: str = "trainer"
    kl_type: str = "k3"
    kl_coef: float = 0.1
    kl_guard: Optional[float] = 0.5
    sample_mode: str = "trajectory"
    advantage_tokens: str = "decisions"
    explore_share: float = 0.0
    explore_models: float = 0.0
    preference_sets: bool = False
    step_advantage_weight: float = 0.0
    prefix_sharing: str = "auto"
    curriculum: list[CurriculumStage] = field(default_factory=list)
    dynamic_sampling: bool = True
    max_sampling_rounds: int = 2
    # Save a checkpoint every this many steps (and at the last).
    save_interval: int = 10
    # Keep a journal of the episodes' turns and calls (<stage>/episodes.db): a step killed
    # midway resumes each episode from its last completed turn (nemo_orch/rollout/journal.py;
    # the local backend's rollouts, not Ray's workers).
    journal: bool = True
    val_interval: int = 0
    val_tasks: int = 32
    async_grpo: AsyncGRPOConfig = field(default_factory=AsyncGRPOConfig)
    # PPO's critic and GAE (grpo.algo=ppo, which conf/grpo/ppo.yaml sets); null for GRPO.
    ppo: Optional[PPOConfig] = None

    def __post_init__(self) -> None:
        _require(self.algo in ("grpo", "ppo"), f"grpo.algo must be grpo|ppo, got {self.algo!r}")
        if self.algo == "ppo":
            _require(
                self.ppo is not None,
                "grpo.algo=ppo needs grpo.ppo (the critic and GAE settings): choose grpo=ppo",
            )
            for name, value in (
                ("dynamic_sampling", self.dynamic_sampling),
                ("async_grpo.enabled", self.async_grpo.enabled),
            ):
                _require(
                    not value,
                    f"grpo.{name}=true is GRPO's (refilling groups whose rewards "
                    "are all alike; rollouts run ahead): set it false with grpo.algo=ppo",
                )
            _require(
                self.sample_mode == "trajectory",
                "grpo.sample_mode=turn is GRPO's: PPO's GAE runs over whole trajectories",
            )
        else:
            _require(
                self.ppo is None,
                "grpo.ppo is PPO's (a critic and GAE): set grpo.algo=ppo "
                "(grpo=ppo) or leave grpo.ppo null",
            )
        for name in (
            "max_steps",
            "prompts_per_step",
            "updates_per_step",
            "mini_batches",
            "micro_batch_size",
            "max_sampling_rounds",
            "save_interval",
        ):
            _require(getattr(self, name) >= 1, f"grpo.{name} must be >= 1")
        self.optim.check("grpo.optim")
        _require(self.clip_low > 0 and self.clip_high > 0, "grpo.clip_low/high must be > 0")
        _require(self.dual_clip == 0 or self.dual_clip > 1, "grpo.dual_clip must be 0 or > 1")
        _require(
            self.importance_sampling_cap is None or self.importance_sampling_cap >= 1,
            "grpo.importance_sampling_cap must be null or >= 1",
        )
        _require(
            self.prefix_sharing in ("auto", "on", "off"),
            f"grpo.prefix_sharing must be auto|on|off, got {self.prefix_sharing!r}",
        )
        _require(
            self.old_logprobs in ("trainer", "engine"),
            f"grpo.old_logprobs must be trainer|engine, got {self.old_logprobs!r}",
        )
        _require(
            self.old_logprobs == "trainer" or self.importance_sampling_cap is None,
            "grpo.importance_sampling_cap weighs the trainer's old log-probabilities "
            "against the engine's: with grpo.old_logprobs=engine the ratio is already to "
            "the engine (set one of them)",
        )
        _require(
            not self.async_grpo.enabled
            or self.async_grpo.max_trajectory_age_steps == 0
            or self.old_logprobs == "engine"
            or self.importance_sampling_cap is not None,
            "grpo.async_grpo trains on samples of older weights: set "
            "grpo.old_logprobs=engine or grpo.importance_sampling_cap (e.g. 2.0) so the "
            "loss corrects for them",
        )
        _require(
            self.kl_type in ("k3", "mse"), f"grpo.kl_type must be k3|mse, got {self.kl_type!r}"
        )
        _require(self.kl_coef >= 0, "grpo.kl_coef must be >= 0")
        _require(self.kl_guard is None or self.kl_guard > 0, "grpo.kl_guard must be null or > 0")
        _require(
            self.sample_mode in ("trajectory", "turn"),
            f"grpo.sample_mode must be trajectory|turn, got {self.sample_mode!r}",
        )
        _require(
            self.advantage_tokens in ("all", "decisions"),
            f"grpo.advantage_tokens must be all|decisions, got {self.advantage_tokens!r}",
        )
        _require(0 <= self.explore_share < 1, "grpo.explore_share must be in [0, 1)")
        _require(0 <= self.explore_models < 1, "grpo.explore_models must be in [0, 1)")
        _require(self.step_advantage_weight >= 0, "grpo.step_advantage_weight must be >= 0")
        _require(
            self.algo == "grpo" or self.step_advantage_weight == 0,
            "grpo.step_advantage_weight is GRPO's (group baselines per state): PPO's "
            "critic gives each token its own advantage already",
        )
        for index, stage in enumerate(self.curriculum):
            ends = stage.until_step is not None or stage.until_reward is not None
            last = index == len(self.curriculum) - 1
            _require(
                ends != last,
                f"grpo.curriculum[{index}]: every stage but the last needs "
                "until_step or until_reward, and the last neither",
            )
        _require(
            self.val_interval >= 0 and self.val_tasks >= 1,
            "grpo.val_interval must be >= 0 (0: no validation) and grpo.val_tasks >= 1",
        )
