"""The orchestrator as an MCP server (``nemo-orch serve mcp``) and orchestrators as tools of
another, against the official ``mcp`` SDK's own client: ``solve`` listed and called over
streamable HTTP on 127.0.0.1 (a scripted policy: what it answers equals the rollouts' episode)
and over stdio (the real command, started by the SDK's client, on an untrained tiny policy);
then a coordinator over a sub-orchestrator, reached through MCP and through ``/v1/orchestrate``,
whose ledger bills both levels' spending, with the sub's episode kept in its trajectory."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
from datetime import timedelta

import httpx
import pytest
from support.fixture_tools import DelayedEcho, echo_spec
from support.scripted_plans import follow_plan, with_plan

from nemo_orch import config as config_lib
from nemo_orch.config import ConfigError, McpServerConfig, RolloutConfig, ServeConfig
from nemo_orch.data.tasks import Task
from nemo_orch.reward.components import preference_instruction
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.rollout.runner import run_rollouts
from nemo_orch.serve.mcp import McpHttpServer, orchestration_of
from nemo_orch.serve.orchestrator import serve_orchestrator
from nemo_orch.tools.base import Pricing, ToolSpec
from nemo_orch.tools.mcp import mcp_source
from nemo_orch.tools.orchestrator import SOLVE_PARAMETERS, OrchestratorTool, orchestration_text
from nemo_orch.tools.registry import Toolbox

MODEL = "specialist"
SETTINGS = RolloutConfig(max_context_tokens=2048, max_turns=4, temperature=0.0)
KEY_VARIABLE, KEY = "NEMO_ORCH_TEST_MCP_KEY", "sk-mcp-test"
SUB_ECHO_USD, TOP_ECHO_USD = 0.02, 0.01


def sub_toolbox() -> Toolbox:
    return Toolbox([DelayedEcho(echo_spec("echo", pricing=Pricing(per_call=SUB_ECHO_USD)))])


def sub_question() -> str:
    """A question the sub-orchestrator's scripted policy answers by calling its echo, then
    answering HI."""
    return with_plan(Task("sub", "Say hi."), [("echo", {"text": "hi"})], "HI").question


@pytest.fixture(scope="module")
def sub_mcp(tiny_tokenizer):
    """The sub-orchestrator (a scripted policy, its echo at $0.02 a call) over streamable HTTP,
    behind a key."""
    orchestration = orchestration_of(
        ScriptedEngine(tiny_tokenizer, follow_plan), tiny_tokenizer, sub_toolbox(), SETTINGS, MODEL
    )
    with McpHttpServer(
        orchestration, ServeConfig(http_port=0, metrics_port=0), api_key=KEY
    ) as server:
        yield server


def sdk_session(url: str, headers: dict[str, str], work):
    """``work(session)`` on an initialized SDK client session over streamable HTTP."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    async def run():
        async with (
            streamablehttp_client(url, headers=headers) as (read, write, _),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            return await work(session)

    return asyncio.run(run())


def test_solve_over_streamable_http_is_the_rollouts_episode(sub_mcp, tiny_tokenizer):
    preference = {"accuracy": 1.0, "cost": 1.0}

    async def work(session):
        listed = (await session.list_tools()).tools
        solved = await session.call_tool(
            "solve", {"question": sub_question(), "preference": preference}
        )
        refused = await session.call_tool("solve", {"question": "q", "preference": {"speed": 1}})
        return listed, solved, refused

    listed, solved, refused = sdk_session(sub_mcp.url, {"Authorization": f"Bearer {KEY}"}, work)
    (tool,) = listed
    assert (tool.name, tool.inputSchema) == ("solve", SOLVE_PARAMETERS)
    assert {"answer", "ledger", "messages"} <= set(tool.outputSchema["required"])
    assert not solved.isError
    body = solved.structuredContent
    assert (body["answer"], body["finish_reason"], body["model"]) == ("HI", "answer", MODEL)
    assert solved.content[0].text == orchestration_text(body)
    assert solved.content[0].text.startswith("HI\n[cost $")
    # The same episode as the rollouts' runner plays with the seed the server drew.
    instruction = preference_instruction(preference)
    task = Task(body["id"], f"{sub_question()}\n{instruction}")
    (local,) = asyncio.run(
        run_rollouts(
            [task],
            1,
            ScriptedEngine(tiny_tokenizer, follow_plan),
            sub_toolbox(),
            tiny_tokenizer,
            SETTINGS,
            seed=body["seed"],
        )
    )
    assert body["messages"] == local.messages
    ledger = body["ledger"]
    assert ledger["cost_usd"] == pytest.approx(local.cost_usd)
    assert ledger["cost_usd"] == pytest.approx(ledger["orchestrator_cost_usd"] + SUB_ECHO_USD)
    assert [(call["tool"], call["cost_usd"]) for call in ledger["calls"]] == [
        ("echo", SUB_ECHO_USD)
    ]
    assert refused.isError and "unknown preference feature 'speed'" in refused.content[0].text
    metrics = httpx.get(f"http://127.0.0.1:{sub_mcp.metrics_port}/metrics").text
    assert 'nemo_orch_serve_requests_total{model="solve",status="ok"} 1.0' in metrics
    assert 'nemo_orch_serve_requests_total{model="solve",status="bad_request"} 1.0' in metrics

    from mcp.shared.exceptions import McpError

    async def unused(session):
        raise AssertionError("connected without the key")

    with pytest.raises(Exception) as no_key:  # the SDK's client surfaces the 401 on connect
        sdk_session(sub_mcp.url, {}, unused)
    assert isinstance(no_key.value, (httpx.HTTPStatusError, McpError, ExceptionGroup))
    assert "401" in repr(no_key.value) or "Unauthorized" in repr(no_key.value)


def test_serve_mcp_over_stdio_runs_a_tiny_policy(random_policy_dir, tmp_path):
    """The command as an agent application starts it: the SDK's stdio client runs ``nemo-orch
    serve mcp`` with an untrained tiny policy (it answers nonsense; the loop runs and bills)."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    server = StdioServerParameters(
        command=sys.executable,
        env=dict(os.environ),
        cwd=str(tmp_path),
        args=[
            "-m",
            "nemo_orch.cli",
            "serve",
            "mcp",
            f"rollout.policy={random_policy_dir}",
            "rollout.max_turns=2",
            "rollout.max_new_tokens=8",
            "tools=offline_basic",
            "serve.mcp_transport=stdio",
            "run.name=tiny",
        ],
    )

    async def run():
        async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            tools = (await session.list_tools()).tools
            return tools, await session.call_tool(
                "solve", {"question": "What is 2 + 3?"}, read_timeout_seconds=timedelta(seconds=120)
            )

    (tool,), solved = asyncio.run(run())
    assert tool.name == "solve" and "tiny" in tool.description
    assert not solved.isError, solved.content
    body = solved.structuredContent
    assert body["finish_reason"] in ("answer", "max_turns", "context_limit")
    assert 1 <= body["turns"] <= 2 and body["ledger"]["cost_usd"] > 0
    assert body["messages"][0]["role"] == "user"
    assert solved.content[0].text == orchestration_text(body)


def test_start_mcp_http_from_config(random_policy_dir, tmp_path, monkeypatch):
    """The ``serve mcp serve.mcp_transport=http`` path: the policy and tools from the config,
    the key from the variable it names."""
    from nemo_orch.serve.mcp import start_mcp_http

    config = config_lib.load(
        [
            f"run.output_dir={tmp_path}",
            f"rollout.policy={random_policy_dir}",
            "run.name=tiny",
            "rollout.max_turns=1",
            "rollout.max_new_tokens=4",
            "tools=offline_basic",
            "serve.mcp_transport=http",
            "serve.http_port=0",
            "serve.metrics_port=null",
            f"serve.api_key_env={KEY_VARIABLE}",
        ]
    )
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    with pytest.raises(ConfigError, match=f"{KEY_VARIABLE} is not set"):
        start_mcp_http(config)
    monkeypatch.setenv(KEY_VARIABLE, KEY)

    async def solve(session):
        return await session.call_tool("solve", {"question": "What is 2 + 3?"})

    with start_mcp_http(config) as server:
        assert server.metrics_port is None and server.url.endswith("/mcp")
        solved = sdk_session(server.url, {"Authorization": f"Bearer {KEY}"}, solve)
    assert not solved.isError and solved.structuredContent["model"] == "tiny"
    assert solved.structuredContent["turns"] == 1


def top_reply(prompt: str) -> str:
    """The coordinator's scripted policy: its own echo, then the specialist (``sub_solve``),
    then the specialist's answer, read from the last observation."""
    done = prompt.count("<tool_response>")
    if done == 0:
        return '<tool_call>\n{"name": "echo", "arguments": {"text": "top"}}\n</tool_call>'
    if done == 1:
        call = {"name": "sub_solve", "arguments": {"question": sub_question()}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    observation = prompt.rsplit("<tool_response>", 1)[1].split("</tool_response>", 1)[0]
    return f"<answer>{observation.strip().splitlines()[0]}</answer>"


def coordinate(tokenizer, specialist) -> object:
    """One episode of the coordinator: its echo at $0.01 and ``specialist`` (the tool
    ``sub_solve``)."""
    toolbox = Toolbox(
        [DelayedEcho(echo_spec("echo", pricing=Pricing(per_call=TOP_ECHO_USD))), specialist]
    )

    async def episode():
        try:
            return await run_rollouts(
                [Task("top", "Ask the specialist.")],
                1,
                ScriptedEngine(tokenizer, top_reply),
                toolbox,
                tokenizer,
                SETTINGS,
                seed=3,
            )
        finally:
            await toolbox.close()

    (trajectory,) = asyncio.run(episode())
    return trajectory


@pytest.fixture(scope="module")
def sub_http(tiny_tokenizer):
    """The same sub-orchestrator behind ``/v1/orchestrate``."""
    with serve_orchestrator(
        ScriptedEngine(tiny_tokenizer, follow_plan),
        tiny_tokenizer,
        sub_toolbox(),
        SETTINGS,
        ServeConfig(http_port=0, metrics_port=None),
        MODEL,
        api_key=KEY,
    ) as server:
        yield server


@pytest.mark.parametrize("route", ["mcp", "orchestrate"])
def test_a_coordinator_is_billed_its_specialists_ledger(
    route, request, tiny_tokenizer, monkeypatch
):
    monkeypatch.setenv(KEY_VARIABLE, f"Bearer {KEY}" if route == "mcp" else KEY)
    if route == "mcp":
        (specialist,) = mcp_source(
            McpServerConfig(
                name="sub",
                url=request.getfixturevalue("sub_mcp").url,
                orchestrator=True,
                headers={"Authorization": KEY_VARIABLE},
                timeout_s=30.0,
            )
        ).tools
        assert specialist.spec.parameters == SOLVE_PARAMETERS
    else:
        specialist = OrchestratorTool(
            ToolSpec("sub_solve", "A specialist orchestrator.", SOLVE_PARAMETERS),
            base_url=request.getfixturevalue("sub_http").url,
            model=MODEL,
            api_key_env=KEY_VARIABLE,
            timeout_s=30.0,
        )
    top = coordinate(tiny_tokenizer, specialist)

    assert (top.termination, top.answer) == ("answer", "HI")
    # The specialist's seed derives from the coordinator's call: the whole episode replays.
    (_, first), (_, second) = (
        [call for turn in episode.turns for call in turn.calls]
        for episode in (top, coordinate(tiny_tokenizer, specialist))
    )
    assert (first.trajectory["seed"], first.trajectory["messages"]) == (
        second.trajectory["seed"],
        second.trajectory["messages"],
    )
    own, delegated = [call for turn in top.turns for call in turn.calls]
    sub = delegated.trajectory  # the specialist's episode, kept with the call
    sub_orchestrator_usd = sub["ledger"]["orchestrator_cost_usd"]
    top_orchestrator_usd = sum(turn.orchestrator_cost_usd for turn in top.turns)
    assert sub_orchestrator_usd > 0 and top_orchestrator_usd > 0
    # The specialist's bill: its own tokens and its echo.
    assert sub["ledger"]["cost_usd"] == pytest.approx(sub_orchestrator_usd + SUB_ECHO_USD)
    # The call costs the caller exactly the specialist's total (no per-call fee declared)...
    assert (own.tool, own.cost_usd) == ("echo", TOP_ECHO_USD)
    assert (delegated.tool, delegated.error) == ("sub_solve", None)
    assert delegated.cost_usd == pytest.approx(sub["ledger"]["cost_usd"])
    # ... so the coordinator's ledger holds both levels' spending.
    assert top.cost_usd == pytest.approx(
        top_orchestrator_usd + TOP_ECHO_USD + sub_orchestrator_usd + SUB_ECHO_USD
    )
    # The tokens spent for the call are the specialist's and its calls'; its episode is saved
    # with the coordinator's trajectory.
    assert (
        delegated.input_tokens
        == sub["ledger"]["tokens"]["input"]
        + sum(call["input_tokens"] for call in sub["ledger"]["calls"])
        > 0
    )
    saved = json.loads(json.dumps(top.to_json()))["ledger"][1]["calls"][0]["trajectory"]
    assert saved["answer"] == "HI" and saved["messages"][-1]["content"] == "<answer>HI</answer>"
    assert [call["tool"] for call in saved["ledger"]["calls"]] == ["echo"]


def test_an_unreachable_specialist_is_an_error_observation(tiny_tokenizer, monkeypatch):
    """A specialist that has stopped: the call fails, costs nothing, and the episode goes on."""
    monkeypatch.setenv(KEY_VARIABLE, f"Bearer {KEY}")
    orchestration = orchestration_of(
        ScriptedEngine(tiny_tokenizer, follow_plan), tiny_tokenizer, sub_toolbox(), SETTINGS, MODEL
    )
    with McpHttpServer(
        orchestration, ServeConfig(http_port=0, metrics_port=None), api_key=KEY
    ) as server:
        (specialist,) = mcp_source(
            McpServerConfig(
                name="sub",
                url=server.url,
                orchestrator=True,
                headers={"Authorization": KEY_VARIABLE},
                timeout_s=5.0,
            )
        ).tools
    top = coordinate(tiny_tokenizer, specialist)
    _, delegated = [call for turn in top.turns for call in turn.calls]
    assert delegated.error.startswith("sub_solve failed: ToolError: tools.mcp.sub: cannot connect")
    assert (delegated.cost_usd, delegated.trajectory) == (0.0, None)
    assert delegated.kind == "infra_error" and top.termination == "answer"
    assert top.answer.startswith(
        "Unavailable (infrastructure failure, not the call's fault): sub_solve failed"
    )


def test_a_specialist_its_own_tool_failed_is_the_callers_infra_error(tiny_tokenizer, monkeypatch):
    """A specialist whose echo hangs past its timeout ends without an answer: ``solve`` says
    so with ``/v1/orchestrate``'s 503, which the coordinator reads as an ``infra_error`` (its
    episode masked in training), not as the specialist's answer or the policy's mistake."""
    monkeypatch.setenv(KEY_VARIABLE, f"Bearer {KEY}")
    hanging = Toolbox([DelayedEcho(echo_spec("echo", timeout_s=0.2), default_delay_s=5.0)])
    orchestration = orchestration_of(
        ScriptedEngine(tiny_tokenizer, follow_plan),
        tiny_tokenizer,
        hanging,
        dataclasses.replace(SETTINGS, max_turns=1),
        MODEL,
    )
    with McpHttpServer(
        orchestration, ServeConfig(http_port=0, metrics_port=None), api_key=KEY
    ) as server:
        (specialist,) = mcp_source(
            McpServerConfig(
                name="sub",
                url=server.url,
                orchestrator=True,
                headers={"Authorization": KEY_VARIABLE},
                timeout_s=30.0,
            )
        ).tools
        top = coordinate(tiny_tokenizer, specialist)
    _, delegated = [call for turn in top.turns for call in turn.calls]
    assert delegated.kind == "infra_error"
    assert delegated.error == (
        "HTTP 503 (upstream_unavailable): no answer: the episode was decided by a failure "
        "outside the policy, infra_error at echo: echo timed out after 0.2 s"
    )
    assert top.infra_failure().endpoint == "sub_solve"


def test_mcp_settings_are_validated_and_the_coordinator_example_loads():
    with pytest.raises(ConfigError, match="serve.mcp_transport must be one of stdio, http"):
        config_lib.load(["serve.mcp_transport=sse"])
    config = config_lib.load(["tools=coordinator"])
    specialists = config.tools.mcp
    assert [server.name for server in specialists] == ["math", "research"]
    for server in specialists:
        assert server.orchestrator and server.args[:3] == ["-m", "nemo_orch.cli", "serve"]
        assert "serve.mcp_transport=stdio" in server.args
    assert dataclasses.asdict(config.serve)["mcp_transport"] == "stdio"
