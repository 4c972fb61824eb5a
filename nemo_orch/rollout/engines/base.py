"""The generation-engine seam shared by the CPU engine, OpenAI-compatible servers and the GPU
engines (TensorRT-LLM, vLLM): token ids in, token ids + logprobs out.

Below the seam are the checks and mappings both GPU engines share, so they report errors, seeds,
logprobs and finish reasons the way the CPU reference engine (:mod:`.hf`) does.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from nemo_orch.config import ModelConfig
from nemo_orch.models.hf_mapping import hf_parameter_names, hf_parameter_shape, model_config_from_hf

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """An engine that cannot serve a request (bad parameters, unreachable server, ...)."""


WeightUpdate = Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]]
"""What :meth:`Engine.update_weights` takes: full HF-named tensors, or the same streamed as
buckets of whole tensors (:func:`nemo_orch.models.weights.hf_weight_buckets`), which the engine
loads one by one, so a refit holds one bucket at a time, not a second copy of the model."""

PARTIAL_REFIT = (
    "the last refit stopped half-way (see its error), so the engine holds a mix of "
    "old and new weights; refit it again before generating"
)


@dataclass(frozen=True)
class SamplingParams:
    """How to continue each prompt. ``temperature=0`` is greedy; ``top_k=0`` disables top-k.
    Generation of a sequence stops at ``max_new_tokens``, at any ``stop_token_ids`` (kept in the
    output) or when its decoded continuation ends with one of ``stop_strings`` (kept too).
    ``seed`` seeds prompt ``i`` of a call with ``seed + i`` unless the call gives per-prompt
    seeds (see :func:`prompt_seeds`)."""

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
    (``stop``: a stop token or string; ``length``: ``max_new_tokens``). ``policy_version``: the
    version of the weights that wrote it, where a
    :class:`~nemo_orch.rollout.runner.GenerationBatcher` tracks them (asynchronous GRPO)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str = ""
    prompt_tokens: int = 0
    extra: dict = field(default_factory=dict)
    policy_version: int | None = None


@runtime_checkable
class Engine(Protocol):
    """Batched generation. ``seeds``, when given, is each prompt's own sampling seed (see
    :func:`prompt_seeds`): a prompt sampled with its seed continues the same way in any batch,
    which makes rollouts independent of how episodes were batched or which worker ran them.
    ``update_weights`` takes HF-named full tensors or a stream of their buckets (the refit
    path from the Megatron policy, :data:`WeightUpdate`), checked by :func:`checked_buckets`."""

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[Generation]: ...

    def update_weights(self, weights: WeightUpdate) -> None: ...


@runtime_checkable
class Sleepable(Protocol):
    """An engine that can give its GPU memory back while the policy trains on the same GPUs
    (``rollout.colocate``): ``sleep`` releases it, ``wake_up`` takes it again before the next
    refit and generation."""

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


# ----------------------------------------------------------------------------- GPU engines

ENGINE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def require_cuda(engine: str) -> None:
    """Fail with a clear error where a GPU engine would otherwise die deep inside its library."""
    if not torch.cuda.is_available():
        raise EngineError(
            f"rollout.engine={engine} needs a CUDA GPU, and none is visible here "
            "(torch.cuda.is_available() is false); use rollout.engine=hf on CPU"
        )


def prompt_seeds(
    params: SamplingParams, count: int, seeds: Sequence[int] | None = None
) -> list[int]:
    """One sampling seed per prompt: ``seeds`` when the caller gives them (rollouts give each
    episode turn its own), else ``params.seed + i``, from a random base when that is None.

    Identical prompts (a GRPO group) must not share a seed, or a library that seeds every request
    alike (TensorRT-LLM's default is 0) returns the same sample ``group_size`` times.
    """
    if seeds is not None:
        if len(seeds) != count:
            raise EngineError(f"{len(seeds)} seeds for {count} prompts")
        return list(seeds)
    base = random.SystemRandom().randrange(2**31) if params.seed is None else params.seed
    return [base + index for index in range(count)]


def check_prompts(prompts: Sequence[Sequence[int]], max_seq_len: int, vocab_size: int) -> None:
    """Every engine's rules, checked before the libraries reject prompts with less helpful
    errors: no empty prompt, room for one new token, ids inside the vocabulary."""
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise EngineError(f"prompt {index} is empty")
        if len(prompt) >= max_seq_len:
            raise EngineError(
                f"prompt {index} has {len(prompt)} tokens; the engine takes at most "
                f"{max_seq_len - 1} to leave room for one new token"
            )
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise EngineError(f"prompt {index} has token ids outside [0, {vocab_size})")


def served_model_config(hf_config: Mapping[str, Any]) -> ModelConfig:
    """The architecture of the HF Qwen3 ``config.json`` a GPU engine serves (what a refit must
    match); anything else is an engine error, not a crash."""
    try:
        return model_config_from_hf(hf_config, ModelConfig())
    except (KeyError, ValueError) as error:
        raise EngineError(f"not an HF Qwen3 config.json: {error}") from None


def hf_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF parameter of ``model`` (the refit's names) with its shape."""
    return {name: hf_parameter_shape(model, name) for name in hf_parameter_names(model)}


def _check_shapes(
    bucket: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]
) -> None:
    for name, tensor in bucket.items():
        if tuple(tensor.shape) != tuple(shapes[name]):
            raise EngineError(
                f"{name}: shape {tuple(tensor.shape)} does not match the model's "
                f"{tuple(shapes[name])}"
            )


def checked_buckets(
    weights: WeightUpdate, shapes: Mapping[str, tuple[int, ...]]
) -> Iterator[Mapping[str, torch.Tensor]]:
    """The refit contract of every engine: HF-named tensors covering the model (``shapes``)
    exactly, each of its shape, yielded bucket by bucket for the engine to load.

    A full state is checked whole before its one bucket is yielded, so a rejected state leaves
    the running model intact (the libraries load name by name and would stop half-way). A
    stream is checked bucket by bucket before each is yielded (names known and not seen
    before, shapes) and for coverage at its end; one that fails after a bucket was loaded
    leaves the engine partly refitted, which its ``partial_refit`` flag records (see
    :data:`PARTIAL_REFIT`)."""
    if isinstance(weights, Mapping):
        missing = sorted(shapes.keys() - weights.keys())
        unexpected = sorted(weights.keys() - shapes.keys())
        if missing or unexpected:
            raise EngineError(
                f"weights do not match the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        _check_shapes(weights, shapes)
        yield weights
        return
    seen: set[str] = set()
    for index, bucket in enumerate(weights):
        unexpected = sorted(bucket.keys() - shapes.keys())
        repeated = sorted(bucket.keys() & seen)
        if unexpected or repeated:
            raise EngineError(
                f"weight bucket {index} does not match the model: unexpected "
                f"{unexpected[:5]}, sent before {repeated[:5]}"
            )
        _check_shapes(bucket, shapes)
        seen |= bucket.keys()
        yield bucket
    missing = sorted(shapes.keys() - seen)
    if missing:
        raise EngineError(
            f"the weight stream ended without {len(missing)} of the model's "
            f"tensors: missing {missing[:5]}"
        )


def weight_buckets(
    state: Mapping[str, torch.Tensor], dtype: torch.dtype, max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``(name, tensor)`` pairs in the engine's dtype, in groups of at most ``max_bytes`` (a
    larger tensor goes alone), so a refit never holds a second copy of the whole model."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in state.items():
        tensor = tensor.detach().to(dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def sampled_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Any] | None, library: str
) -> list[float]:
    """The logprob of each sampled token from a library's per-token logprobs: a float, or a
    ``{token_id: Logprob | float}`` dict that holds the sampled token (vLLM with ``logprobs=0``,
    TensorRT-LLM's top-k dicts)."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise EngineError(
            f"{library} returned {0 if logprobs is None else len(logprobs)} "
            f"logprobs for {len(token_ids)} tokens"
        )
    values = []
    for position, (token, entry) in enumerate(zip(token_ids, logprobs)):
        if isinstance(entry, Mapping):
            if token not in entry:
                raise EngineError(
                    f"{library} returned no logprob for sampled token {token} at "
                    f"position {position}"
                )
            entry = entry[token]
        values.append(float(getattr(entry, "logprob", entry)))
    return values


def finish_reason(reason: str | None, library: str) -> str:
    """A library's finish reason as the seam's ``stop`` | ``length``; anything else (aborted,
    cancelled, timed out) is an engine failure, not a generation."""
    if reason in ("stop", "length"):
        return reason
    raise EngineError(f"{library} ended a request with finish reason {reason!r}")


REFIT_GROUP_BYTES = 512 << 20  # what one call into a GPU library's weight loader carries


class RefitGuard:
    """An engine's refit through :func:`checked_buckets`, and the refusal to generate on the
    mixed weights a stream that stopped half-way leaves (:data:`PARTIAL_REFIT`) until a full
    refit succeeds."""

    partial_refit = False

    def _refit(
        self,
        weights: WeightUpdate,
        shapes: Mapping[str, tuple[int, ...]],
        load: Callable[[Mapping[str, torch.Tensor]], None],
    ) -> int:
        """Each checked bucket of ``weights`` into ``load``; the number of tensors loaded."""
        loaded = 0
        for bucket in checked_buckets(weights, shapes):
            self.partial_refit = True
            load(bucket)
            loaded += len(bucket)
        self.partial_refit = False
        return loaded

    def _check_refitted(self) -> None:
        if self.partial_refit:
            raise EngineError(PARTIAL_REFIT)


class LibraryEngineMixin(RefitGuard):
    """What the GPU library engines share: caveats logged once per engine (not per batch), the
    tokenizer's decoding of sampled tokens and the refit's checks and grouping. Needs
    ``self.tokenizer``, ``self._warned``, ``self.model_config`` and ``self.dtype``."""

    tokenizer: Any
    _warned: set[str]
    model_config: ModelConfig
    dtype: torch.dtype

    def _load_weights(
        self, weights: WeightUpdate, load: Callable[[list[tuple[str, torch.Tensor]]], None]
    ) -> int:
        """Hand ``weights``, checked against the served model, to the library's ``load`` in
        groups of at most :data:`REFIT_GROUP_BYTES` in the engine's dtype; the number of
        tensors loaded."""

        def load_bucket(bucket: Mapping[str, torch.Tensor]) -> None:
            for group in weight_buckets(bucket, self.dtype, REFIT_GROUP_BYTES):
                load(group)

        return self._refit(weights, hf_shapes(self.model_config), load_bucket)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
