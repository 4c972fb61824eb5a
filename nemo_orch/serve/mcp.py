"""``nemo-orch serve mcp``: the orchestrator as a Model Context Protocol server, so agent
applications (and other orchestrators, :mod:`nemo_orch.tools.orchestrator`) call it as they call
any MCP tool. Built on the official ``mcp`` SDK's low-level server.

It offers one tool, ``solve`` (arguments :data:`~nemo_orch.tools.orchestrator.SOLVE_PARAMETERS`:
``question``, ``preference``?), which runs one episode of ``/v1/orchestrate``'s loop — the same
:class:`~nemo_orch.serve.orchestrator.Orchestration` over the configured policy, tools and
``rollout.*`` — and answers with

- structured content: ``/v1/orchestrate``'s answer (``answer``, ``finish_reason``, ``seed``,
  ``turns``, ``messages``, and the ``ledger`` with ``cost_usd`` and ``calls``), the tool's
  declared output schema;
- text content: the answer and its bill
  (:func:`~nemo_orch.tools.orchestrator.orchestration_text`), for clients that read text.

A request the orchestrator refuses (an unknown preference feature) or cannot answer (its
experts down: ``/v1/orchestrate``'s 503) is an ``isError`` result saying why after the status
``/v1/orchestrate`` would answer (``HTTP 400 (invalid_request_error): ...``), which a calling
orchestrator reads as the call's kind (:func:`~nemo_orch.tools.orchestrator.failure_kind`). Transports (``serve.mcp_transport``):

- ``stdio``: the client starts the process and speaks on its stdin and stdout; the protocol
  keeps stdout to itself (whatever else the process writes goes to stderr). It serves until
  the client closes stdin (or SIGTERM, Ctrl-C). No key (whoever starts it holds its
  environment), no metrics port (a client may start several side by side).
- ``http``: streamable HTTP at ``http://serve.host:serve.http_port/mcp``, stateless (each request
  stands alone: an episode needs no session, and replicas can share a load balancer), with
  ``serve.api_key_env``'s key required as a bearer token and ``solve`` calls counted in metrics
  on ``serve.metrics_port``.
"""

from __future__ import annotations

import asyncio
import hmac
import io
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_orch.config import Config, RolloutConfig, ServeConfig
from nemo_orch.rollout.engines.base import Engine
from nemo_orch.serve.http_server import RequestError
from nemo_orch.serve.metrics import ServeMetrics
from nemo_orch.serve.openai_server import OpenAIService
from nemo_orch.serve.orchestrator import Orchestration, api_key_of, served_policy
from nemo_orch.tools.orchestrator import (
    SEED_META,
    SOLVE_PARAMETERS,
    failure_text,
    orchestration_text,
)
from nemo_orch.tools.registry import Toolbox

SOLVE = "solve"
MCP_PATH = "/mcp"
# What `solve` answers: /v1/orchestrate's body (nemo_orch.serve.orchestrator), its core declared.
ORCHESTRATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"type": ["string", "null"]},
        "finish_reason": {"type": "string"},
        "seed": {"type": "integer"},
        "turns": {"type": "integer"},
        "messages": {"type": "array", "items": {"type": "object"}},
        "ledger": {
            "type": "object",
            "properties": {
                "cost_usd": {"type": "number", "minimum": 0},
                "calls": {"type": "array", "items": {"type": "object"}},
            },
            "required": ["cost_usd", "calls"],
        },
    },
    "required": ["answer", "finish_reason", "seed", "turns", "messages", "ledger"],
}


def mcp_server(orchestration: Orchestration, metrics: ServeMetrics | None = None) -> Any:
    """The SDK's low-level ``Server`` offering ``solve`` over ``orchestration``; ``metrics``
    counts its calls."""
    from mcp import types
    from mcp.server.lowlevel import Server

    name = orchestration.service.model_name
    server = Server(f"nemo-orch-{name}")
    solve = types.Tool(
        name=SOLVE,
        inputSchema=SOLVE_PARAMETERS,
        outputSchema=ORCHESTRATION_SCHEMA,
        description=f"Solve a task with the orchestrator {name}: it calls its own tools and "
        "expert models as it sees fit and answers, with the cost in USD of "
        "everything it used and the calls it made.",
    )

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        return [solve]

    @server.call_tool()
    async def call_tool(
        tool: str, arguments: dict[str, Any]
    ) -> tuple[list[types.TextContent], dict[str, Any]]:
        if tool != SOLVE:
            raise ValueError(f"unknown tool {tool!r}; this server offers {SOLVE}")
        started, status = time.perf_counter(), "error"
        try:
            # A calling orchestrator sends the episode's seed beside the arguments, so its own
            # episode replays whole; without one the orchestration draws one.
            meta = server.request_context.meta
            seed = getattr(meta, SEED_META, None) if meta is not None else None
            request = arguments if seed is None else {**arguments, "seed": seed}
            # Episodes run on the orchestration's own loop; this one only waits for them.
            body = await asyncio.to_thread(orchestration.orchestrate, request)
            status = "ok"
        except RequestError as error:
            status = "bad_request" if error.status < 500 else "error"
            # The SDK answers it as an isError result, its status stated for a calling
            # orchestrator to tell a refusal from a failure behind this one.
            raise ValueError(failure_text(error.status, error.kind, str(error))) from None
        finally:
            if metrics is not None:
                metrics.observe(SOLVE, status, time.perf_counter() - started)
        return [types.TextContent(type="text", text=orchestration_text(body))], body

    return server


class _Authorized:
    """The streamable HTTP endpoint, behind ``api_key`` (None: open) as a bearer token."""

    def __init__(self, manager: Any, api_key: str | None) -> None:
        self.manager, self.api_key = manager, api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        from starlette.responses import JSONResponse

        if self.api_key is not None:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                refused = JSONResponse(
                    {
                        "error": {
                            "message": "missing or wrong API key",
                            "type": "authentication_error",
                        }
                    },
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await refused(scope, receive, send)
                return
        await self.manager.handle_request(scope, receive, send)


class McpHttpServer:
    """``solve`` over streamable HTTP (see the module docstring): ``url`` ends in ``/mcp``;
    ``metrics_port`` is where ``/metrics`` is exported (None: not exported). Closing stops the
    HTTP server (waiting ``serve.shutdown_timeout_s`` for requests in flight), then the
    orchestration (as long again for its episodes) and the metrics."""

    def __init__(
        self, orchestration: Orchestration, serve: ServeConfig, api_key: str | None
    ) -> None:
        self._orchestration, self._shutdown_timeout_s = orchestration, serve.shutdown_timeout_s
        self._metrics = ServeMetrics("mcp")
        try:
            self._start(serve, api_key)
        except BaseException:
            orchestration.close(0)
            raise

    def _start(self, serve: ServeConfig, api_key: str | None) -> None:
        import uvicorn
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
        from starlette.applications import Starlette
        from starlette.routing import Route

        manager = StreamableHTTPSessionManager(
            app=mcp_server(self._orchestration, self._metrics), stateless=True
        )
        app = Starlette(
            routes=[Route(MCP_PATH, endpoint=_Authorized(manager, api_key))],
            lifespan=lambda _: manager.run(),
        )
        # Bound here, so a taken port fails this call (and port 0 is known at once).
        listening = socket.create_server((serve.host, serve.http_port))
        self.host, self.port = listening.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}{MCP_PATH}"
        self._server = uvicorn.Server(
            uvicorn.Config(
                app, log_level="warning", timeout_graceful_shutdown=serve.shutdown_timeout_s
            )
        )
        self._thread = threading.Thread(
            target=self._server.run, args=([listening],), name=f"mcp-{self.port}", daemon=True
        )
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"serve mcp: the HTTP server on {self.url} did not start")
            time.sleep(0.01)
        self.metrics_port = (
            None
            if serve.metrics_port is None
            else self._metrics.serve(serve.host, serve.metrics_port)
        )

    def wait(self) -> None:
        while self._thread.is_alive():
            self._thread.join(timeout=0.5)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join()
        self._orchestration.close(self._shutdown_timeout_s)
        self._metrics.close()

    def __enter__(self) -> McpHttpServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def orchestration_of(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    toolbox: Toolbox,
    settings: RolloutConfig,
    model_name: str,
) -> Orchestration:
    """An :class:`Orchestration` (its toolbox started) of the policy ``engine`` served as
    ``model_name``, episodes under ``settings``."""
    return Orchestration(OpenAIService(engine, tokenizer, model_name), toolbox, settings)


def serve_mcp_stdio(orchestration: Orchestration, stdout: io.TextIOBase | None = None) -> None:
    """Serve ``orchestration``'s ``solve`` over the process's stdin and ``stdout`` (None: the
    process's) until the client closes stdin."""
    import anyio
    from mcp.server.stdio import stdio_server

    server = mcp_server(orchestration)

    async def serve() -> None:
        async with stdio_server(stdout=None if stdout is None else anyio.wrap_file(stdout)) as (
            read,
            write,
        ):
            await server.run(read, write, server.create_initialization_options())

    asyncio.run(serve())


def _take_stdout() -> io.TextIOWrapper:
    """The process's standard output, for the protocol alone: a duplicate of descriptor 1 is
    returned and descriptor 1 then points at stderr, so nothing else written there (a library's
    print, a C extension's chatter) can corrupt the message stream."""
    sys.stdout.flush()
    protocol = io.TextIOWrapper(os.fdopen(os.dup(1), "wb"), encoding="utf-8")
    os.dup2(2, 1)
    return protocol


def run_mcp_stdio(config: Config) -> None:
    """``nemo-orch serve mcp`` with ``serve.mcp_transport=stdio``: the
    :func:`~nemo_orch.serve.orchestrator.served_policy` of ``config``, served as ``run.name``
    until the client closes stdin, SIGTERM or Ctrl-C; then the tools are closed."""
    protocol = _take_stdout()  # before the engine, whose libraries may print
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # unwinds, closing the tools
    orchestration = orchestration_of(*served_policy(config), config.run.name)
    try:
        serve_mcp_stdio(orchestration, protocol)
    except KeyboardInterrupt:
        pass
    finally:
        orchestration.close(config.serve.shutdown_timeout_s)


def start_mcp_http(config: Config) -> McpHttpServer:
    """``nemo-orch serve mcp`` with ``serve.mcp_transport=http``: the
    :func:`~nemo_orch.serve.orchestrator.served_policy` of ``config``, served as ``run.name``
    under ``serve.*``."""
    api_key = api_key_of(config.serve.api_key_env)  # before the (slow) engine
    return McpHttpServer(
        orchestration_of(*served_policy(config), config.run.name), config.serve, api_key
    )
