"""Run Megatron-Core on machines without CUDA.

megatron-core 0.16.1 assumes CUDA in a handful of places (RNG tracker, ``device="cuda"`` and
``.cuda()`` calls, ``torch.cuda.current_device()``, tensor-type asserts in the optimizer, a causal
mask built on the GPU, ``torch.cuda.synchronize()``). This module redirects exactly those to the
CPU. It is the only place in nemo-orch that touches Megatron internals, and :func:`apply` is a
no-op when CUDA is present.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_LOCK = threading.Lock()
_CPU = torch.device("cpu")
# Tensor.type() strings the optimizer asserts on, keyed by the CPU type torch reports.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int):
        return True  # Megatron passes torch.cuda.current_device() (an int) as the device.
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU for every torch call made inside it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_CPU if _is_cuda_device(a) and not isinstance(a, int) else a for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """Megatron's CUDA RNG tracker, keeping CPU generator states instead.

    Named states are swapped into the global CPU generator inside ``fork()``, which is what the
    CUDA tracker does with the device generator.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG state {name!r} or seed {seed} already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


@functools.lru_cache(maxsize=8)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def model_parallel_seed(seed: int) -> None:
    """CPU counterpart of ``tensor_parallel.model_parallel_cuda_manual_seed``."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    tracker = mp_random.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(
        mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
        seed + 2718 + parallel_state.get_tensor_model_parallel_rank(),
    )
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)


def apply() -> bool:
    """Patch Megatron-Core for CPU execution; returns whether patches are in force.

    Call from the main thread before building models. Idempotent; does nothing with CUDA.
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if _APPLIED:
            return True
        from megatron.core.fusions import fused_softmax
        from megatron.core.tensor_parallel import random as mp_random
        from megatron.core.transformer import utils as transformer_utils

        torch.cuda.current_device = lambda: _CPU
        torch.cuda.synchronize = lambda device=None: None
        mp_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
        mp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
        mp_random.model_parallel_cuda_manual_seed = lambda seed, *a, **k: model_parallel_seed(seed)
        transformer_utils.get_default_causal_mask = _cpu_causal_mask
        fused_softmax.get_default_causal_mask = _cpu_causal_mask
        # The mode is per thread; training runs in the main thread (backward's recompute uses
        # the patched functions above, not the mode).
        _CudaToCpuMode().__enter__()
        _APPLIED = True
    return True
