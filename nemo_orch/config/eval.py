"""``eval.*``: how an evaluation runs, and the monolith baseline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from nemo_orch.config.base import _require
from nemo_orch.config.dialect import parse_dialect


@dataclass
class MonolithConfig:
    """The monolith baseline: one OpenAI-compatible chat model (``model`` at ``base_url``, key
    from the environment variable ``api_key_env``) with the benchmark's tools except
    ``drop_tools`` (the experts), or the tools ``tools`` declares (paths relative to ``conf/``:
    the basic search and sandbox where the benchmark offers only ToolOrchestra's composites),
    called with standard function calling. Priced at
    ``usd_per_million`` (input, output) or, when null, the price table's entry for ``model``.
    Each request gets ``timeout_s`` (reasoning models take minutes) and ``max_retries``, and is
    asked in ``dialect`` (:mod:`nemo_orch.config.dialect`; the default model, gpt-5, is a
    reasoning model: ``openai-reasoning``, which sends no temperature).

    With ``base_url`` null on the offline benchmark, a SIMULATED frontier model is served on
    127.0.0.1 for the evaluation (``nemo_orch/eval/simulated_chat.py``): the offline experts'
    alias ``simulate``, sleeping ``time_scale`` times its simulated generation time."""

    base_url: Optional[str] = None
    model: str = "gpt-5"
    api_key_env: Optional[str] = None
    usd_per_million: Optional[list[float]] = None
    drop_tools: list[str] = field(default_factory=lambda: ["call_expert"])
    tools: Optional[list[str]] = None
    # Most tokens of each reply.
    max_tokens: int = 1024
    # Sampling temperature (not sent in the openai-reasoning dialect).
    temperature: float = 0.0
    dialect: Any = "openai-reasoning"
    timeout_s: float = 600.0
    max_retries: int = 2
    simulate: str = "math-large"
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        _require(
            self.usd_per_million is None
            or (
                len(self.usd_per_million) == 2 and all(price >= 0 for price in self.usd_per_million)
            ),
            "eval.monolith.usd_per_million must be null or [input, output], both >= 0",
        )
        _require(
            self.max_tokens >= 1
            and self.temperature >= 0
            and self.time_scale >= 0
            and self.timeout_s > 0
            and self.max_retries >= 0,
            "eval.monolith: max_tokens must be >= 1, timeout_s > 0, temperature, "
            "time_scale and max_retries >= 0",
        )
        parse_dialect(self.dialect, "eval.monolith.dialect")


@dataclass
class EvalConfig:
    """``nemo-orch eval`` and the main job's evaluation: where results go and how the
    environment (``env.*``) is run.

    ``out_dir`` (null: ``<run.output_dir>/eval/<environment>``) holds the report and one
    per-example cache per agent (``episodes/<agent>.jsonl``): with ``resume`` a killed
    evaluation continues where it stopped. ``tasks``: the offline world's held-out tasks (the
    main job evaluates its policies on them, greedily, ``rollout.max_concurrent_episodes`` at
    once; its caches are ``<run>/eval/<environment>/episodes/<policy>.jsonl``).
    ``num_trials``: each task that many times (trial ``t``'s episode of task ``j`` is episode
    ``t * tasks + j``), the report then giving pass^k for k = 1..num_trials (tau2-bench's
    measure).
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
    # Keep a journal of each system's episodes (episodes/<agent>.db): a killed evaluation
    # continues its unfinished episodes from their last completed turn and call.
    journal: bool = True
    num_trials: int = 1
    monolith: MonolithConfig = field(default_factory=MonolithConfig)

    def __post_init__(self) -> None:
        _require(
            self.tasks >= 1
            and self.concurrency >= 1
            and self.max_requests_per_endpoint >= 1
            and self.num_trials >= 1,
            "eval.tasks, eval.concurrency, eval.max_requests_per_endpoint and "
            "eval.num_trials must be >= 1",
        )
        _require(self.temperature >= 0, "eval.temperature must be >= 0")
