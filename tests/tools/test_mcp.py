"""MCP servers as tool sources (``tools.mcp``), against real servers written with the SDK
(``tests/support/mcp_server.py``, FastMCP) over stdio (a subprocess the toolbox starts) and streamable
HTTP on 127.0.0.1: listing, calling, an error result, a timeout, an image described and counted
(never an empty success), a crashed server restarted, left alone once it keeps crashing and used
again once it is back (stdio, and an HTTP server down for longer than its restarts), a slow start
bounded apart from the calls, a changed tool list taken in between episodes, a secret header
from the environment, and GRPO on tasks that are offered an MCP tool."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.cli_helpers import free_ports, grpo_overrides, grpo_stage, read_metrics, run_cli

from nemo_orch import config as config_lib
from nemo_orch.config import ConfigError, McpServerConfig
from nemo_orch.data.tasks import Task, write_tasks
from nemo_orch.rollout.builders import build_toolbox, offered_schemas
from nemo_orch.tools.base import ToolError
from nemo_orch.tools.mcp import mcp_source
from nemo_orch.tools.registry import Toolbox

SERVER = str(Path(__file__).resolve().parents[1] / "support" / "mcp_server.py")
SECRET = "s3cret-do-not-log"


def stdio(**fields) -> McpServerConfig:
    return McpServerConfig(
        **{"name": "fx", "command": sys.executable, "args": [SERVER, "stdio"], **fields}
    )


def toolbox_of(config: McpServerConfig, **options) -> Toolbox:
    return Toolbox([], sources=[mcp_source(config)], **options)


def calls(toolbox: Toolbox, *requests: tuple[str, dict]) -> list:
    async def run():
        async with toolbox:
            return [await toolbox.call(name, arguments) for name, arguments in requests]

    return asyncio.run(run())


def test_a_stdio_servers_tools_are_listed_priced_and_called(monkeypatch):
    monkeypatch.setenv("FIXTURE_SECRET", SECRET)
    config = stdio(
        deny=["die", "reshape", "picture", "captioned"],
        prices={"add": 0.01},
        latencies={"add": 0.2},
        env=["FIXTURE_SECRET"],
        timeout_s=2.0,
    )
    toolbox = toolbox_of(config)
    specs = toolbox.specs
    assert sorted(specs) == ["fx_add", "fx_fail", "fx_sleep", "fx_whoami"]
    add = specs["fx_add"]
    assert add.description == "Add two integers."
    assert add.parameters["properties"].keys() == {"a", "b"} and add.parameters["required"] == [
        "a",
        "b",
    ]
    assert (add.pricing.per_call, add.latency_hint_s, add.timeout_s) == (0.01, 0.2, 2.0)
    assert specs["fx_fail"].pricing.per_call == 0.0

    added, failed, slept, secret, invalid = calls(
        toolbox,
        ("fx_add", {"a": 2, "b": 3}),
        ("fx_fail", {"reason": "no such row"}),
        ("fx_sleep", {"seconds": 30}),
        ("fx_whoami", {}),
        ("fx_add", {"a": "x"}),
    )
    assert (added.output, added.error, added.cost_usd) == ("5", None, 0.01)
    assert failed.error.endswith("no such row") and failed.output == ""
    assert "timed out" in slept.error.lower() and slept.latency_s < 10
    assert secret.output == SECRET  # the server got the variable named, by name
    assert invalid.error.startswith("invalid arguments for fx_add")  # checked before the call
    # The tool said no, the server did not answer in time, the policy's arguments were wrong.
    assert [r.kind for r in (added, failed, slept, secret, invalid)] == [
        "ok",
        "tool_error",
        "infra_error",
        "ok",
        "tool_error",
    ]
    # Modeled time bills the configured latency.
    modeled = toolbox_of(config, modeled_time=True)
    (timed,) = calls(modeled, ("fx_add", {"a": 1, "b": 1}))
    assert timed.latency_s == 0.2


def test_an_image_is_described_and_counted_never_an_empty_success():
    picture, captioned = calls(
        toolbox_of(stdio(allow=["picture", "captioned"])), ("fx_picture", {}), ("fx_captioned", {})
    )
    assert (picture.kind, picture.output) == ("empty", "")
    assert picture.error == "fx_picture returned no text: [image (image/png, 70 bytes)]"
    assert picture.observation == (
        "Empty result: fx_picture returned no text: [image (image/png, 70 bytes)]"
    )
    assert (captioned.kind, captioned.output) == ("ok", "a red dot\n[image (image/png, 70 bytes)]")


def test_a_crashing_server_is_restarted_left_alone_while_it_keeps_crashing_then_used_again():
    toolbox = toolbox_of(stdio(allow=["add", "die"], restarts=1, cooldown_s=1.0))

    async def run():
        async with toolbox:
            call = toolbox.call
            # A server that died and came back is used again, however often it died before.
            revived = [
                await call(name, arguments)
                for name, arguments in [
                    ("fx_die", {}),
                    ("fx_add", {"a": 1, "b": 1}),
                    ("fx_die", {}),
                    ("fx_add", {"a": 2, "b": 2}),
                    ("fx_die", {}),
                    ("fx_add", {"a": 3, "b": 3}),
                ]
            ]
            # Lost, restarted once (restarts=1), lost again: left alone for cooldown_s.
            crashing = [
                await call("fx_die", {}),
                await call("fx_die", {}),
                await call("fx_add", {"a": 4, "b": 4}),
            ]
            await asyncio.sleep(1.1)
            return revived, crashing, await call("fx_add", {"a": 5, "b": 5})

    revived, (*crashed, refused), back = asyncio.run(run())
    assert [r.output for r in revived[1::2]] == ["2", "4", "6"]
    assert all("Connection closed" in r.error for r in [*revived[::2], *crashed])
    assert refused.kind == "infra_error" and "\n" not in refused.error
    assert refused.error.startswith(
        "fx_add failed: ToolError: tools.mcp.fx: not connected: "
        "circuit open after 2 failed requests in a row (last: "
        "connection lost: McpError: Connection closed)"
    )
    assert (back.kind, back.output) == ("ok", "10")


def test_connecting_is_bounded_apart_from_the_calls(monkeypatch):
    monkeypatch.setenv("FIXTURE_START_DELAY", "1")
    slow = stdio(allow=["add"], env=["FIXTURE_START_DELAY"], timeout_s=0.5, connect_timeout_s=20.0)
    # A second to start, each call half of one: the start is not the calls' to bound.
    (added,) = calls(toolbox_of(slow), ("fx_add", {"a": 1, "b": 2}))
    assert (added.kind, added.output) == ("ok", "3")
    with pytest.raises(
        ToolError,
        match=r"^tools.mcp.fx: cannot connect: no connection within "
        r"0.3 s \(connect_timeout_s\)$",
    ):
        mcp_source(stdio(allow=["add"], env=["FIXTURE_START_DELAY"], connect_timeout_s=0.3))


def test_a_declared_orchestrator_must_send_its_ledger():
    """A server declared ``orchestrator: true`` whose result carries no ledger: the call is an
    error (its cost unknown), not an answer billed at nothing."""
    (added,) = calls(
        toolbox_of(stdio(allow=["add"], orchestrator=True, per_call_usd=0.5)),
        ("fx_add", {"a": 1, "b": 1}),
    )
    assert added.error == (
        "fx_add: the orchestrator's result carries no ledger (an object with "
        "messages and ledger.cost_usd and ledger.calls)"
    )
    assert (added.output, added.cost_usd, added.trajectory) == ("", 0.5, None)


def test_the_tools_offered_list_the_servers_after_the_declared():
    """``nemo-orch tools list`` (and the SFT data's tool list): the MCP servers' tools too."""
    tools = config_lib.load(["tools.mcp=[]"]).tools
    tools.mcp = [stdio(allow=["add", "fail"], prices={"add": 0.25})]
    offered = {schema["function"]["name"]: schema["function"] for schema in offered_schemas(tools)}
    assert list(offered) == ["answer", "enhance_reasoning", "search", "fx_add", "fx_fail"]
    assert offered["fx_add"]["description"].endswith("Each call costs USD 0.25.")


def test_listing_errors_name_the_server():
    with pytest.raises(ToolError, match="tools.mcp.fx: no tool taken of the 8 it lists"):
        mcp_source(stdio(allow=["nothing"]))
    # The cause, not the SDK's task group that wraps it:
    with pytest.raises(
        ToolError, match="^tools.mcp.gone: cannot connect: McpError: Connection closed$"
    ):
        mcp_source(stdio(name="gone", args=["-c", "import sys; sys.exit(3)"], timeout_s=5.0))
    with pytest.raises(ConfigError, match="tools.mcp.fx.restarts and cooldown_s must be >= 0"):
        stdio(restarts=-1)
    with pytest.raises(ConfigError, match="tools.mcp.fx: give command .stdio. or url"):
        config_lib.load(["tools.mcp=[{name: fx}]"])


def start_http_server(port: int) -> subprocess.Popen:
    """The fixture server over streamable HTTP on ``port``, once it listens."""
    process = subprocess.Popen(
        [sys.executable, SERVER, "http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return process
        assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def http_server():
    (port,) = free_ports(1)
    process = start_http_server(port)
    yield f"http://127.0.0.1:{port}/mcp"
    process.terminate()
    process.wait(timeout=10)


def test_an_http_server_down_for_longer_than_its_restarts_is_used_again_once_back():
    (port,) = free_ports(1)
    process = start_http_server(port)
    config = McpServerConfig(
        name="fx",
        url=f"http://127.0.0.1:{port}/mcp",
        allow=["add"],
        restarts=1,
        cooldown_s=0.5,
        timeout_s=30.0,
    )
    toolbox = toolbox_of(config)

    async def run():
        nonlocal process
        async with toolbox:
            up = await toolbox.call("fx_add", {"a": 1, "b": 1})
            process.kill()
            process.wait()
            started = time.monotonic()
            down = [await toolbox.call("fx_add", {"a": 2, "b": 2}) for _ in range(4)]
            seconds = time.monotonic() - started
            process = start_http_server(port)
            await asyncio.sleep(0.6)
            return up, down, seconds, await toolbox.call("fx_add", {"a": 3, "b": 3})

    try:
        up, down, seconds, back = asyncio.run(run())
    finally:
        process.kill()
        process.wait()
    assert (up.output, back.output, back.kind) == ("2", "6", "ok")
    assert [result.kind for result in down] == ["infra_error"] * 4
    assert "circuit open after 2 failed requests in a row" in down[-1].error
    assert seconds < 10  # each failed at once: none waited out its 30 s timeout


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_changed_tool_list_is_taken_in_between_episodes(transport, request):
    """reshape adds triple, drops sleep and sends list_changed: an episode under way keeps the
    tools it started with; the toolbox offers the new list from its next refresh on."""
    config = (
        stdio(allow=["add", "reshape", "sleep", "triple"], prices={"triple": 0.02})
        if transport == "stdio"
        else McpServerConfig(
            name="fx",
            url=request.getfixturevalue("http_server"),
            allow=["add", "reshape", "sleep", "triple"],
            prices={"triple": 0.02},
        )
    )
    toolbox = toolbox_of(config)

    async def run():
        async with toolbox:
            under_way = toolbox.subset(toolbox.tools)  # what an episode holds
            reshaped = await under_way.call("fx_reshape", {})
            before = list(toolbox.tools)  # noted, not yet taken in
            await toolbox.refresh()
            after = list(toolbox.tools)
            tripled = await toolbox.call("fx_triple", {"n": 4})
            return reshaped, before, after, tripled, list(under_way.tools), toolbox.schemas()

    reshaped, before, after, tripled, under_way, schemas = asyncio.run(run())
    assert reshaped.output == "reshaped"
    assert before == under_way == ["fx_add", "fx_sleep", "fx_reshape"]  # the server's order
    assert after == ["fx_add", "fx_reshape", "fx_triple"]
    assert (tripled.output, tripled.cost_usd) == ("12", 0.02)
    assert toolbox.source_of == dict.fromkeys(after, "fx")
    # Offered as a declared tool is: its own description, its price per call.
    (triple,) = [
        schema["function"] for schema in schemas if schema["function"]["name"] == "fx_triple"
    ]
    assert triple["description"] == (
        "Three times an integer (offered once reshape ran). Each call costs USD 0.02."
    )


def test_a_streamable_http_server_gets_its_secret_header_from_the_environment(
    http_server, monkeypatch, caplog
):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("FIXTURE_TOKEN", f"Bearer {SECRET}")
    config = config_lib.load(
        [
            f"tools.mcp=[{{name: web, url: '{http_server}', "
            "headers: {Authorization: FIXTURE_TOKEN}, allow: [add, whoami]}]"
        ]
    )
    toolbox = build_toolbox(config.tools)
    assert {"web_add", "web_whoami"} <= toolbox.tools.keys()
    (added,) = calls(toolbox, ("web_add", {"a": 4, "b": 5}))
    assert added.output == "9"
    # Sent with every request, shown nowhere: not in the config, the schemas or any log line.
    assert SECRET not in str(toolbox.schemas()) + str(config) + caplog.text
    (token,) = calls(toolbox, ("web_whoami", {}))  # the server echoes what it got
    assert token.output == f"Bearer {SECRET}"
    monkeypatch.delenv("FIXTURE_TOKEN")
    with pytest.raises(ToolError, match="the environment has no FIXTURE_TOKEN"):
        build_toolbox(config.tools)


def test_grpo_trains_on_tasks_offered_an_mcp_tool(start_checkpoint, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(
        tasks,
        [
            Task(
                id=f"t{i}",
                question=f"What is {i} + {i}? Use fx_add.",
                answer=str(2 * i),
                tools=("fx_add",),
            )
            for i in range(8)
        ],
    )
    run_cli(
        "grpo",
        *grpo_overrides(
            start_checkpoint,
            tmp_path,
            "env=tasks",
            f"env.path={tasks}",
            "reward.combination=linear",
            "reward.linear_gamma=0",
            f"tools.mcp=[{{name: fx, command: '{sys.executable}', args: ['{SERVER}', stdio]}}]",
        ),
    )
    metrics = read_metrics(grpo_stage(tmp_path))
    assert [m["step"] for m in metrics] == [1, 2] and all("reward" in m for m in metrics)


def test_serve_orchestrator_calls_an_mcp_tool(tiny_tokenizer):
    """``/v1/orchestrate`` over a toolbox whose tool comes from an MCP server: the episode's
    call reaches the server and is billed in the ledger at the configured price."""
    import httpx
    from support.scripted_plans import follow_plan, with_plan

    from nemo_orch.config import RolloutConfig, ServeConfig
    from nemo_orch.rollout.engines.scripted import ScriptedEngine
    from nemo_orch.serve.orchestrator import serve_orchestrator

    question = with_plan(
        Task("q", "Add two and three."), [("fx_add", {"a": 2, "b": 3})], "5"
    ).question
    with serve_orchestrator(
        ScriptedEngine(tiny_tokenizer, follow_plan),
        tiny_tokenizer,
        toolbox_of(stdio(allow=["add"], prices={"add": 0.25})),
        RolloutConfig(max_context_tokens=2048, max_turns=4),
        ServeConfig(http_port=0, metrics_port=None),
        "policy",
    ) as server:
        body = httpx.post(
            f"{server.url}/orchestrate", json={"question": question}, timeout=60
        ).json()
    assert (body["answer"], body["finish_reason"]) == ("5", "answer")
    (call,) = body["ledger"]["calls"]
    assert (call["tool"], call["error"], call["cost_usd"]) == ("fx_add", None, 0.25)
    assert body["messages"][-2] == {"role": "tool", "content": "5"}


def test_sft_demonstrations_are_offered_the_mcp_tools(tiny_tokenizer):
    """SFT data generation: the naive routers' demonstrations are episodes through the toolbox,
    offered the MCP server's tools beside the world's, their schemas kept with each
    conversation."""
    from nemo_orch.train import sft

    config = config_lib.load(
        ["model.max_position_embeddings=4096", "data.num_offline_conversations=4"]
    )
    config.tools.mcp = [stdio(allow=["add"], prices={"add": 0.25})]
    conversations = sft.demonstrations(config, tiny_tokenizer)
    assert len(conversations) == 4
    for conversation in conversations:
        offered = {tool["function"]["name"]: tool["function"] for tool in conversation["tools"]}
        assert set(offered) == {"search", "enhance_reasoning", "answer", "fx_add"}
        assert offered["fx_add"]["description"].endswith("Each call costs USD 0.25.")
