"""The training job's entry point: it waits for its servers and the Ray cluster, then runs the
command with their endpoints as overrides."""

import json
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


def test_ray_address_appears_with_the_clusters_file(tmp_path):
    info = tmp_path / "ray_cluster_info.json"
    assert job.ray_address(info) is None
    info.write_text('{"head_ip": "10.0.0.')  # being written
    assert job.ray_address(info) is None
    info.write_text(json.dumps({"head_ip": "10.0.0.5", "dashboard_port": "8265", "port": "6379"}))
    assert job.ray_address(info) == "10.0.0.5:6379"


def test_the_job_waits_then_runs_the_command_with_the_endpoints(server, tmp_path, monkeypatch,
                                                                capsys):
    monkeypatch.setenv("NEMO_ORCH_HOST_1", "127.0.0.1")
    monkeypatch.setenv("RAY_ADDRESS", "")  # restored after the job sets it
    info = tmp_path / "ray_cluster_info.json"
    threading.Timer(0.3, lambda: info.write_text(json.dumps(
        {"head_ip": "10.0.0.5", "port": "6379"}))).start()
    code = job.main(["--endpoint", f"tools.endpoints.math=http://${{NEMO_ORCH_HOST_1}}:{server}"
                     "/v1", "--ray-info", str(info), "--timeout", "30",
                     "sft", "--print-config", "tools=experts"])
    assert code == 0 and Health.requests == 3
    printed = capsys.readouterr()
    assert f"math: http://127.0.0.1:{server}/v1" in printed.out
    assert f"waiting for tools.endpoints.math at http://127.0.0.1:{server}/v1" in printed.err
    assert job.os.environ["RAY_ADDRESS"] == "10.0.0.5:6379"


def test_a_server_that_never_comes_up_fails_the_job(tmp_path, capsys):
    code = job.main(["--endpoint", "reward.judge_base_url=http://127.0.0.1:9/v1",
                     "--timeout", "0.2", "sft", "--print-config"])
    assert code == 1
    assert "reward.judge_base_url at http://127.0.0.1:9/v1 was not ready in time" in (
        capsys.readouterr().err)
