"""The configuration tree: one validated dataclass per concern, loaded and checked once.

``conf/train.yaml`` composes the groups (``model``, ``tools``, ``reward``, ``rollout``, ``data``,
``trainer``, ``launcher``) with Hydra; the merged tree is checked against :class:`Config`, so an
unknown key, a wrong type or a missing file fails here with a :class:`ConfigError` naming it, and
code past this point reads typed fields without defaults of its own.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class ConfigError(ValueError):
    """A user mistake in the configuration; the message names the key or file."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _require_file(path: Optional[str], key: str) -> None:
    if path is not None and not Path(path).exists():
        raise ConfigError(f"{key}: no such file or directory: {path}")


@dataclass
class RunConfig:
    """Run identity: outputs go to ``output_dir/name``.

    ``wandb_project`` (null: off) also logs the training metrics to Weights & Biases, from the
    logging rank. ``wandb_mode``: ``offline`` writes under the run directory (upload later with
    ``wandb sync``); ``online`` streams, with the key from ``WANDB_API_KEY`` in the environment
    (never in the config).
    """

    name: str = "tiny-sft"
    seed: int = 1234
    output_dir: str = "runs"
    wandb_project: Optional[str] = None
    wandb_mode: str = "offline"

    def __post_init__(self) -> None:
        _require(self.wandb_mode in ("online", "offline"),
                 f"run.wandb_mode must be online|offline, got {self.wandb_mode!r}")

    @property
    def dir(self) -> Path:
        return Path(self.output_dir) / self.name


@dataclass
class ModelConfig:
    """Qwen3 architecture (field names as in Megatron-Core/NeMo) and its implementation choices.

    HF ``Qwen3Config`` equivalents: num_hidden_layers=num_layers, num_key_value_heads=
    num_query_groups, head_dim=kv_channels, intermediate_size=ffn_hidden_size, rope_theta=
    rotary_base, rms_norm_eps=layernorm_epsilon, tie_word_embeddings=
    share_embeddings_and_output_weights.

    FP8 (Transformer Engine on Ada/Hopper or newer; fields as in megatron-core 0.16.1's
    ``TransformerConfig``): ``fp8`` picks the formats (``hybrid``: E4M3 forward, E5M2 gradients),
    ``fp8_recipe`` the scaling (``delayed``: scales from an amax history of
    ``fp8_amax_history_len`` steps reduced by ``fp8_amax_compute_algo``, with ``fp8_margin``;
    ``tensorwise``: per-tensor current scaling; ``blockwise``: 128-element block scales;
    ``mxfp8``: Blackwell only). ``fp8_param`` keeps the GEMM weights themselves in FP8 (half the
    weight memory, FP8 parameter all-gathers; FP32 main weights live in the distributed
    optimizer). ``fp8_wgrad=false`` computes weight gradients in high precision.
    ``first_last_layers_bf16`` keeps the first ``num_layers_at_start_in_bf16`` and last
    ``num_layers_at_end_in_bf16`` layers (of each pipeline stage) out of FP8, which Megatron
    does not support with the delayed recipe. A Hopper FP8 run of the 0.6B preset, for example:
    ``model=qwen3-0.6b model.fp8=hybrid model.fp8_recipe=tensorwise``.
    """

    preset: str = "micro"
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int = 32
    ffn_hidden_size: int = 512
    vocab_size: int = 2048
    max_position_embeddings: int = 1024
    rotary_base: float = 1_000_000.0
    layernorm_epsilon: float = 1e-6
    qk_layernorm: bool = True
    share_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    params_dtype: str = "float32"
    transformer_impl: str = "local"
    fp8: Optional[str] = None
    fp8_recipe: str = "delayed"
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"
    fp8_margin: int = 0
    fp8_param: bool = False
    fp8_wgrad: bool = True
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    recompute_granularity: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                     "kv_channels", "ffn_hidden_size", "vocab_size", "max_position_embeddings"):
            _require(getattr(self, name) > 0, f"model.{name} must be positive")
        _require(self.num_attention_heads % self.num_query_groups == 0,
                 "model.num_attention_heads must be a multiple of model.num_query_groups")
        _require(self.params_dtype in ("float32", "bfloat16", "float16"),
                 f"model.params_dtype must be float32|bfloat16|float16, got {self.params_dtype!r}")
        _require(self.transformer_impl in ("local", "transformer_engine"),
                 f"model.transformer_impl must be local|transformer_engine, "
                 f"got {self.transformer_impl!r}")
        _require(self.fp8 in (None, "hybrid", "e4m3"),
                 f"model.fp8 must be null|hybrid|e4m3, got {self.fp8!r}")
        _require(self.fp8 is None or self.transformer_impl == "transformer_engine",
                 "model.fp8 requires model.transformer_impl=transformer_engine")
        _require(self.fp8_recipe in ("delayed", "tensorwise", "blockwise", "mxfp8"),
                 f"model.fp8_recipe must be delayed|tensorwise|blockwise|mxfp8, "
                 f"got {self.fp8_recipe!r}")
        self._check_fp8_options()
        _require(self.recompute_granularity in (None, "full", "selective"),
                 "model.recompute_granularity must be null|full|selective")

    def _check_fp8_options(self) -> None:
        """What megatron-core / Transformer Engine would reject later (at build time or in the
        first forward pass, with less helpful messages), checked when the config is loaded."""
        _require(self.fp8_amax_compute_algo in ("max", "most_recent"),
                 f"model.fp8_amax_compute_algo must be max|most_recent, "
                 f"got {self.fp8_amax_compute_algo!r}")
        _require(self.fp8_amax_history_len >= 1, "model.fp8_amax_history_len must be >= 1")
        _require(self.fp8_margin >= 0, "model.fp8_margin must be >= 0")
        for name in ("fp8_param", "first_last_layers_bf16"):
            _require(not getattr(self, name) or self.fp8 is not None,
                     f"model.{name} requires model.fp8 (hybrid|e4m3)")
        _require(self.fp8_wgrad or self.fp8 is not None,
                 "model.fp8_wgrad=false requires model.fp8 (hybrid|e4m3)")
        # The distributed optimizer keeps FP32 main weights only for 16-bit models; FP8 weights of
        # an FP32 model would be updated in place, in FP8.
        _require(not self.fp8_param or self.params_dtype in ("bfloat16", "float16"),
                 "model.fp8_param requires model.params_dtype=bfloat16|float16")
        _require(not self.first_last_layers_bf16 or self.fp8_recipe != "delayed",
                 "model.first_last_layers_bf16 is not supported with model.fp8_recipe=delayed "
                 "(use tensorwise|blockwise|mxfp8)")
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            _require(0 <= getattr(self, name) <= self.num_layers,
                     f"model.{name} must be in [0, model.num_layers]")
        if self.fp8 is not None:
            # TE's FP8 GEMMs need every weight's input dimension to be a multiple of 16.
            for name, size in (("hidden_size", self.hidden_size),
                               ("ffn_hidden_size", self.ffn_hidden_size),
                               ("num_attention_heads * kv_channels",
                                self.num_attention_heads * self.kv_channels)):
                _require(size % 16 == 0,
                         f"model.fp8 needs model.{name} to be a multiple of 16, got {size}")

    def num_parameters(self) -> int:
        """Parameter count of the unsharded model."""
        h, q, kv = self.hidden_size, self.num_attention_heads, self.num_query_groups
        d = self.kv_channels
        attention = h * (q + 2 * kv) * d + q * d * h + (2 * d if self.qk_layernorm else 0)
        mlp = 3 * h * self.ffn_hidden_size
        layer = attention + mlp + 2 * h
        embeddings = self.vocab_size * h * (1 if self.share_embeddings_and_output_weights else 2)
        return self.num_layers * layer + embeddings + h


@dataclass
class ParallelConfig:
    """Megatron parallel sizes; world size must equal tp * pp * dp."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            _require(getattr(self, name) >= 1, f"parallel.{name} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


# The keys of nemo_orch.models.tokenizer.CHAT_TEMPLATES (not imported here: transformers is heavy).
CHAT_FORMATS = ("qwen3", "compact")


@dataclass
class TokenizerConfig:
    """``path`` points at an HF tokenizer directory (e.g. a real Qwen3 one, which uses the
    ``qwen3`` chat format); null trains a BPE tokenizer on the training data into the run
    directory, saved with ``chat_format`` (``compact`` lists tools as signatures, not JSON
    schemas: sequences a third as long for a model trained from scratch)."""

    path: Optional[str] = None
    vocab_size: int = 2000
    min_frequency: int = 2
    chat_format: str = "compact"

    def __post_init__(self) -> None:
        _require_file(self.path, "tokenizer.path")
        _require(self.vocab_size >= 512, "tokenizer.vocab_size must be >= 512")
        _require(self.chat_format in CHAT_FORMATS,
                 f"tokenizer.chat_format must be one of {CHAT_FORMATS}")


# The naive routers that play the main job's demonstrations (envs.offline.world.naive_routes).
DEMO_ROUTERS = ("strongest", "thrifty", "family", "random")
# The systems an evaluation runs and SFT collects demonstrations from (eval/agents.py).
ORCHESTRATOR, MONOLITH, GOLD_REPLAY = "orchestrator", "monolith", "gold-replay"
NAIVE_ROUTERS = "naive-routers"
ROUTERS = ("fixed:cheapest", "fixed:strongest", "random")
AGENT_KINDS = (ORCHESTRATOR, MONOLITH, *ROUTERS, GOLD_REPLAY, NAIVE_ROUTERS)


@dataclass
class DataConfig:
    """SFT's data. ``sft_path``: a JSONL file of conversations (``{"messages": [...], "tools":
    [...]}``); null: demonstrations, the episodes of ``demo_agent`` (:data:`AGENT_KINDS`: a
    fixed router, the gold replay, the orchestrator of ``rollout.*``, a checkpoint, HF
    directory or endpoint, the monolith, or the offline world's naive routers) on
    ``2 * num_offline_conversations`` tasks of ``env``'s train split that the environment
    scores correct, the first ``num_offline_conversations`` of them, collected once into
    ``<run>/demonstrations.jsonl``. A tokenizer trained for the run learns the file's
    conversations, or ``num_offline_conversations`` of the offline world's generated ones.
    ``num_copy_conversations`` short copy-into-the-answer conversations are mixed in (see
    ``envs.offline.generator.copy_conversations``; 0: none). ``demo_routers``: the share of
    the tasks each naive router (:data:`DEMO_ROUTERS`) plays; they sum to 1.
    ``toolscale_tasks_per_domain``: the main job writes the offline ToolScale domains with that
    many tasks each (``toolscale/`` in the run) and evaluates the GRPO policy, next to the gold
    replay, on the first ``toolscale_eval_tasks`` of each (0: neither)."""

    sft_path: Optional[str] = None
    demo_agent: str = NAIVE_ROUTERS
    num_offline_conversations: int = 6000
    num_copy_conversations: int = 6000
    seq_length: int = 640
    demo_routers: dict[str, float] = field(default_factory=lambda: {
        "strongest": 0.3, "thrifty": 0.3, "family": 0.15, "random": 0.25})
    toolscale_tasks_per_domain: int = 200
    toolscale_eval_tasks: int = 20

    def __post_init__(self) -> None:
        _require_file(self.sft_path, "data.sft_path")
        _require(self.demo_agent in AGENT_KINDS,
                 f"data.demo_agent must be one of {', '.join(AGENT_KINDS)}")
        _require(self.num_offline_conversations > 0, "data.num_offline_conversations must be > 0")
        _require(self.num_copy_conversations >= 0, "data.num_copy_conversations must be >= 0")
        _require(self.seq_length > 8, "data.seq_length must be > 8")
        _require(set(self.demo_routers) == set(DEMO_ROUTERS),
                 f"data.demo_routers must give a share to each of {', '.join(DEMO_ROUTERS)}")
        _require(all(share >= 0 for share in self.demo_routers.values())
                 and math.isclose(sum(self.demo_routers.values()), 1.0),
                 "data.demo_routers: shares must be >= 0 and sum to 1")
        _require(0 <= self.toolscale_eval_tasks <= self.toolscale_tasks_per_domain,
                 "data.toolscale_eval_tasks must be in [0, data.toolscale_tasks_per_domain]")


def resolve_conf_path(path: str) -> Path:
    """Relative paths in tool/task settings are relative to ``conf/`` (where they ship), unless
    they exist relative to the working directory."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate
    return CONF_DIR / candidate


@dataclass
class ToolsConfig:
    """Tool declaration files, or directories of them (one YAML/JSON file per tool), domain
    files (``Domain.save``: their tools act on each episode's database, and their tasks are
    scored on it) and the cache of deterministic tools' results."""

    declarations: list[str] = field(default_factory=lambda: ["tools/offline"])
    domains: list[str] = field(default_factory=list)
    cache_entries: int = 4096
    cache_mb: int = 64
    # USD per million (input, output) tokens of models, over the built-in list prices
    # (nemo_orch/tools/pricing.py): how a price table is swapped at evaluation time.
    prices: dict[str, list[float]] = field(default_factory=dict)
    # Base URLs of expert models by alias (an LLM tool's `models` key), over the declarations'
    # `base_url`: how a launch hands the servers it started to the job (tools.endpoints.math=URL).
    endpoints: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("declarations", "domains"):
            for index, path in enumerate(getattr(self, key)):
                _require(resolve_conf_path(path).exists(),
                         f"tools.{key}[{index}]: no such file or directory: {path}")
        _require(self.cache_entries >= 0 and self.cache_mb >= 0,
                 "tools.cache_entries and tools.cache_mb must be >= 0")
        for model, prices in self.prices.items():
            _require(len(prices) == 2 and all(price >= 0 for price in prices),
                     f"tools.prices.{model} must be [input, output] USD per million tokens, "
                     "both >= 0")
        for alias, url in self.endpoints.items():
            _require(url.startswith(("http://", "https://")),
                     f"tools.endpoints.{alias} must be an http(s) URL, got {url!r}")


@dataclass
class RewardConfig:
    """How finished groups of trajectories are scored (see :mod:`nemo_orch.reward`).

    ``combination``: ``toolorchestra`` (wrong -> 0; right -> preference-weighted sum of
    group-min-max-normalized features, cost and latency entering negated), ``weighted``
    (per-component group baselines, weighted: GDPO-style) or ``linear`` (``linear_*``
    coefficients; USD and seconds divided by their references). The LLM judge is used for answers
    that are neither empty, too long nor an exact match, when ``judge_base_url`` is set; each
    request gets ``judge_timeout_s`` and at most ``judge_max_retries`` retries (with backoff),
    after which the answer counts as a judge failure. With ``endpoint`` (a reward server's
    ``http://host:port``: ``nemo-orch serve reward``) answers are scored there, each request
    given ``endpoint_timeout_s`` and ``endpoint_max_retries``; the judge is then the server's.
    """

    combination: str = "toolorchestra"
    numeric_rel_tol: float = 1e-6
    numeric_abs_tol: float = 1e-9
    max_answer_words: int = 500
    judge_base_url: Optional[str] = None
    judge_model: Optional[str] = None
    judge_api_key_env: Optional[str] = None
    judge_max_retries: int = 2
    judge_timeout_s: float = 60.0
    endpoint: Optional[str] = None
    endpoint_timeout_s: float = 300.0
    endpoint_max_retries: int = 2
    # weighted: weight of each component's group-baselined value
    weights: dict[str, float] = field(default_factory=lambda: {
        "outcome": 1.0, "cost": 0.3, "latency": 0.1, "preference": 0.2})
    # linear: alpha * outcome - beta * usd/usd_reference - gamma * s/seconds_reference + delta * pref
    linear_alpha: float = 0.6
    linear_beta: float = 0.25
    linear_gamma: float = 0.1
    linear_delta: float = 0.05
    usd_reference: float = 0.01
    seconds_reference: float = 10.0
    # advantages and filters
    leave_one_out: bool = False
    advantage_clip: float = 3.0
    advantage_eps: float = 1e-6
    drop_format_errors: bool = False
    drop_unanswered: bool = False
    min_group_std: float = 1e-6

    def __post_init__(self) -> None:
        _require(self.combination in ("toolorchestra", "weighted", "linear"),
                 f"reward.combination must be toolorchestra|weighted|linear, "
                 f"got {self.combination!r}")
        _require(self.numeric_rel_tol >= 0 and self.numeric_abs_tol >= 0,
                 "reward.numeric_rel_tol and reward.numeric_abs_tol must be >= 0")
        _require(self.max_answer_words >= 1, "reward.max_answer_words must be >= 1")
        _require(self.judge_base_url is None or self.judge_model is not None,
                 "reward.judge_base_url needs reward.judge_model")
        _require(self.judge_max_retries >= 0 and self.judge_timeout_s > 0,
                 "reward.judge_max_retries must be >= 0 and reward.judge_timeout_s > 0")
        _require(self.endpoint is None or self.judge_base_url is None,
                 "reward.endpoint scores on a reward server, which has its own judge: set "
                 "reward.judge_base_url there, not here")
        _require(self.endpoint_max_retries >= 0 and self.endpoint_timeout_s > 0,
                 "reward.endpoint_max_retries must be >= 0 and reward.endpoint_timeout_s > 0")
        _require(self.usd_reference > 0 and self.seconds_reference > 0,
                 "reward.usd_reference and reward.seconds_reference must be > 0")
        _require(self.advantage_clip > 0 and self.advantage_eps > 0,
                 "reward.advantage_clip and reward.advantage_eps must be > 0")
        _require(self.min_group_std >= 0, "reward.min_group_std must be >= 0")


@dataclass
class CurriculumStage:
    """One stage of the GRPO curriculum: the tools every task offers (null: all declared), until
    step ``until_step`` is done or until a step's mean reward reaches ``until_reward``
    (whichever comes first; neither: to the end, which only the last stage may do)."""

    tools: Optional[list[str]] = None
    until_step: Optional[int] = None
    until_reward: Optional[float] = None

    def __post_init__(self) -> None:
        _require(self.tools is None or len(self.tools) > 0,
                 "grpo.curriculum: a stage's tools must be null (all) or non-empty")
        _require(self.until_step is None or self.until_step >= 1,
                 "grpo.curriculum: until_step must be >= 1")


@dataclass
class GRPOConfig:
    """The RL stage of ``nemo-orch train``: GRPO on the Megatron policy.

    Per step, ``prompts_per_step`` tasks x ``rollout.group_size`` episodes are rolled out;
    groups are filtered and, with ``dynamic_sampling``, more are generated (at most
    ``max_sampling_rounds`` rounds) until the batch is full; then ``updates_per_step`` optimizer
    steps run over ``mini_batches`` of the samples. Loss: clipped ratio (``clip_low``,
    ``clip_high``), dual clip ``dual_clip`` (0: off), KL to the frozen start policy (``kl_type``
    k3|mse, ``kl_coef``), token-mean aggregation. ``sample_mode``: whole trajectories, or one
    sample per turn. ``advantage_tokens``: the advantage drives every policy token (``all``), or
    only the routing decisions (``decisions``: which tool, which expert, or to answer now; see
    ``rollout.format.decision_end``), leaving the copying of arguments and answers to what SFT
    taught, held by the KL term, so a costly route's negative advantage does not erode the
    copying that a cheap route needs. ``explore_share``: the share of each group's episodes
    whose first turn is forced to start with the routing choice (a tool, or a tool with one
    value of its choice argument) the policy itself chose least in the previous step (directed
    exploration: choices it has stopped making keep being tried, and scored). ``curriculum``:
    stages that widen the tool set (e.g. basic tools, then experts); empty: all tools always.
    Every ``val_interval`` steps (0: never) the policy runs greedily on ``val_tasks`` tasks of
    each source's validation split (``val/<source>/...`` metrics).
    """

    max_steps: int = 40
    prompts_per_step: int = 8
    updates_per_step: int = 1
    mini_batches: int = 1
    micro_batch_size: int = 8
    lr: float = 2.5e-4
    min_lr: float = 2.5e-4
    warmup_steps: int = 0
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 3.0
    kl_type: str = "k3"
    kl_coef: float = 0.1
    sample_mode: str = "trajectory"
    advantage_tokens: str = "decisions"
    explore_share: float = 0.0
    curriculum: list[CurriculumStage] = field(default_factory=list)
    dynamic_sampling: bool = True
    max_sampling_rounds: int = 2
    save_interval: int = 10
    val_interval: int = 0
    val_tasks: int = 32

    def __post_init__(self) -> None:
        for name in ("max_steps", "prompts_per_step", "updates_per_step", "mini_batches",
                     "micro_batch_size", "max_sampling_rounds", "save_interval"):
            _require(getattr(self, name) >= 1, f"grpo.{name} must be >= 1")
        _require(self.lr > 0 and 0 <= self.min_lr <= self.lr,
                 "grpo.lr must be > 0 and 0 <= grpo.min_lr <= grpo.lr")
        _require(self.clip_low > 0 and self.clip_high > 0, "grpo.clip_low/high must be > 0")
        _require(self.dual_clip == 0 or self.dual_clip > 1, "grpo.dual_clip must be 0 or > 1")
        _require(self.kl_type in ("k3", "mse"), f"grpo.kl_type must be k3|mse, "
                 f"got {self.kl_type!r}")
        _require(self.kl_coef >= 0, "grpo.kl_coef must be >= 0")
        _require(self.sample_mode in ("trajectory", "turn"),
                 f"grpo.sample_mode must be trajectory|turn, got {self.sample_mode!r}")
        _require(self.advantage_tokens in ("all", "decisions"),
                 f"grpo.advantage_tokens must be all|decisions, got {self.advantage_tokens!r}")
        _require(0 <= self.explore_share < 1, "grpo.explore_share must be in [0, 1)")
        for index, stage in enumerate(self.curriculum):
            ends = stage.until_step is not None or stage.until_reward is not None
            last = index == len(self.curriculum) - 1
            _require(ends != last, f"grpo.curriculum[{index}]: every stage but the last needs "
                     "until_step or until_reward, and the last neither")
        _require(self.val_interval >= 0 and self.val_tasks >= 1,
                 "grpo.val_interval must be >= 0 (0: no validation) and grpo.val_tasks >= 1")


@dataclass
class RayConfig:
    """``rollout.backend=ray``: ``num_workers`` rollout workers, each an actor with
    ``num_cpus_per_worker`` CPUs, its own engine and a tool-executor actor of its own, and
    ``num_scorers`` reward-scorer actors. ``address`` null starts a Ray on this machine, bound to
    127.0.0.1, with an object store of ``object_store_mb``; else the cluster to join (``auto``:
    ``RAY_ADDRESS`` or the one running here). A worker (or its tool executor) that dies is
    replaced and its episodes run again, at most ``max_replacements`` times per rollout."""

    address: Optional[str] = None
    num_workers: int = 2
    num_cpus_per_worker: float = 1.0
    num_scorers: int = 1
    object_store_mb: int = 256
    max_replacements: int = 3

    def __post_init__(self) -> None:
        _require(self.num_workers >= 1 and self.num_scorers >= 1,
                 "rollout.ray.num_workers and rollout.ray.num_scorers must be >= 1")
        _require(self.num_cpus_per_worker > 0, "rollout.ray.num_cpus_per_worker must be > 0")
        # Ray refuses an object store under 75 MiB.
        _require(self.object_store_mb >= 75, "rollout.ray.object_store_mb must be >= 75")
        _require(self.max_replacements >= 0, "rollout.ray.max_replacements must be >= 0")


@dataclass
class RolloutConfig:
    """Episodes and the engine that generates them.

    ``policy``: a checkpoint (``step_N`` or ``checkpoints/``) or an HF model directory for the
    ``hf`` engine; null takes the run's latest checkpoint. ``openai`` serves from ``base_url``
    (key read from the environment variable ``api_key_env``). ``max_context_tokens`` null means
    the model's ``max_position_embeddings``.

    The GPU engines (``trtllm``, ``vllm``) run ``engine_tp``-way tensor parallel in
    ``engine_dtype``. ``colocate``: train and generate on the same GPUs -- the engine sleeps
    while the policy trains (releasing its KV cache and, at ``sleep_level`` 2, its weights;
    level 1 keeps a CPU copy of them) and wakes to be refit and generate; false: the engine
    never sleeps and keeps its memory (it has GPUs of its own once the Ray scale-out places
    it). Only vLLM can sleep; TensorRT-LLM keeps its KV cache either way. ``gpu_memory_utilization``
    is vLLM's share of each GPU's memory (weights + KV cache) and TensorRT-LLM's share of the
    memory left free after loading the weights (its KV cache). The CPU engine ignores these.

    ``backend``: ``local`` runs every episode on this process's event loop; ``ray`` spreads them
    over Ray actors (``ray.*``, :class:`RayConfig`) with the same results for the same seeds,
    sampled tokens included (each turn's seed travels with its prompt into the engine).
    """

    engine: str = "hf"
    policy: Optional[str] = None
    base_url: Optional[str] = None
    model_name: Optional[str] = None
    api_key_env: Optional[str] = None
    colocate: bool = True
    engine_tp: int = 1
    engine_dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    sleep_level: int = 1
    group_size: int = 8
    max_turns: int = 10
    max_new_tokens: int = 96
    max_context_tokens: Optional[int] = None
    max_observation_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    answer_format: str = "tag"
    multiple_calls: str = "parallel"
    max_concurrent_episodes: int = 64
    max_batch_size: int = 64
    # The orchestrator's own price (USD per million tokens), counted in every trajectory's cost.
    input_usd_per_million: float = 0.2
    output_usd_per_million: float = 0.2
    check_template: bool = True
    backend: str = "local"
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        _require(self.backend in ("local", "ray"),
                 f"rollout.backend must be local|ray, got {self.backend!r}")
        _require(self.backend == "local" or self.engine in ("hf", "openai"),
                 f"rollout.backend=ray runs the CPU and served engines (hf|openai); "
                 f"rollout.engine={self.engine} needs rollout.backend=local")
        _require(self.engine in ("hf", "trtllm", "vllm", "openai"),
                 f"rollout.engine must be hf|trtllm|vllm|openai, got {self.engine!r}")
        _require(self.engine != "openai" or (self.base_url and self.model_name),
                 "rollout.engine=openai needs rollout.base_url and rollout.model_name")
        _require(self.colocate or self.engine in ("trtllm", "vllm"),
                 f"rollout.colocate=false only applies to the GPU engines (trtllm|vllm); "
                 f"rollout.engine={self.engine} has no GPUs to give back")
        _require(self.engine_tp >= 1, "rollout.engine_tp must be >= 1")
        _require(self.engine_dtype in ("bfloat16", "float16", "float32"),
                 f"rollout.engine_dtype must be bfloat16|float16|float32, got "
                 f"{self.engine_dtype!r}")
        _require(0 < self.gpu_memory_utilization <= 1,
                 "rollout.gpu_memory_utilization must be in (0, 1]")
        _require(self.sleep_level in (1, 2), "rollout.sleep_level must be 1 or 2")
        _require_file(self.policy, "rollout.policy")
        for name in ("group_size", "max_turns", "max_new_tokens", "max_observation_tokens",
                     "max_concurrent_episodes", "max_batch_size"):
            _require(getattr(self, name) >= 1, f"rollout.{name} must be >= 1")
        _require(self.max_context_tokens is None or self.max_context_tokens > 2,
                 "rollout.max_context_tokens must be > 2")
        _require(self.temperature >= 0 and 0 < self.top_p <= 1 and self.top_k >= 0,
                 "rollout.temperature must be >= 0, rollout.top_p in (0, 1], rollout.top_k >= 0")
        _require(self.answer_format in ("tag", "tool"),
                 f"rollout.answer_format must be tag|tool, got {self.answer_format!r}")
        _require(self.multiple_calls in ("first", "parallel"),
                 f"rollout.multiple_calls must be first|parallel, got {self.multiple_calls!r}")
        _require(self.input_usd_per_million >= 0 and self.output_usd_per_million >= 0,
                 "rollout prices must be >= 0")


@dataclass
class TrainerConfig:
    max_steps: int = 800
    micro_batch_size: int = 16
    global_batch_size: int = 16
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 10
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    grad_clip: float = 1.0
    save_interval: int = 200
    resume: bool = False
    init_from: Optional[str] = None
    num_threads: int = 0

    def __post_init__(self) -> None:
        _require(self.max_steps >= 1, "trainer.max_steps must be >= 1")
        _require(self.micro_batch_size >= 1, "trainer.micro_batch_size must be >= 1")
        _require(self.global_batch_size % self.micro_batch_size == 0,
                 "trainer.global_batch_size must be a multiple of trainer.micro_batch_size")
        _require(self.lr > 0 and 0 <= self.min_lr <= self.lr,
                 "trainer.lr must be > 0 and 0 <= trainer.min_lr <= trainer.lr")
        _require(self.save_interval >= 1, "trainer.save_interval must be >= 1")
        _require(self.num_threads >= 0, "trainer.num_threads must be >= 0 (0: torch's choice)")
        _require_file(self.init_from, "trainer.init_from")


# The file ``containers/enroot.sh`` writes: enroot's name for the image ``nemo-orch:0.1.0``
# (``containers/Dockerfile``), under ``<launcher.slurm.job_dir>/containers/``.
CONTAINER_SQSH = "nemo-orch+0.1.0.sqsh"
# Variables named like this hold secrets: they go by name (``launcher.secret_env``), never by value.
SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
_SLURM_TIME = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENDPOINT_KEY = re.compile(r"^(tools\.endpoints\.[A-Za-z0-9_-]+|reward\.judge_base_url)$")


@dataclass
class SlurmConfig:
    """The sbatch flags of every job (``account``, ``partition``, ``time`` as [D-]HH:MM:SS,
    ``qos``) and ``job_dir``: a directory on the cluster's shared filesystem, at the same path on
    the login node and in the jobs, holding NeMo-Run's experiments (scripts, logs), the Ray
    cluster's directory and ``containers/`` (the squashfs image). Jobs run in the pyxis container
    ``container_image`` (null: ``<job_dir>/containers/`` + :data:`CONTAINER_SQSH`) with
    ``container_mounts`` (``SRC:DST``)."""

    account: Optional[str] = None
    partition: Optional[str] = None
    time: str = "04:00:00"
    qos: Optional[str] = None
    job_dir: Optional[str] = None
    container_image: Optional[str] = None
    container_mounts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _require(bool(_SLURM_TIME.match(self.time)),
                 f"launcher.slurm.time must be [D-]HH:MM:SS, got {self.time!r}")
        _require(self.job_dir is None or self.job_dir.startswith("/"),
                 "launcher.slurm.job_dir must be an absolute path on the shared filesystem")
        for mount in self.container_mounts:
            source, _, target = mount.partition(":")
            _require(source.startswith("/") and target.startswith("/"),
                     f"launcher.slurm.container_mounts: {mount!r} is not SRC:DST (absolute)")

    @property
    def image(self) -> str:
        """The container image, resolved (see the class docstring)."""
        return self.container_image or f"{self.job_dir}/containers/{CONTAINER_SQSH}"


@dataclass
class RayClusterConfig:
    """A Ray cluster on SLURM for the rollout workers (``nemo_run.run.ray``: a job of its own,
    ``nodes`` x ``gpus_per_node``). The training job waits for the file the cluster writes when
    all its nodes joined (``ray_cluster_info.json`` in its directory under
    ``launcher.slurm.job_dir``) and gets its address as ``RAY_ADDRESS``."""

    nodes: int = 1
    gpus_per_node: int = 0

    def __post_init__(self) -> None:
        _require(self.nodes >= 1 and self.gpus_per_node >= 0,
                 "launcher.ray.nodes must be >= 1 and launcher.ray.gpus_per_node >= 0")


@dataclass
class ExpertServerConfig:
    """A model served OpenAI-compatibly by ``engine`` (``vllm``: ``vllm serve``; ``trtllm``:
    ``trtllm-serve``) on ``tp`` GPUs of a node of its own, a component of the training's SLURM
    heterogeneous job, listening on ``port``. ``model`` is an HF id or a path in the mounts,
    served as ``served_model_name`` (null: ``model``; the name the tool declaration asks for).
    The training command gets ``<endpoint>=http://<its node>:<port>/v1``: ``endpoint`` is
    ``tools.endpoints.<alias>`` (an expert tool's alias) or ``reward.judge_base_url`` (the judge;
    ``reward.judge_model`` is then set to the served name). ``extra_args`` go to the engine.
    ``container_image``: null runs it in the launcher's image (which has trtllm-serve, not vLLM:
    see ``containers/README.md``)."""

    name: str = MISSING
    engine: str = "vllm"
    model: str = MISSING
    served_model_name: Optional[str] = None
    tp: int = 1
    port: int = 8000
    endpoint: str = MISSING
    extra_args: list[str] = field(default_factory=list)
    container_image: Optional[str] = None

    def __post_init__(self) -> None:
        where = f"launcher.experts[{self.name}]"
        _require(bool(re.match(r"^[a-z0-9][a-z0-9-]*$", self.name)),
                 f"{where}: name must be lowercase letters, digits and dashes")
        _require(self.engine in ("vllm", "trtllm"),
                 f"{where}.engine must be vllm|trtllm, got {self.engine!r}")
        _require(self.served_model_name is None or self.engine == "vllm",
                 f"{where}.served_model_name is vLLM's (trtllm-serve names the model itself)")
        _require(self.tp >= 1, f"{where}.tp must be >= 1")
        _require(1024 <= self.port <= 65535, f"{where}.port must be in [1024, 65535]")
        _require(bool(_ENDPOINT_KEY.match(self.endpoint)),
                 f"{where}.endpoint must be tools.endpoints.<alias> or reward.judge_base_url, "
                 f"got {self.endpoint!r}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


@dataclass
class LauncherConfig:
    """``nemo-orch launch``: where the training job runs and what runs beside it.

    The training job runs ``nemo-orch <job>`` (``train`` or ``sft``) with the launch's overrides
    under torchrun on ``nodes`` x ``gpus_per_node`` GPUs (0: CPU processes, one per rank of
    ``parallel``); ``executor`` ``local`` runs it on this machine, ``slurm`` submits it (with
    ``slurm.*``, the expert servers ``experts`` and the Ray cluster ``ray``, SLURM only).
    ``gpu_memory_gib`` is what ``nemo-orch plan`` checks the per-GPU estimate against (H100
    80GB: 81559 MiB usable). ``env`` sets plain variables in the job; ``secret_env`` names
    variables (API keys, tokens) passed from the submitting environment into the container by
    name, never written into a script or a command line. Services get ``startup_timeout_s`` to
    become ready; torchrun's rendezvous listens on ``rdzv_port`` of the first training node.
    """

    executor: str = "local"
    job: str = "train"
    nodes: int = 1
    gpus_per_node: int = 0
    gpu_memory_gib: float = 79.6
    env: dict[str, str] = field(default_factory=dict)
    secret_env: list[str] = field(default_factory=list)
    rdzv_port: int = 29500
    startup_timeout_s: float = 1800.0
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    ray: Optional[RayClusterConfig] = None
    experts: list[ExpertServerConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        _require(self.executor in ("local", "slurm"),
                 f"launcher.executor must be local|slurm, got {self.executor!r}")
        _require(self.job in ("train", "sft", "grpo"),
                 f"launcher.job must be train|sft|grpo, got {self.job!r}")
        _require(self.nodes >= 1 and self.gpus_per_node >= 0,
                 "launcher.nodes must be >= 1 and launcher.gpus_per_node >= 0")
        _require(self.gpu_memory_gib > 0, "launcher.gpu_memory_gib must be > 0")
        _require(1024 <= self.rdzv_port <= 65535, "launcher.rdzv_port must be in [1024, 65535]")
        _require(self.startup_timeout_s > 0, "launcher.startup_timeout_s must be > 0")
        for name in [*self.env, *self.secret_env]:
            _require(bool(_ENV_NAME.match(name)), f"launcher: {name!r} is not a variable name")
        leaked = [name for name in self.env if any(m in name.upper() for m in SECRET_MARKERS)]
        _require(not leaked, f"launcher.env: {', '.join(leaked)} look like secrets: name them in "
                 "launcher.secret_env (passed from your environment) instead of giving values")
        names = [expert.name for expert in self.experts]
        endpoints = [expert.endpoint for expert in self.experts]
        _require(len(set(names)) == len(names) and len(set(endpoints)) == len(endpoints),
                 "launcher.experts: names and endpoints must be unique")
        if self.executor == "local":
            _require(self.nodes == 1, "launcher.executor=local runs on one node (launcher.nodes=1)")
            _require(not self.experts and self.ray is None,
                     "launcher.experts and launcher.ray run on SLURM only (launcher.executor=slurm)")
        else:
            _require(self.gpus_per_node >= 1, "launcher.executor=slurm needs "
                     "launcher.gpus_per_node >= 1")
            _require(self.slurm.account is not None and self.slurm.job_dir is not None,
                     "launcher.executor=slurm needs launcher.slurm.account and "
                     "launcher.slurm.job_dir")


@dataclass
class SynthConfig:
    """``nemo-orch synth``: the ToolScale synthesis pipeline (``envs/toolscale/synth.py``).

    Each step is one chat request to ``base_url`` (OpenAI-compatible, ``model``; the key read
    from the environment variable ``api_key_env``); a reply that does not parse or check is sent
    back with the error at most ``max_retries`` times. Per domain: ``records_per_table``
    records, ``num_purposes`` purposes with ``tasks_per_purpose`` tasks each, and up to
    ``evolve_rounds`` harder rewrites per task; a task with more than ``max_actions`` gold
    actions is dropped. The run stops cleanly after ``max_llm_calls`` requests or ``max_usd``
    (at the ``*_usd_per_million`` token prices; null: no limit); ``concurrency`` bounds the
    requests in flight. Outputs and the resumable cache go to ``out_dir``.
    """

    base_url: Optional[str] = None
    model: Optional[str] = None
    api_key_env: Optional[str] = None
    out_dir: str = "runs/synth"
    num_domains: int = 1
    records_per_table: int = 10
    num_purposes: int = 5
    tasks_per_purpose: int = 3
    evolve_rounds: int = 1
    max_actions: int = 12
    max_retries: int = 2
    max_llm_calls: Optional[int] = None
    max_usd: Optional[float] = None
    input_usd_per_million: float = 0.0
    output_usd_per_million: float = 0.0
    temperature: float = 0.7
    max_tokens: int = 8192
    timeout_s: float = 300.0
    concurrency: int = 4

    def __post_init__(self) -> None:
        _require(self.base_url is None or self.model is not None,
                 "synth.base_url needs synth.model")
        for name in ("num_domains", "records_per_table", "num_purposes", "tasks_per_purpose",
                     "max_actions", "max_tokens", "concurrency"):
            _require(getattr(self, name) >= 1, f"synth.{name} must be >= 1")
        _require(self.evolve_rounds >= 0 and self.max_retries >= 0,
                 "synth.evolve_rounds and synth.max_retries must be >= 0")
        _require(self.max_llm_calls is None or self.max_llm_calls >= 1,
                 "synth.max_llm_calls must be null or >= 1")
        _require(self.input_usd_per_million >= 0 and self.output_usd_per_million >= 0,
                 "synth prices must be >= 0")
        _require(self.max_usd is None or (self.max_usd > 0 and self.input_usd_per_million
                                          + self.output_usd_per_million > 0),
                 "synth.max_usd must be > 0 and needs a price (synth.*_usd_per_million)")
        _require(self.temperature >= 0 and self.timeout_s > 0,
                 "synth.temperature must be >= 0 and synth.timeout_s > 0")


ENV_KINDS = ("offline", "toolscale", "tau2", "qa", "tasks", "mixture")
# `nemo-orch eval --benchmark NAME` is `env=NAME`: the presets of conf/env/ that name one source.
BENCHMARKS = ("offline", "toolscale", "tau2", "qa", "hle", "frames", "tasks")
QA_PRESETS = ("hle", "frames")
# Which options each kind reads (beyond kind, name, weight, limit and tools); another one set is
# a mistake, not silently ignored.
_KIND_OPTIONS = {
    "offline": set(),
    "toolscale": {"path", "domain"},
    "tau2": {"domain", "split"},
    "qa": {"path", "preset", "id_column", "question_columns", "answer_columns",
           "documents_column"},
    "tasks": {"path"},
}


def _field_default(cls: type, name: str) -> object:
    (found,) = [item for item in dataclasses.fields(cls) if item.name == name]
    return found.default_factory() if found.default is dataclasses.MISSING else found.default


@dataclass
class EnvSourceConfig:
    """One task source: an environment of ``kind`` (:data:`ENV_KINDS`, less ``mixture``) with its
    options. ``name`` labels it in metrics and reports (null: the kind, or the preset).

    * ``offline``: the main job's world (tasks generated from the run's seed);
    * ``toolscale``: domain tasks; ``path`` a directory of ``<domain>/domain.json`` +
      ``tasks.jsonl`` (null: ``synth.out_dir``) or a ToolScale ``.parquet`` file (its rows run on
      the installed domains of ``tools.domains``); ``domain``: one domain (null: all);
    * ``tau2``: tau2-bench's ``domain`` (extra ``tau2``); evaluation runs its ``split``,
      training its ``train`` split;
    * ``qa``: question / reference-answer rows, ``path`` a ``.jsonl``, ``.json`` or ``.parquet``
      file, columns ``id_column``, the first present of ``question_columns`` and of
      ``answer_columns``, optionally ``documents_column`` (the ids retrieval may return);
      ``preset`` ``hle`` or ``frames`` reads the benchmark's published columns instead;
    * ``tasks``: a task JSONL file (``path``; the format of ``nemo-orch rollout --tasks``).

    A relative ``path`` is read from the working directory, else from ``conf/`` (where samples
    ship).

    ``limit``: only the first N tasks (after filters). ``weight`` (> 0): a mixture's share of
    each step's prompts. ``tools``: tool declarations offered beside the environment's own
    tools (a domain's, tau2's); null: ``tools.declarations`` (the ``tools=`` group), except for
    tau2, whose protocol has only its domain's tools.
    """

    kind: str = "offline"
    name: Optional[str] = None
    path: Optional[str] = None
    domain: Optional[str] = None
    split: str = "test"
    limit: Optional[int] = None
    weight: float = 1.0
    tools: Optional[list[str]] = None
    preset: Optional[str] = None
    id_column: str = "id"
    question_columns: list[str] = field(default_factory=lambda: ["question", "problem",
                                                                 "prompt"])
    answer_columns: list[str] = field(default_factory=lambda: [
        "answer", "reference_answer", "reference", "solution"])
    documents_column: Optional[str] = None

    @property
    def label(self) -> str:
        return self.name or self.preset or self.kind

    def _check(self, where: str) -> None:
        _require(self.kind in ENV_KINDS and self.kind != "mixture"
                 or isinstance(self, EnvConfig) and self.kind == "mixture",
                 f"{where}.kind: unknown environment kind {self.kind!r}; kinds: "
                 f"{', '.join(ENV_KINDS)}")
        if self.kind == "mixture":
            return
        for option in set().union(*_KIND_OPTIONS.values()) - _KIND_OPTIONS[self.kind]:
            _require(getattr(self, option) == _field_default(EnvSourceConfig, option),
                     f"{where}.{option}: a {self.kind} environment has no option {option} "
                     f"(its options: {', '.join(sorted(_KIND_OPTIONS[self.kind])) or 'none'})")
        _require(self.limit is None or self.limit >= 1, f"{where}.limit must be null or >= 1")
        _require(self.weight > 0, f"{where}.weight must be > 0")
        _require(self.path is None or resolve_conf_path(self.path).exists(),
                 f"{where}.path: no such file or directory: {self.path}")
        for index, path in enumerate(self.tools or []):
            _require(resolve_conf_path(path).exists(),
                     f"{where}.tools[{index}]: no such file or directory: {path}")
        _require(self.preset in (None, *QA_PRESETS),
                 f"{where}.preset must be null|{'|'.join(QA_PRESETS)}, got {self.preset!r}")
        _require(self.kind not in ("qa", "tasks") or self.path is not None,
                 f"{where}.path: a {self.kind} environment reads a file: set {where}.path (a "
                 "local file; nothing is downloaded)")
        _require(self.kind != "tau2" or self.domain is not None,
                 f"{where}.domain: a tau2 environment needs its domain (airline, retail, "
                 "telecom, mock)")


@dataclass
class EnvConfig(EnvSourceConfig):
    """Where every stage's tasks come from (``conf/env/``): one source (the fields of
    :class:`EnvSourceConfig`) or, with ``kind: mixture``, the weighted ``sources``; each step of
    GRPO draws its prompts from them by weight with the step's seed. ``val_fraction``: the share
    of a file's or a training split's tasks held out for validation (by a hash of the task id,
    so the split never depends on order or seed)."""

    sources: list[EnvSourceConfig] = field(default_factory=list)
    val_fraction: float = 0.05

    def __post_init__(self) -> None:  # a source is checked here, where its index is known
        self._check("env")
        _require(0 <= self.val_fraction < 1, "env.val_fraction must be in [0, 1)")
        if self.kind != "mixture":
            _require(not self.sources, "env.sources: only kind=mixture has sources")
            return
        _require(len(self.sources) >= 1, "env.sources: a mixture needs at least one source")
        for index, source in enumerate(self.sources):
            source._check(f"env.sources[{index}]")
        labels = [source.label for source in self.sources]
        _require(len(set(labels)) == len(labels),
                 f"env.sources: two sources are labelled alike ({', '.join(labels)}); give "
                 "them distinct names")

    def source_list(self) -> list[EnvSourceConfig]:
        """The sources: a mixture's, or this one."""
        return list(self.sources) if self.kind == "mixture" else [self]


# Keys that moved: their old spelling fails with a message naming the new one.
MOVED_KEYS = {"eval.data": "env.path", "eval.domain": "env.domain", "eval.split": "env.split",
              "eval.limit": "env.limit", "grpo.eval_tasks": "eval.tasks"}


@dataclass
class MonolithConfig:
    """The monolith baseline: one OpenAI-compatible chat model (``model`` at ``base_url``, key
    from the environment variable ``api_key_env``) with the benchmark's tools except
    ``drop_tools`` (the experts), called with standard function calling. Priced at
    ``usd_per_million`` (input, output) or, when null, the price table's entry for ``model``.
    Each request gets ``timeout_s`` (reasoning models take minutes) and ``max_retries``.

    With ``base_url`` null on the offline benchmark, a SIMULATED frontier model is served on
    127.0.0.1 for the evaluation (``nemo_orch/eval/simulated_chat.py``): the offline experts'
    alias ``simulate``, sleeping ``time_scale`` times its simulated generation time."""

    base_url: Optional[str] = None
    model: str = "gpt-5"
    api_key_env: Optional[str] = None
    usd_per_million: Optional[list[float]] = None
    drop_tools: list[str] = field(default_factory=lambda: ["call_expert"])
    max_tokens: int = 1024
    temperature: float = 0.0
    timeout_s: float = 600.0
    max_retries: int = 2
    simulate: str = "math-large"
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        _require(self.usd_per_million is None or (len(self.usd_per_million) == 2 and all(
            price >= 0 for price in self.usd_per_million)),
            "eval.monolith.usd_per_million must be null or [input, output], both >= 0")
        _require(self.max_tokens >= 1 and self.temperature >= 0 and self.time_scale >= 0
                 and self.timeout_s > 0 and self.max_retries >= 0,
                 "eval.monolith: max_tokens must be >= 1, timeout_s > 0, temperature, "
                 "time_scale and max_retries >= 0")


@dataclass
class EvalConfig:
    """``nemo-orch eval`` and the main job's evaluation: where results go and how the
    environment (``env.*``) is run.

    ``out_dir`` (null: ``<run.output_dir>/eval/<environment>``) holds the report and one
    per-example cache per agent (``episodes/<agent>.jsonl``): with ``resume`` a killed
    evaluation continues where it stopped. ``tasks``: the offline world's held-out tasks (the
    main job evaluates its policies on them, greedily, ``rollout.max_concurrent_episodes`` at
    once; its caches are ``<run>/eval/<environment>/episodes/<policy>.jsonl``).
    Episode ``i`` runs with seed ``seed + i`` (null: ``run.seed``) at ``temperature``;
    ``concurrency`` episodes at once, at most ``max_requests_per_endpoint`` requests in flight
    to each OpenAI-compatible endpoint the evaluation calls (orchestrator, monolith, judge).
    Where tasks come from is ``env.*`` (the old ``eval.data``, ``eval.domain``, ``eval.split``
    and ``eval.limit`` are :data:`MOVED_KEYS`)."""

    out_dir: Optional[str] = None
    tasks: int = 300
    seed: Optional[int] = None
    temperature: float = 0.0
    concurrency: int = 16
    max_requests_per_endpoint: int = 8
    resume: bool = True
    monolith: MonolithConfig = field(default_factory=MonolithConfig)

    def __post_init__(self) -> None:
        _require(self.tasks >= 1 and self.concurrency >= 1
                 and self.max_requests_per_endpoint >= 1,
                 "eval.tasks, eval.concurrency and eval.max_requests_per_endpoint must be >= 1")
        _require(self.temperature >= 0, "eval.temperature must be >= 0")


SERVE_KINDS = ("reward", "tool", "orchestrator")


@dataclass
class ServeConfig:
    """``nemo-orch serve reward|tool NAME|orchestrator``: where a server listens and how it batches.

    The reward and tool servers are PyTriton (KServe v2 over HTTP on ``http_port``, gRPC on
    ``grpc_port``); the orchestrator is OpenAI-compatible HTTP on ``http_port``. Every server
    exports Prometheus metrics on ``metrics_port`` (null: none). Triton merges requests that
    arrive within ``max_queue_delay_us`` into one batch of at most ``max_batch_size`` items,
    which is also the most items one request may carry; a text item may hold at most
    ``max_item_bytes`` bytes of UTF-8. PyTriton's files live in a fresh directory under
    ``workspace_root`` (null: the system's temporary directory), removed at shutdown, which
    waits at most ``shutdown_timeout_s`` for requests in flight. ``api_key_env`` names the
    variable holding the key the orchestrator's clients must send (null: none)."""

    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: Optional[int] = 8002
    max_batch_size: int = 64
    max_queue_delay_us: int = 2000
    max_item_bytes: int = 1 << 20
    shutdown_timeout_s: int = 3
    workspace_root: Optional[str] = None
    api_key_env: Optional[str] = None

    def __post_init__(self) -> None:
        ports = [self.http_port, self.grpc_port] + (
            [] if self.metrics_port is None else [self.metrics_port])
        _require(all(0 <= port <= 65535 for port in ports),
                 "serve.http_port, serve.grpc_port and serve.metrics_port must be in [0, 65535]")
        nonzero = [port for port in ports if port]
        _require(len(set(nonzero)) == len(nonzero),
                 "serve.http_port, serve.grpc_port and serve.metrics_port must differ")
        _require(self.max_batch_size >= 1 and self.max_queue_delay_us >= 0,
                 "serve.max_batch_size must be >= 1 and serve.max_queue_delay_us >= 0")
        _require(self.max_item_bytes >= 1, "serve.max_item_bytes must be >= 1")
        _require(1 <= self.shutdown_timeout_s <= 30, "serve.shutdown_timeout_s must be in [1, 30]")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def __post_init__(self) -> None:
        _require(self.model.num_layers % self.parallel.pp == 0,
                 "model.num_layers must be divisible by parallel.pp")
        _require(self.model.num_query_groups % self.parallel.tp == 0,
                 "model.num_query_groups must be divisible by parallel.tp")
        _require(self.model.vocab_size % self.parallel.tp == 0,
                 "model.vocab_size must be divisible by parallel.tp")
        _require(self.model.ffn_hidden_size % self.parallel.tp == 0,
                 "model.ffn_hidden_size must be divisible by parallel.tp")
        _require(not self.parallel.sequence_parallel or self.model.transformer_impl
                 == "transformer_engine", "parallel.sequence_parallel requires transformer_engine")
        micro_batches = self.trainer.global_batch_size // self.trainer.micro_batch_size
        _require(micro_batches % self.parallel.dp == 0,
                 "trainer.global_batch_size / trainer.micro_batch_size must be divisible by "
                 "parallel.dp")
        _require(self.data.seq_length <= self.model.max_position_embeddings,
                 "data.seq_length must be <= model.max_position_embeddings")
        _require(self.tokenizer.path is not None
                 or self.tokenizer.vocab_size <= self.model.vocab_size,
                 "tokenizer.vocab_size must be <= model.vocab_size")
        _require((self.rollout.max_context_tokens or 0) <= self.model.max_position_embeddings,
                 "rollout.max_context_tokens must be <= model.max_position_embeddings")

    def resolved_rollout(self) -> RolloutConfig:
        """``rollout`` with the context budget resolved (null: the model's positions)."""
        return dataclasses.replace(self.rollout, max_context_tokens=self.rollout.max_context_tokens
                                   or self.model.max_position_embeddings)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per data-parallel rank per step."""
        return self.trainer.global_batch_size // (self.trainer.micro_batch_size * self.parallel.dp)


RECIPES_DIR = CONF_DIR / "recipes"


def recipes() -> list[str]:
    """The names ``recipe=NAME`` accepts: the files of ``conf/recipes/``."""
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


def _recipe_overrides(overrides: list[str] | tuple[str, ...]) -> list[str]:
    """``recipe=NAME`` selects ``conf/recipes/NAME.yaml``: a config group (Hydra's ``recipes``,
    last in ``train.yaml``'s defaults) whose files are ``@package _global_`` with their own
    ``override /group: option`` defaults, so a recipe composes over the defaults and the
    command line's overrides still win."""
    selected = []
    for override in overrides:
        key, _, name = override.partition("=")
        if key not in ("recipe", "recipes"):
            selected.append(override)
            continue
        _require(name in recipes(), f"unknown recipe {name!r}; available: "
                 f"{', '.join(recipes()) or 'none'} (conf/recipes/)")
        selected.append(f"recipes={name}")
    return selected


def _check_moved(overrides: list[str] | tuple[str, ...]) -> None:
    for override in overrides:
        key = override.partition("=")[0].lstrip("+~")
        _require(key not in MOVED_KEYS, f"{key} is now {MOVED_KEYS.get(key)} (where tasks come "
                 "from lives under env.*, how they are evaluated under eval.*)")


def compose(config_name: str = "train", overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with Hydra overrides (``key=value``, ``group=option``,
    ``recipe=NAME``)."""
    _check_moved(overrides)
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException

    # The env presets start from the schema (`defaults: [schema]`), so every option can be set
    # on any of them; which ones a kind reads is checked on validation.
    ConfigStore.instance().store(group="env", name="schema", node=EnvConfig)

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra_compose(config_name, overrides=_recipe_overrides(overrides))
    except HydraException as error:
        raise ConfigError(_hydra_message(error)) from None


def _hydra_message(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    # Hydra's search-path listing and doc links help nobody fix a typo.
    kept = [line for line in lines if not line.startswith(
        ("Config search path", "\tprovider", "See https://", "To append to your config"))]
    if kept and kept[0].startswith("Could not override"):
        kept[0] = kept[0].replace("Could not override", "Unknown config key")
    return "\n".join(kept)


def validate(tree: DictConfig | dict) -> Config:
    """Check a composed tree against the schema and build the typed :class:`Config`."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), tree)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None)
        reason = str(error).splitlines()[0]
        raise ConfigError(f"{key}: {reason}" if key else reason) from None


def load(overrides: list[str] | tuple[str, ...] = (), config_name: str = "train") -> Config:
    """Compose, resolve and validate: the single entry point for configuration."""
    return validate(compose(config_name, overrides))


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def load_saved(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Reload a config saved beside a checkpoint, with ``key=value`` overrides, validated again."""
    path = Path(path)
    _require_file(str(path), "config")
    try:
        tree = OmegaConf.load(path)
        _drop_moved(tree)
        tree.merge_with_dotlist(list(overrides))
    except Exception as error:  # malformed YAML or override of any kind
        raise ConfigError(f"{path}: not a readable YAML config ({error})") from None
    return validate(tree)


def _drop_moved(tree: DictConfig) -> None:
    """A config saved before a key moved (:data:`MOVED_KEYS`) still loads: the old key goes, the
    new one keeps the value the saved config holds for it."""
    for key in MOVED_KEYS:
        section, _, name = key.rpartition(".")
        node = OmegaConf.select(tree, section)
        if isinstance(node, DictConfig) and name in node:
            del node[name]


def replace(config: Config, **sections: object) -> Config:
    """A copy with whole sections replaced, validated again."""
    return validate(OmegaConf.structured(dataclasses.replace(config, **sections)))
