"""``tools.*``: tool declarations, domains, the result cache, prices and expert endpoints."""

from __future__ import annotations

from dataclasses import dataclass, field

from nemo_orch.config.base import _require, resolve_conf_path


@dataclass
class ToolsConfig:
    """Tool declaration files, or directories of them (one YAML/JSON file per tool), domain
    files (``Domain.save``: their tools act on each episode's database, and their tasks are
    scored on it) and the cache of deterministic tools' results."""

    # Tool declaration files or directories (relative to conf/): the tools the policy is offered.
    declarations: list[str] = field(default_factory=lambda: ["tools/orchestra"])
    # Domain files (Domain.save): tools acting on each episode's database, tasks scored on it.
    domains: list[str] = field(default_factory=list)
    # Most results the deterministic tools' cache keeps (0: no cache).
    cache_entries: int = 4096
    # Most MiB of results the cache keeps.
    cache_mb: int = 64
    # USD per million (input, output) tokens of models, over the built-in list prices
    # (nemo_orch/tools/pricing.py): how a price table is swapped at evaluation time.
    prices: dict[str, list[float]] = field(default_factory=dict)
    # List each model's price in the tools the policy is offered (as ToolOrchestra's tool
    # descriptions do), so a trained policy can read a changed price table.
    show_prices: bool = True
    # Base URLs of expert models by alias (an LLM tool's `models` key), over the declarations'
    # `base_url`: how a launch hands the servers it started to the job (tools.endpoints.math=URL).
    endpoints: dict[str, str] = field(default_factory=dict)
    # SIMULATED latency: every call of a tool first waits this long (seconds), as a remote
    # expert's 10-100 s would, so the offline world can measure what waiting on tools costs
    # (benchmarks/grpo_step.py). 0: off.
    simulated_latency_s: float = 0.0
    # How a call's seconds are billed and counted in the reward: `measured` wall-clock time (what
    # a deployment whose reward counts latency wants), or `modeled`: each tool's model of its
    # time (a simulated expert's tokens over its speed, any other tool's latency_hint_s) and the
    # policy's turns at rollout.tokens_per_second, so rewards and costs do not depend on the
    # machine's load and a seed gives the same run (the main job's setting).
    timing: str = "measured"

    def __post_init__(self) -> None:
        for key in ("declarations", "domains"):
            for index, path in enumerate(getattr(self, key)):
                _require(resolve_conf_path(path).exists(),
                         f"tools.{key}[{index}]: no such file or directory: {path}")
        _require(self.cache_entries >= 0 and self.cache_mb >= 0,
                 "tools.cache_entries and tools.cache_mb must be >= 0")
        _require(self.simulated_latency_s >= 0, "tools.simulated_latency_s must be >= 0")
        _require(self.timing in ("measured", "modeled"),
                 f"tools.timing must be measured|modeled, got {self.timing!r}")
        for model, prices in self.prices.items():
            _require(len(prices) == 2 and all(price >= 0 for price in prices),
                     f"tools.prices.{model} must be [input, output] USD per million tokens, "
                     "both >= 0")
        for alias, url in self.endpoints.items():
            _require(url.startswith(("http://", "https://")),
                     f"tools.endpoints.{alias} must be an http(s) URL, got {url!r}")
