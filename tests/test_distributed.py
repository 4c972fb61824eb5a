"""The process-level settings of ``nemo_orch.distributed``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# The trainer's intra-op threads set, then a thread that sets one for itself (as the CPU engine's
# does) runs before the trainer's first reduction: the trainer's attention gradients must be the
# ones a fresh thread of the same count computes.
_TRAINER_AFTER_AN_ENGINE_THREAD = """
import hashlib, threading, torch
import torch.nn.functional as F
from nemo_orch import distributed
distributed.set_intra_op_threads(2)
engine = threading.Thread(target=lambda: (torch.set_num_threads(1), torch.ones(64, 64).sum()))
engine.start(); engine.join()
torch.zeros(384, 16, 128).mean(-1)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(8, heads, 240, 32, generator=g, requires_grad=True) for heads in (4, 2, 2))
def grads():
    for x in (q, k, v):
        x.grad = None
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(
        torch.ones(8, 4, 240, 32))
    return hashlib.sha1(q.grad.numpy().tobytes() + k.grad.numpy().tobytes()).hexdigest()
fresh = {}
def in_a_fresh_thread():
    torch.set_num_threads(2)
    fresh["grads"] = grads()
trainer = grads()
other = threading.Thread(target=in_a_fresh_thread); other.start(); other.join()
print(trainer == fresh["grads"])
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs (an OpenMP worker)")
def test_another_threads_count_does_not_reach_the_trainers_workers():
    result = subprocess.run(
        [sys.executable, "-c", _TRAINER_AFTER_AN_ENGINE_THREAD],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout.strip() == "True", result.stderr
