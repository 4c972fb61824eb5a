"""Tools declared by ``endpoint:`` when nothing answers there; served tools are tested against
real Triton servers in ``tests/serve/test_triton.py``."""

from __future__ import annotations

import asyncio

import yaml
from support.fixture_tools import ECHO_PARAMETERS

from nemo_orch.tools.registry import load_toolbox


def test_unreachable_endpoint_is_an_error_result(tmp_path):
    (tmp_path / "gone.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "gone",
                "description": "d",
                "parameters": ECHO_PARAMETERS,
                "endpoint": "http://127.0.0.1:9",
                "options": {"max_retries": 1, "timeout_s": 1},
            }
        )
    )
    result = asyncio.run(load_toolbox([tmp_path]).call("gone", {"text": "x"}))
    assert result.error.startswith("gone endpoint failed:") and "after 2 attempts" in result.error
