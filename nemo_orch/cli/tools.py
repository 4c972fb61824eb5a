"""``tools list|call|parse``: the configured tools' schemas, one call of one tool, and how the
rollout parser reads a turn of assistant text."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from nemo_orch.cli.common import Commands, add_command, print_json
from nemo_orch.config import Config


def cmd_tools_list(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.rollout.builders import offered_schemas

    print_json(offered_schemas(config.tools))
    return 0


def _call_tool(config: Config, name: str, raw_arguments: str) -> dict:
    from nemo_orch.rollout.builders import build_toolbox
    from nemo_orch.tools.base import ToolResult

    try:
        arguments = json.loads(raw_arguments)
    except json.JSONDecodeError as error:
        return ToolResult(error=f"--args is not JSON: {error}").to_json()
    if not isinstance(arguments, dict):
        return ToolResult(error="--args must be a JSON object").to_json()

    async def call() -> dict:
        toolbox = build_toolbox(config.tools)
        if name not in toolbox.tools:  # no need to start every tool to say so
            return (await toolbox.call(name, arguments)).to_json()
        toolbox = toolbox.subset([name])
        async with toolbox:
            return (await toolbox.call(name, arguments)).to_json()

    return asyncio.run(call())


def cmd_tools_call(config: Config, args: argparse.Namespace) -> int:
    """Exit 0 whenever the tool ran or refused: its failure is in ``error``."""
    print_json(_call_tool(config, args.name, args.args))
    return 0


def _stdin_text() -> str:
    """Standard input as text, whatever its bytes: invalid UTF-8 reads as U+FFFD."""
    raw = getattr(sys.stdin, "buffer", None)
    return sys.stdin.read() if raw is None else raw.read().decode("utf-8", errors="replace")


def cmd_tools_parse(config: Config, args: argparse.Namespace) -> int:
    from nemo_orch.rollout.builders import offered_schemas
    from nemo_orch.rollout.format import TurnFormat, parse_turn

    fmt = TurnFormat.for_tools(
        offered_schemas(config.tools),
        answer_format=config.rollout.answer_format,
        multiple_calls=config.rollout.multiple_calls,
    )
    turn = parse_turn(_stdin_text(), fmt)
    print_json(
        {
            "calls": [{"name": c.name, "arguments": c.arguments} for c in turn.calls if c.valid],
            "error": turn.error or next((c.error for c in turn.calls if c.error), None),
            "answer": turn.answer,
            "format_errors": turn.format_errors,
            "invalid_calls": [c.to_json() for c in turn.calls if not c.valid],
        }
    )
    return 0


def add_commands(commands: Commands) -> None:
    """``tools`` with ``list``, ``call`` and ``parse``."""
    tools = commands.add_parser("tools", help="list, call and parse tools")
    tool_commands = tools.add_subparsers(dest="tools_command", required=True)
    add_command(
        tool_commands, "list", cmd_tools_list, "print the configured tools' schemas as a JSON list"
    )
    call = add_command(
        tool_commands,
        "call",
        cmd_tools_call,
        "call one tool; prints {output, error, cost_usd, latency_s, ...} as JSON",
        positionals=("name",),
    )
    call.add_argument("--args", required=True, help="the arguments as a JSON object")
    add_command(
        tool_commands,
        "parse",
        cmd_tools_parse,
        "parse assistant text from stdin into tool calls (JSON)",
    )
