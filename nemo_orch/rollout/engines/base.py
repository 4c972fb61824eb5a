"""The generation-engine seam shared by the CPU engine, OpenAI-compatible servers and the GPU
engines (TensorRT-LLM, vLLM): token ids in, token ids + logprobs out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


class EngineError(RuntimeError):
    """An engine that cannot serve a request (bad parameters, unreachable server, ...)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to continue each prompt. ``temperature=0`` is greedy; ``top_k=0`` disables top-k.
    Generation of a sequence stops at ``max_new_tokens``, at any ``stop_token_ids`` (kept in the
    output) or when its decoded continuation ends with one of ``stop_strings`` (kept too)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise EngineError("max_new_tokens must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise EngineError("temperature must be >= 0, top_p in (0, 1] and top_k >= 0")


@dataclass(frozen=True)
class Generation:
    """One continuation: its tokens, the sampling logprob of each, and why it ended
    (``stop``: a stop token or string; ``length``: ``max_new_tokens``)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str = ""
    prompt_tokens: int = 0
    extra: dict = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """Batched generation. ``update_weights`` takes HF-named full tensors (the refit path from
    the Megatron policy, through :mod:`nemo_orch.models.hf_mapping`)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...

    def update_weights(self, state: Mapping[str, torch.Tensor]) -> None: ...
