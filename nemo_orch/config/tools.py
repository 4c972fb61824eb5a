"""``tools.*``: tool declarations, domains, the result cache, prices and expert endpoints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from nemo_orch.config.base import _require, resolve_conf_path


@dataclass
class McpServerConfig:
    """An MCP server whose tools join the toolbox (``tools.mcp``): reached over ``stdio`` (the
    toolbox starts ``command`` with ``args``) or streamable HTTP (``url``). Its tools are named
    ``<name>_<tool>`` and offered with their own descriptions and input schemas."""

    # Prefix of its tools' names (an identifier).
    name: str = ""
    # stdio: the server's command (it is started with the toolbox, and stopped with it).
    command: Optional[str] = None
    # stdio: the command's arguments.
    args: list[str] = field(default_factory=list)
    # stdio: names of environment variables the server gets (their values are never logged).
    env: list[str] = field(default_factory=list)
    # Streamable HTTP: the server's endpoint (e.g. http://127.0.0.1:8000/mcp).
    url: Optional[str] = None
    # Streamable HTTP: header name -> the environment variable holding its value (a secret).
    headers: dict[str, str] = field(default_factory=dict)
    # The tools taken (null: all it lists), less those in deny.
    allow: Optional[list[str]] = None
    # Tools not taken.
    deny: list[str] = field(default_factory=list)
    # USD per call of each tool, by the server's tool name; per_call_usd for the others.
    prices: dict[str, float] = field(default_factory=dict)
    # USD per call of a tool without a price of its own.
    per_call_usd: float = 0.0
    # A call's modeled seconds (tools.timing=modeled), by tool name; latency_hint_s otherwise.
    latencies: dict[str, float] = field(default_factory=dict)
    # The modeled seconds of a tool without a latency of its own.
    latency_hint_s: float = 1.0
    # Seconds a call may take.
    timeout_s: float = 60.0
    # Seconds connecting may take (a stdio server's start, the HTTP handshake), apart from a
    # call's timeout_s.
    connect_timeout_s: float = 30.0
    # Times in a row a failed or lost connection is made again; past them the server is left
    # alone for cooldown_s (its tools' calls fail at once, as infra_error), then tried again. A
    # call the server answers resets the count.
    restarts: int = 3
    # Seconds a server whose restarts in a row are used up is left alone.
    cooldown_s: float = 30.0
    # The server is an orchestrator (`nemo-orch serve mcp`): each call is billed its episode's
    # ledger.cost_usd on top of the per-call price, and the episode is kept with the caller's.
    orchestrator: bool = False

    def __post_init__(self) -> None:
        _require(
            self.name.isidentifier(), f"tools.mcp: name must be an identifier, got {self.name!r}"
        )
        _require(
            (self.command is None) != (self.url is None),
            f"tools.mcp.{self.name}: give command (stdio) or url (streamable HTTP), one",
        )
        _require(
            self.url is None or self.url.startswith(("http://", "https://")),
            f"tools.mcp.{self.name}.url must be an http(s) URL, got {self.url!r}",
        )
        _require(
            self.timeout_s > 0
            and self.connect_timeout_s > 0
            and self.latency_hint_s >= 0
            and self.per_call_usd >= 0
            and all(v >= 0 for v in [*self.prices.values(), *self.latencies.values()]),
            f"tools.mcp.{self.name}: timeout_s and connect_timeout_s must be > 0, prices "
            "and latencies >= 0",
        )
        _require(
            self.restarts >= 0 and self.cooldown_s >= 0,
            f"tools.mcp.{self.name}.restarts and cooldown_s must be >= 0",
        )


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
    # `base_url`: how a launch hands the servers it started to the job (+tools.endpoints.math=URL).
    endpoints: dict[str, str] = field(default_factory=dict)
    # SIMULATED latency: every call of a tool first waits this long (seconds), as a remote
    # expert's 10-100 s would, so the offline world can measure what waiting on tools costs
    # (benchmarks/grpo_step.py). 0: off.
    simulated_latency_s: float = 0.0
    # How a call's seconds are billed and counted in the reward: `modeled`, each tool's model of
    # its time (a simulated expert's tokens over its speed, any other tool's latency_hint_s) and
    # the policy's turns at rollout.tokens_per_second, so rewards and costs do not depend on the
    # machine's load and a seed gives the same run (the offline worlds'); or `measured`
    # wall-clock time (tools=experts and reference: a deployment whose reward counts latency).
    timing: str = "modeled"
    # MCP servers whose tools join the declared ones (see McpServerConfig).
    mcp: list[McpServerConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        for key in ("declarations", "domains"):
            for index, path in enumerate(getattr(self, key)):
                _require(
                    resolve_conf_path(path).exists(),
                    f"tools.{key}[{index}]: no such file or directory: {path}",
                )
        _require(
            self.cache_entries >= 0 and self.cache_mb >= 0,
            "tools.cache_entries and tools.cache_mb must be >= 0",
        )
        _require(self.simulated_latency_s >= 0, "tools.simulated_latency_s must be >= 0")
        _require(
            self.timing in ("measured", "modeled"),
            f"tools.timing must be measured|modeled, got {self.timing!r}",
        )
        for model, prices in self.prices.items():
            _require(
                len(prices) == 2 and all(price >= 0 for price in prices),
                f"tools.prices.{model} must be [input, output] USD per million tokens, both >= 0",
            )
        for alias, url in self.endpoints.items():
            _require(
                url.startswith(("http://", "https://")),
                f"tools.endpoints.{alias} must be an http(s) URL, got {url!r}",
            )
