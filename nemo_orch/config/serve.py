"""``serve.*``: where a server listens and how it batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nemo_orch.config.base import _require

SERVE_KINDS = ("reward", "tool", "orchestrator", "mcp")
MCP_TRANSPORTS = ("stdio", "http")


@dataclass
class ServeConfig:
    """``nemo-orch serve reward|tool NAME|orchestrator|mcp``: where a server listens and how
    it batches.

    The reward and tool servers are PyTriton (KServe v2 over HTTP on ``http_port``, gRPC on
    ``grpc_port``); the orchestrator is OpenAI-compatible HTTP on ``http_port``. Every server
    exports Prometheus metrics on ``metrics_port`` (null: none). Triton merges requests that
    arrive within ``max_queue_delay_us`` into one batch of at most ``max_batch_size`` items,
    which is also the most items one request may carry; a text item may hold at most
    ``max_item_bytes`` bytes of UTF-8. PyTriton's files live in a fresh directory under
    ``workspace_root`` (null: the system's temporary directory), removed at shutdown, which
    waits at most ``shutdown_timeout_s`` for requests in flight. ``api_key_env`` names the
    variable holding the key the orchestrator's clients (its OpenAI routes, MCP over http) must
    send (null: none).
    ``nemo-orch serve mcp`` speaks MCP over ``mcp_transport``: ``stdio`` (the client starts the
    process) or ``http`` (streamable HTTP at ``/mcp`` on ``http_port``)."""

    # The address the servers listen on.
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
    mcp_transport: str = "stdio"

    def __post_init__(self) -> None:
        ports = [self.http_port, self.grpc_port] + (
            [] if self.metrics_port is None else [self.metrics_port]
        )
        _require(
            all(0 <= port <= 65535 for port in ports),
            "serve.http_port, serve.grpc_port and serve.metrics_port must be in [0, 65535]",
        )
        nonzero = [port for port in ports if port]
        _require(
            len(set(nonzero)) == len(nonzero),
            "serve.http_port, serve.grpc_port and serve.metrics_port must differ",
        )
        _require(
            self.max_batch_size >= 1 and self.max_queue_delay_us >= 0,
            "serve.max_batch_size must be >= 1 and serve.max_queue_delay_us >= 0",
        )
        _require(self.max_item_bytes >= 1, "serve.max_item_bytes must be >= 1")
        _require(1 <= self.shutdown_timeout_s <= 30, "serve.shutdown_timeout_s must be in [1, 30]")
        _require(
            self.mcp_transport in MCP_TRANSPORTS,
            f"serve.mcp_transport must be one of "
            f"{', '.join(MCP_TRANSPORTS)}, got {self.mcp_transport!r}",
        )
