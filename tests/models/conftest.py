"""An in-process, single-rank Megatron world for model tests (gloo on 127.0.0.1)."""

import pytest

from nemo_orch import distributed
from nemo_orch.config import ParallelConfig


@pytest.fixture(scope="session")
def megatron_world():
    context = distributed.initialize(ParallelConfig(), seed=0)
    yield context
    distributed.shutdown()
