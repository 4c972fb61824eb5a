"""Servers on 127.0.0.1 at free ports, with PyTriton's workspace under the test's directory."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from support.cli_helpers import free_ports

from nemo_orch.config import ServeConfig


def serve_config(workspace_root: Path, **fields: object) -> ServeConfig:
    http, grpc, metrics = free_ports(3)
    return ServeConfig(
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        workspace_root=str(workspace_root),
        **fields,
    )


@pytest.fixture(scope="module")
def workspace_root() -> Path:
    """A short directory: PyTriton's UNIX sockets live in its workspace (at most 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="serve-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def make_serve_config(workspace_root: Path):
    """``make_serve_config(**fields)``: a :class:`ServeConfig` on free ports."""
    return lambda **fields: serve_config(workspace_root, **fields)
