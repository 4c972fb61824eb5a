"""``synth.*``: the ToolScale synthesis pipeline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from nemo_orch.config.base import _require
from nemo_orch.config.dialect import DEFAULT_DIALECT, parse_dialect


@dataclass
class SynthConfig:
    """``nemo-orch synth``: the ToolScale synthesis pipeline (``envs/toolscale/synth.py``).

    Each step is one chat request to ``base_url`` (OpenAI-compatible, ``model``, asked in its
    ``dialect``: :mod:`nemo_orch.config.dialect`; the key read from the environment variable
    ``api_key_env``); a reply that does not parse or check is sent
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
    dialect: Any = DEFAULT_DIALECT
    out_dir: str = "runs/synth"
    # Domains synthesized.
    num_domains: int = 1
    records_per_table: int = 10
    num_purposes: int = 5
    tasks_per_purpose: int = 3
    evolve_rounds: int = 1
    max_actions: int = 12
    max_retries: int = 2
    max_llm_calls: Optional[int] = None
    max_usd: Optional[float] = None
    # The synthesis model's price of input tokens (USD per million), for max_usd.
    input_usd_per_million: float = 0.0
    # The synthesis model's price of output tokens (USD per million).
    output_usd_per_million: float = 0.0
    # Sampling temperature of every request.
    temperature: float = 0.7
    # Most tokens a reply may have.
    max_tokens: int = 8192
    # Seconds each request may take.
    timeout_s: float = 300.0
    concurrency: int = 4

    def __post_init__(self) -> None:
        _require(
            self.base_url is None or self.model is not None, "synth.base_url needs synth.model"
        )
        for name in (
            "num_domains",
            "records_per_table",
            "num_purposes",
            "tasks_per_purpose",
            "max_actions",
            "max_tokens",
            "concurrency",
        ):
            _require(getattr(self, name) >= 1, f"synth.{name} must be >= 1")
        _require(
            self.evolve_rounds >= 0 and self.max_retries >= 0,
            "synth.evolve_rounds and synth.max_retries must be >= 0",
        )
        _require(
            self.max_llm_calls is None or self.max_llm_calls >= 1,
            "synth.max_llm_calls must be null or >= 1",
        )
        _require(
            self.input_usd_per_million >= 0 and self.output_usd_per_million >= 0,
            "synth prices must be >= 0",
        )
        _require(
            self.max_usd is None
            or (self.max_usd > 0 and self.input_usd_per_million + self.output_usd_per_million > 0),
            "synth.max_usd must be > 0 and needs a price (synth.*_usd_per_million)",
        )
        _require(
            self.temperature >= 0 and self.timeout_s > 0,
            "synth.temperature must be >= 0 and synth.timeout_s > 0",
        )
        parse_dialect(self.dialect, "synth.dialect")
