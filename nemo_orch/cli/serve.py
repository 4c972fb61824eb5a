"""``serve reward|tool|orchestrator|mcp``: a server in the foreground until SIGTERM or Ctrl-C,
its address printed once it is up."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Callable
from typing import Any

from nemo_orch.cli.common import Commands, add_command
from nemo_orch.config import Config


def _serve_until_stopped(start: Callable[[], Any], describe: Callable[[Any], str]) -> int:
    """Start a server (``start()``), print ``describe(server)`` and serve until SIGTERM or
    SIGINT, then close it (waiting at most ``serve.shutdown_timeout_s`` for requests in flight).
    The signals are caught before the server starts, so a stop during start-up still cleans
    up (PyTriton's workspace, sandbox workers)."""
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    with start() as server:
        print(describe(server), flush=True)
        while not stopped.wait(0.5):
            pass
        print("serve: stopping", flush=True)
    return 0


def _metrics_address(server: Any) -> str:
    return (
        ""
        if server.metrics_port is None
        else f"; metrics http://{server.host}:{server.metrics_port}/metrics"
    )


def _triton_banner(kind: str, models: list[str]) -> Callable[[Any], str]:
    return lambda server: (
        f"{kind}: serving {', '.join(models)} at {server.url}/v2/models/<name>/infer (KServe v2; "
        f"gRPC {server.grpc_url}{_metrics_address(server)}); SIGTERM or Ctrl-C stops"
    )


def cmd_serve_reward(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.serve.triton import serve_models
    from nemo_orch.serve.triton_models import reward_model

    model = reward_model(config)
    return _serve_until_stopped(
        lambda: serve_models([model], config.serve), _triton_banner("reward", [model.name])
    )


def cmd_serve_tool(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.serve.triton import serve_models
    from nemo_orch.serve.triton_models import tool_models

    names = [name for name in args.name.split(",") if name]
    models, toolbox = tool_models(config, names)
    return _serve_until_stopped(
        lambda: serve_models(models, config.serve, toolbox), _triton_banner("tool", names)
    )


def cmd_serve_orchestrator(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.serve.orchestrator import start_orchestrator

    return _serve_until_stopped(
        lambda: start_orchestrator(config),
        lambda server: (
            f"orchestrator: serving {config.run.name} at {server.url} (/chat/completions with "
            f"tools, /completions, /orchestrate{_metrics_address(server)}); SIGTERM or Ctrl-C "
            "stops"
        ),
    )


def cmd_serve_mcp(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.serve import mcp

    if config.serve.mcp_transport == "stdio":  # stdout is the protocol's: no banner
        mcp.run_mcp_stdio(config)
        return 0
    return _serve_until_stopped(
        lambda: mcp.start_mcp_http(config),
        lambda server: (
            f"mcp: serving {config.run.name} as the MCP tool solve at {server.url} (streamable "
            f"HTTP{_metrics_address(server)}); SIGTERM or Ctrl-C stops"
        ),
    )


def add_commands(commands: Commands) -> None:
    """``serve`` with ``reward``, ``tool``, ``orchestrator`` and ``mcp``."""
    serve = commands.add_parser(
        "serve",
        help="serve the reward, tools or the orchestrator "
        "(OpenAI-compatible or MCP) (serve.*: host, ports, batching, "
        "metrics)",
    )
    serve_commands = serve.add_subparsers(dest="serve_command", required=True)
    add_command(
        serve_commands,
        "reward",
        cmd_serve_reward,
        "PyTriton: outcome scoring and the judge (reward.*) as the "
        "Triton model 'reward'; training, rollout and eval use it with reward.endpoint=URL",
    )
    add_command(
        serve_commands,
        "tool",
        cmd_serve_tool,
        "PyTriton: configured tools as Triton models named after them "
        "(e.g. retriever, sandbox); declarations elsewhere reach them with endpoint: URL",
        positionals=("name",),
    )
    add_command(
        serve_commands,
        "orchestrator",
        cmd_serve_orchestrator,
        "OpenAI-compatible /v1/chat/completions (with "
        "function calling) and /v1/orchestrate (a question in, the answer and its ledger out) "
        "for the policy of rollout.policy=CHECKPOINT|HF_DIR (null: the run's latest "
        "checkpoint), on serve.host:serve.http_port (127.0.0.1:8000), e.g. `nemo-orch serve "
        "orchestrator rollout.policy=runs/latest/grpo/checkpoints serve.http_port=8080`",
    )
    add_command(
        serve_commands,
        "mcp",
        cmd_serve_mcp,
        "the orchestrator of rollout.policy=CHECKPOINT|HF_DIR as an MCP "
        "server with one tool, solve(question, preference?), answering with the answer, its "
        "cost and calls (the loop of /v1/orchestrate), over serve.mcp_transport=stdio (the "
        "client starts the process) or http (streamable HTTP at /mcp on serve.http_port), e.g. "
        "`nemo-orch serve mcp rollout.policy=runs/latest/grpo/checkpoints "
        "serve.mcp_transport=http`",
    )
