"""Tools declared by ``endpoint:`` reach a real tool server on 127.0.0.1 that serves a toolbox."""

from __future__ import annotations

import asyncio

import yaml
from fixture_tools import ECHO_PARAMETERS, DelayedEcho, echo_spec

from nemo_orch.serve.tool_server import start_tool_server
from nemo_orch.tools.base import Pricing, ToolContext
from nemo_orch.tools.registry import Toolbox, load_toolbox


def test_remote_tool_round_trip(tmp_path, monkeypatch):
    served = DelayedEcho(echo_spec("echo", pricing=Pricing(per_call=0.25), deterministic=True,
                                   timeout_s=0.5), prefix="remote:")
    monkeypatch.setenv("TOOL_SERVER_KEY", "tool-secret")
    with start_tool_server(Toolbox([served]), api_key="tool-secret") as server:
        assert served.started  # warmed up at start
        for name, key_env in (("echo", "TOOL_SERVER_KEY"), ("echo_nokey", None)):
            (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({
                "name": name, "description": "Echo, served elsewhere.",
                "parameters": ECHO_PARAMETERS, "endpoint": server.tool_url("echo"),
                "options": {"api_key_env": key_env, "max_retries": 0}}))
        toolbox = load_toolbox([tmp_path])

        async def calls():
            context = ToolContext(task_id="t", allowed_documents=frozenset({"d"}))
            results = await asyncio.gather(
                toolbox.call("echo", {"text": "hi"}, context),
                toolbox.call("echo", {"text": "slow", "delay_s": 2}, context),
                toolbox.call("echo_nokey", {"text": "hi"}, context))
            await toolbox.close()
            return results

        ok, slow, unauthorized = asyncio.run(calls())
    assert ok.error is None and ok.output == "remote:hi" and ok.cost_usd == 0.25
    assert slow.error == "echo timed out after 0.5 s"  # the served toolbox's own timeout
    assert "401" in unauthorized.error and "tool-secret" not in unauthorized.error


def test_unreachable_endpoint_is_an_error_result(tmp_path):
    (tmp_path / "gone.yaml").write_text(yaml.safe_dump({
        "name": "gone", "description": "d", "parameters": ECHO_PARAMETERS,
        "endpoint": "http://127.0.0.1:9/tools/gone", "options": {"max_retries": 1,
                                                                  "timeout_s": 1}}))
    result = asyncio.run(load_toolbox([tmp_path]).call("gone", {"text": "x"}))
    assert result.error.startswith("gone endpoint failed:") and "after 2 attempts" in result.error


def test_tools_serve_command_serves_and_stops_on_sigterm():
    import json
    import signal
    import subprocess
    import sys

    import httpx

    server = subprocess.Popen([sys.executable, "-m", "nemo_orch.cli", "tools", "serve",
                               "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        line = server.stdout.readline()
        assert line.startswith("tools: serving http://127.0.0.1:"), server.stderr.read()
        base = line.split()[2].removesuffix("/tools/<name>")
        listed = httpx.get(f"{base}/tools", timeout=30).json()["tools"]
        assert [t["function"]["name"] for t in listed] == ["call_expert", "python_sandbox",
                                                           "search"]
        reply = httpx.post(f"{base}/tools/python_sandbox", timeout=30,
                           json={"arguments": {"code": "print(6 * 7)"}}).json()
        assert reply["output"] == "42\n" and reply["error"] is None
        bad = httpx.post(f"{base}/tools/search", timeout=30, json={"arguments": "q"})
        assert bad.status_code == 400 and "'arguments' must be a JSON object" in json.dumps(
            bad.json())
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
