"""``nemo-orch serve reward|tool`` as users run it: a real process without ``LD_LIBRARY_PATH``,
answering over HTTP, stopped by SIGTERM within 10 s with PyTriton's workspace removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
from support.cli_helpers import run_cli

from nemo_orch.data.tasks import Task
from nemo_orch.reward.remote import reward_item

SHUTDOWN_LIMIT_S = 10


def test_reward_server_serves_then_stops_on_sigterm(make_serve_config, workspace_root):
    settings = make_serve_config()
    env = {key: value for key, value in os.environ.items() if key != "LD_LIBRARY_PATH"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nemo_orch.cli",
            "serve",
            "reward",
            f"serve.http_port={settings.http_port}",
            f"serve.grpc_port={settings.grpc_port}",
            f"serve.metrics_port={settings.metrics_port}",
            f"serve.workspace_root={workspace_root}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        banner = server.stdout.readline()
        assert banner.startswith("reward: serving reward at http://127.0.0.1:"), banner
        assert len(list(workspace_root.iterdir())) == 1  # the server's own workspace
        row = reward_item(Task("t", "2 + 2?", answer="4"), "4")
        answer = httpx.post(
            f"http://127.0.0.1:{settings.http_port}/v2/models/reward/infer",
            json={
                "inputs": [
                    {"name": name, "datatype": "BYTES", "shape": [1, 1], "data": [text]}
                    for name, text in row.items()
                ]
            },
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        metrics = httpx.get(f"http://127.0.0.1:{settings.metrics_port}/metrics").text
        assert 'nemo_orch_serve_requests_total{model="reward",status="ok"} 1.0' in metrics

        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=SHUTDOWN_LIMIT_S) == 0
        assert time.monotonic() - started < SHUTDOWN_LIMIT_S
        assert list(workspace_root.iterdir()) == []
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


def test_serving_an_unknown_tool_is_a_user_error():
    result = run_cli("serve", "tool", "no_such_tool", expect=2)
    assert "unknown tools ['no_such_tool']" in result.stderr
