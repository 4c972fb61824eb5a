"""``rollout.*``: episodes, the engine that generates them and the Ray backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from nemo_orch.config.base import _require, _require_file
from nemo_orch.config.dialect import DEFAULT_DIALECT, parse_dialect


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
        _require(
            self.num_workers >= 1 and self.num_scorers >= 1,
            "rollout.ray.num_workers and rollout.ray.num_scorers must be >= 1",
        )
        _require(self.num_cpus_per_worker > 0, "rollout.ray.num_cpus_per_worker must be > 0")
        # Ray refuses an object store under 75 MiB.
        _require(self.object_store_mb >= 75, "rollout.ray.object_store_mb must be >= 75")
        _require(self.max_replacements >= 0, "rollout.ray.max_replacements must be >= 0")


@dataclass
class ExternalAgentConfig:
    """``rollout.agent=external``: the episodes are run by an agent loop of the user's own (an
    ``openai``-SDK loop, the OpenAI Agents SDK, LangGraph) against an OpenAI-compatible training
    endpoint on ``host:port`` (0: a free port; written to the stage's ``agent_endpoint.json``), which
    records every turn's exact tokens (:mod:`nemo_orch.rollout.external`). ``harness``: the loop
    as ``module:function`` or ``path/to/file.py:function``, called in a thread per episode with
    its :class:`~nemo_orch.rollout.agent_episode.AgentEpisode`; null: loops in processes of their own
    take episodes from ``POST /v1/episodes/next``. An episode whose end is not reported within
    ``episode_timeout_s`` is abandoned: an infrastructure failure, never trained on."""

    # The agent loop to call per episode (module:function or file.py:function); null: loops in
    # processes of their own take episodes over HTTP.
    harness: Optional[str] = None
    # Where the training endpoint listens.
    host: str = "127.0.0.1"
    # The endpoint's port (0: a free one, written to the stage's agent_endpoint.json).
    port: int = 0
    # Seconds an episode may take before it is abandoned (agent_error, never trained on).
    episode_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        _require(
            self.harness is None or ":" in self.harness,
            f"rollout.external.harness must be module:function or file.py:function, "
            f"got {self.harness!r}",
        )
        _require(0 <= self.port <= 65535, "rollout.external.port must be in [0, 65535]")
        _require(self.episode_timeout_s > 0, "rollout.external.episode_timeout_s must be > 0")


@dataclass
class RolloutConfig:
    """Episodes and the engine that generates them.

    ``policy``: a checkpoint (``step_N`` or ``checkpoints/``) or an HF model directory for the
    ``hf`` engine; null takes the run's latest checkpoint. ``openai`` serves from ``base_url``
    (key read from the environment variable ``api_key_env``), asked in its ``dialect``
    (:mod:`nemo_orch.config.dialect`: its ``extra_body``; a policy is sampled, so its dialect
    takes sampling parameters). ``max_context_tokens`` null means the model's
    ``max_position_embeddings``. ``max_turns``, ``max_new_tokens`` and
    ``max_observation_tokens`` bound episodes without a user; a conversation with a user
    (tau2-bench's protocol, ``env.user``) is bounded by tau2's step and error limits and the
    context alone, as tau2's runner bounds it.

    The GPU engines (``trtllm``, ``vllm``) run ``engine_tp``-way tensor parallel in
    ``engine_dtype``. ``colocate``: train and generate on the same GPUs -- the engine sleeps
    while the policy trains (releasing its KV cache and, at ``sleep_level`` 2, its weights;
    level 1 keeps a CPU copy of them) and wakes to be refit and generate; false: the engine
    never sleeps and keeps its memory (it has GPUs of its own once the Ray scale-out places
    it). Only vLLM can sleep; TensorRT-LLM keeps its KV cache either way. ``gpu_memory_utilization``
    is vLLM's share of each GPU's memory (weights + KV cache) and TensorRT-LLM's share of the
    memory left free after loading the weights (its KV cache). The CPU engine ignores these.

    ``refit_bucket_mb``: the trained weights reach the engine in buckets of at most this many
    MiB of full tensors (whole decoder layers; a larger layer alone), gathered from the TP/PP
    ranks of one data-parallel replica (:func:`nemo_orch.models.weights.hf_weight_buckets`).
    ``engine_threads``: torch's intra-op threads in the thread where GRPO's CPU engine generates
    beside the trainer. That thread gets an OpenMP team of its own, and two teams on the same
    cores throttle each other: on 2 cores, GRPO of the micro policy stepped 1.4x faster with the
    engine on 1 thread (the trainer on 2) than with both on 2 (``benchmarks/vs_trl.py``).
    Evaluations and other rollouts, with no trainer beside them, keep torch's default.

    ``prefix_caching``: reuse the keys and values of prompt prefixes the engine has seen (an
    episode's earlier turns, its group's shared prompt) instead of computing them again -- vLLM's
    and TensorRT-LLM's own prefix caches (TensorRT-LLM's on a refittable engine only where its
    RLHF extension can reset it), the CPU engine's block cache
    (:mod:`nemo_orch.rollout.engines.prefix_cache`); every refit empties them.
    ``prefix_cache_mb``: the bound on the CPU engine's prefix cache, in MiB of float32 keys and
    values, least recently used blocks evicted first (a token takes 2 KiB in the micro model, 224
    KiB in Qwen3-0.6B).

    ``backend``: ``local`` runs every episode on this process's event loop; ``ray`` spreads them
    over Ray actors (``ray.*``, :class:`RayConfig`) with the same results for the same seeds,
    sampled tokens included (each turn's seed travels with its prompt into the engine). A Ray
    worker runs whole groups, each episode on one engine from its first turn to its last, so
    the engine's prefix cache serves its turns and its group.
    """

    # The policy's engine: `hf` (CPU), `trtllm`, `vllm` (GPU) or `openai` (served).
    engine: str = "hf"
    policy: Optional[str] = None
    base_url: Optional[str] = None
    # The served model's name at base_url (engine openai).
    model_name: Optional[str] = None
    api_key_env: Optional[str] = None
    dialect: Any = DEFAULT_DIALECT
    colocate: bool = True
    engine_tp: int = 1
    engine_dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    sleep_level: int = 1
    refit_bucket_mb: int = 512
    engine_threads: int = 1
    # Episodes per task: a GRPO group (16 rather than 8: the main job closed more of its gap
    # on each of four seeds, docs/main_job.md).
    group_size: int = 16
    max_turns: int = 10
    max_new_tokens: int = 96
    max_context_tokens: Optional[int] = None
    max_observation_tokens: int = 512
    # Sampling temperature (0: greedy).
    temperature: float = 1.0
    # Nucleus sampling's probability mass (1: off).
    top_p: float = 1.0
    # Sample from the k most likely tokens only (0: off).
    top_k: int = 0
    # How the policy answers: a final <answer>...</answer> (`tag`) or a call of the answer tool
    # (`tool`).
    answer_format: str = "tag"
    # Several tool calls in one turn: all run (`parallel`), or the first only, the rest a format
    # error (`first`).
    multiple_calls: str = "parallel"
    # Episodes in flight at once (each with its tool calls and user).
    max_concurrent_episodes: int = 64
    # Most prompts the engine generates for in one batch.
    max_batch_size: int = 64
    # The orchestrator's own price (USD per million tokens), counted in every trajectory's cost.
    input_usd_per_million: float = 0.2
    # The orchestrator's price of its output tokens (USD per million).
    output_usd_per_million: float = 0.2
    # The orchestrator's modeled speed: its turns' seconds under tools.timing=modeled.
    tokens_per_second: float = 100.0
    # Check each turn that the kept tokens decode to the chat template's rendering (never
    # re-tokenized).
    check_template: bool = True
    # The most of a training step's episodes that failures outside the policy may decide (an
    # infra_error call, a failing user or policy endpoint, a judge that could not score): such
    # episodes are masked out of their groups and the loss; past this share the step stops,
    # naming the failing endpoints, rather than train on what is left (nemo_orch/call_kinds.py).
    max_infra_error_rate: float = 0.2
    prefix_caching: bool = True
    prefix_cache_mb: int = 512
    backend: str = "local"
    ray: RayConfig = field(default_factory=RayConfig)
    # Who runs the episodes: the built-in loop, or an agent loop of the user's own through the
    # training endpoint (`external`, ExternalAgentConfig).
    agent: str = "builtin"
    external: ExternalAgentConfig = field(default_factory=ExternalAgentConfig)

    def __post_init__(self) -> None:
        _require(self.tokens_per_second > 0, "rollout.tokens_per_second must be > 0")
        _require(
            self.backend in ("local", "ray"),
            f"rollout.backend must be local|ray, got {self.backend!r}",
        )
        _require(
            self.backend == "local" or self.engine in ("hf", "openai"),
            f"rollout.backend=ray runs the CPU and served engines (hf|openai); "
            f"rollout.engine={self.engine} needs rollout.backend=local",
        )
        _require(
            self.agent in ("builtin", "external"),
            f"rollout.agent must be builtin|external, got {self.agent!r}",
        )
        _require(
            self.agent == "builtin" or self.backend == "local",
            "rollout.agent=external serves the episodes from this process's engine: it needs "
            "rollout.backend=local",
        )
        _require(
            self.engine in ("hf", "trtllm", "vllm", "openai"),
            f"rollout.engine must be hf|trtllm|vllm|openai, got {self.engine!r}",
        )
        _require(
            self.engine != "openai" or (self.base_url and self.model_name),
            "rollout.engine=openai needs rollout.base_url and rollout.model_name",
        )
        _require(
            parse_dialect(self.dialect, "rollout.dialect").sampling,
            "rollout.dialect: the policy is sampled (temperature, top_p); its dialect "
            "must take sampling parameters",
        )
        _require(
            self.colocate or self.engine in ("trtllm", "vllm"),
            f"rollout.colocate=false only applies to the GPU engines (trtllm|vllm); "
            f"rollout.engine={self.engine} has no GPUs to give back",
        )
        _require(self.engine_tp >= 1, "rollout.engine_tp must be >= 1")
        _require(
            self.engine_dtype in ("bfloat16", "float16", "float32"),
            f"rollout.engine_dtype must be bfloat16|float16|float32, got {self.engine_dtype!r}",
        )
        _require(
            0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization must be in (0, 1]"
        )
        _require(self.sleep_level in (1, 2), "rollout.sleep_level must be 1 or 2")
        _require_file(self.policy, "rollout.policy")
        for name in (
            "refit_bucket_mb",
            "engine_threads",
            "group_size",
            "max_turns",
            "max_new_tokens",
            "max_observation_tokens",
            "max_concurrent_episodes",
            "max_batch_size",
            "prefix_cache_mb",
        ):
            _require(getattr(self, name) >= 1, f"rollout.{name} must be >= 1")
        _require(
            self.max_context_tokens is None or self.max_context_tokens > 2,
            "rollout.max_context_tokens must be > 2",
        )
        _require(
            self.temperature >= 0 and 0 < self.top_p <= 1 and self.top_k >= 0,
            "rollout.temperature must be >= 0, rollout.top_p in (0, 1], rollout.top_k >= 0",
        )
        _require(
            self.answer_format in ("tag", "tool"),
            f"rollout.answer_format must be tag|tool, got {self.answer_format!r}",
        )
        _require(
            self.multiple_calls in ("first", "parallel"),
            f"rollout.multiple_calls must be first|parallel, got {self.multiple_calls!r}",
        )
        _require(
            self.input_usd_per_million >= 0 and self.output_usd_per_million >= 0,
            "rollout prices must be >= 0",
        )
        _require(
            0 <= self.max_infra_error_rate <= 1, "rollout.max_infra_error_rate must be in [0, 1]"
        )
