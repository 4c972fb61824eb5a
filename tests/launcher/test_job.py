"""The training job's entry point: it waits for its servers and the Ray cluster, then runs the
command with their endpoints as overrides."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nemo_orch.launcher import job


class Health(BaseHTTPRequestHandler):
    """A server that turns healthy after its first two /health requests (it is loading)."""

    requests = 0

    def do_GET(self):  # noqa: N802 (http.server's name)
        Health.requests += 1
        self.send_response(200 if self.path == "/health" and Health.requests > 2 else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Health.requests = 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr(job, "POLL_INTERVAL_S", 0.05)


def test_urls_take_hosts_from_the_environment(monkeypatch):
    monkeypatch.setenv("NEMO_ORCH_HOST_1", "node7")
    assert job.expand("http://${NEMO_ORCH_HOST_1}:8001/v1") == "http://node7:8001/v1"
    assert job.health_url("http://node7:8001/v1") == "http://node7:8001/health"
    with pytest.raises(job.LaunchError, match="names an undefined environment variable"):
        job.expand("http://$NEMO_ORCH_HOST_9:8001/v1")


def test_the_job_waits_then_runs_the_command_with_the_endpoints(server, monkeypatch, capsys):
    monkeypatch.setenv("NEMO_ORCH_HOST_1", "127.0.0.1")
    code = job.main(
        [
            "--endpoint",
            f"tools.endpoints.math=http://${{NEMO_ORCH_HOST_1}}:{server}/v1",
            "--timeout",
            "30",
            "sft",
            "--print-config",
            "tools=experts",
        ]
    )
    assert code == 0 and Health.requests == 3
    printed = capsys.readouterr()
    assert f"math: http://127.0.0.1:{server}/v1" in printed.out
    assert f"waiting for tools.endpoints.math at http://127.0.0.1:{server}/v1" in printed.err


def test_the_first_rank_waits_for_the_ray_cluster_the_others_join_it(monkeypatch, capsys):
    """(A Ray cluster started inside a SLURM job, joined for real: test_slurm.py.)"""
    monkeypatch.setenv("NEMO_ORCH_RDZV_HOST", "127.0.0.1")
    monkeypatch.setenv("RAY_ADDRESS", "")  # restored after the job sets it
    assert job.ray_nodes("127.0.0.1:9") == 0  # no head listens there
    ray_args = ["--ray", "${NEMO_ORCH_RDZV_HOST}:9", "--ray-nodes", "2", "--timeout", "0.2"]
    monkeypatch.setenv("RANK", "0")
    assert job.main([*ray_args, "sft", "--print-config"]) == 1
    assert "the Ray cluster at 127.0.0.1:9 (2 nodes) was not ready in time" in (
        capsys.readouterr().err
    )
    monkeypatch.setenv("RANK", "1")  # the other ranks do not wait (only the first rolls out)
    assert job.main([*ray_args, "sft", "--print-config"]) == 0
    assert job.os.environ["RAY_ADDRESS"] == "127.0.0.1:9"


def test_a_server_that_never_comes_up_fails_the_job(tmp_path, capsys):
    code = job.main(
        [
            "--endpoint",
            "reward.judge_base_url=http://127.0.0.1:9/v1",
            "--timeout",
            "0.2",
            "sft",
            "--print-config",
        ]
    )
    assert code == 1
    assert "reward.judge_base_url at http://127.0.0.1:9/v1 was not ready in time" in (
        capsys.readouterr().err
    )
