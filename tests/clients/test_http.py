"""The retry policy every external call shares."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from nemo_orch.clients.http import HTTPError, JSONClient, error_message


def test_backoff_is_exponential_jittered_and_capped():
    client = JSONClient("http://127.0.0.1:1", backoff_s=1.0, max_backoff_s=4.0, seed=0)
    for attempt, full in enumerate([1.0, 2.0, 4.0, 4.0]):
        delays = [client._delay(attempt, None) for _ in range(50)]
        assert all(full / 2 <= delay <= full for delay in delays)
        assert len(set(delays)) > 1
    assert client._delay(0, httpx.Response(429, headers={"retry-after": "30"})) == 4.0
    assert client._delay(0, httpx.Response(429, headers={"retry-after": "0.1"})) == 0.1


def test_missing_key_is_an_error_of_the_request(monkeypatch):
    monkeypatch.delenv("NEMO_ORCH_NO_SUCH_KEY", raising=False)
    client = JSONClient("http://127.0.0.1:1", api_key_env="NEMO_ORCH_NO_SUCH_KEY")
    with pytest.raises(HTTPError, match="NEMO_ORCH_NO_SUCH_KEY .* is not set"):
        asyncio.run(client.request("GET", "x"))


def test_options_are_checked():
    with pytest.raises(ValueError, match="max_retries"):
        JSONClient("http://127.0.0.1:1", max_retries=-1)


def test_a_servers_traceback_is_cut_to_its_innermost_message():
    # What Triton answers for a Python-backend model that raises (PyTriton 0.5.0 unpatched).
    wrapped = (
        "Failed to process the request(s) for model instance 'm_0_0', message: "
        "TritonModelException: Model execute error: Traceback (most recent call last):\n"
        '  File "/srv/1/model.py", line 462, in execute\n'
        "c_python_backend_utils.TritonModelException: Traceback (most recent call last):\n"
        '  File "/srv/app.py", line 9, in __call__\n    raise ValueError(why)\n'
        "ValueError: metadata must be a JSON object\n\n\nAt:\n  /srv/1/model.py(469)\n"
    )
    assert (
        error_message(httpx.Response(400, json={"error": wrapped}))
        == "metadata must be a JSON object"
    )
    assert error_message(httpx.Response(400, json={"error": "one line"})) == "one line"
