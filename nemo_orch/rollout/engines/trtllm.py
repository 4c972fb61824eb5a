"""TensorRT-LLM's ``LLM`` (1.x) behind the :class:`~nemo_orch.rollout.engines.base.Engine` seam.

Two backends, picked from the directory: an HF Qwen3 directory runs on the PyTorch backend
(``tensorrt_llm.LLM``); a directory of built engines (``rank*.engine`` from ``trtllm-build``) or
a TensorRT-LLM checkpoint (``nemo-orch export --format trtllm``, built on load) runs on the
TensorRT backend. Prompts go in as token ids, under the CPU reference engine's rules
(:mod:`.hf`): stop tokens and stop strings are kept, EOS does not end a sequence unless it is a
stop token, and each prompt gets its own seed (TensorRT-LLM seeds every request with 0 by default,
which would make a GRPO group ``group_size`` copies of one sample).

Stop strings: TensorRT-LLM matches them as token sequences (the string encoded on its own),
which misses a string the model spelled with other tokens. Every result is therefore cut, as
the reference engine does, after the first token whose decoded continuation contains a stop
string.

Logprobs (``logprobs=1``): greedy ones are ``log_softmax(logits)``, the reference convention.
Sampling at temperature 1 they are the raw ``log_softmax(logits)``, which is the reference too.
At another temperature the engine asks for ``logprobs_mode="processed"`` (after temperature, and
after top-k/top-p, which then renormalise as in vLLM); a release without that field reports
logprobs before temperature. Either difference is warned about once. The TensorRT backend
derives logprobs from the generation logits, so engines must be built with
``trtllm-build --gather_generation_logits``.

Refit (PyTorch backend, ``refit=True``): the engine runs on TensorRT-LLM's Ray orchestrator with
its RLHF worker extension (``tensorrt_llm.llmapi.rlhf_utils.WorkerExtension``, TensorRT-LLM
>= 1.1). ``update_weights`` copies HF-named tensors to the engine's GPUs in buckets, hands them
over as CUDA IPC handles (so the engine must share this node's first ``tensor_parallel_size``
GPUs, as it does colocated), and finalises the load. A built engine cannot be refit: its weights
are compiled in.

KV-cache block reuse (TensorRT-LLM's prefix cache, ``rollout.prefix_caching``: an episode's turns
and a group's shared prompt reuse their blocks) is on, and on a refittable engine only where the
RLHF extension can reset it (``reset_prefix_cache``, in recent releases): every refit resets it
after the finalising step, so no block computed with the old weights is reused. Without that
method reuse stays off on a refittable engine, and the engine logs why (:func:`block_reuse`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from nemo_orch.rollout.engines.base import (
    ENGINE_DTYPES,
    EngineError,
    Generation,
    LibraryEngineMixin,
    SamplingParams,
    WeightUpdate,
    check_prompts,
    finish_reason,
    prompt_seeds,
    require_cuda,
    sampled_logprobs,
    served_model_config,
)

log = logging.getLogger(__name__)

LIBRARY = "TensorRT-LLM"
PYTORCH, TENSORRT = "pytorch", "tensorrt"
_RLHF_EXTENSION = "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"


def import_trtllm() -> ModuleType:
    """The ``tensorrt_llm`` package, or the one error that says what to install."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        raise EngineError(
            "rollout.engine=trtllm needs TensorRT-LLM, which is not installed: pip "
            "install 'nemo-orch[gpu]' or use an NGC container "
            "(nvcr.io/nvidia/tensorrt-llm/release)"
        )
    try:
        import tensorrt_llm
    except Exception as error:  # a broken install fails in many ways (CUDA libraries, MPI, ABI)
        raise EngineError(f"TensorRT-LLM is installed but does not import: {error}") from error
    return tensorrt_llm


def trtllm_backend(directory: str | Path) -> str:
    """``tensorrt`` for built engines or a TensorRT-LLM checkpoint, ``pytorch`` for an HF
    directory."""
    directory = Path(directory)
    if any(directory.glob("rank*.engine")):
        return TENSORRT
    config = directory / "config.json"
    if (
        any(directory.glob("rank*.safetensors"))
        and config.is_file()
        and "architecture" in json.loads(config.read_text())
    ):
        return TENSORRT
    return PYTORCH


def model_limits(config: Mapping[str, Any]) -> tuple[int, int]:
    """``(max_seq_len, vocab_size)`` from the ``config.json`` of an HF directory, a TensorRT-LLM
    checkpoint (both flat) or a built engine (``pretrained_config`` + ``build_config``)."""
    pretrained = config.get("pretrained_config", config)
    try:
        max_seq_len = (config.get("build_config") or {}).get("max_seq_len") or pretrained[
            "max_position_embeddings"
        ]
        return int(max_seq_len), int(pretrained["vocab_size"])
    except KeyError as error:
        raise EngineError(
            f"config.json has no {error}: not a Qwen3 model, checkpoint or engine"
        ) from None


def rlhf_extension_resets_prefix_cache() -> bool:
    """Whether the installed RLHF worker extension can reset the engine's prefix cache."""
    if importlib.util.find_spec("tensorrt_llm.llmapi.rlhf_utils") is None:
        return False
    from tensorrt_llm.llmapi.rlhf_utils import WorkerExtension

    return hasattr(WorkerExtension, "reset_prefix_cache")


def block_reuse(prefix_caching: bool, refit: bool, resettable: bool) -> tuple[bool, str | None]:
    """Whether the engine reuses KV-cache blocks and, when it does not, why: a refittable engine
    reuses them only when its prefix cache can be reset (``resettable``) after each refit."""
    if not prefix_caching:
        return False, "rollout.prefix_caching=false"
    if refit and not resettable:
        return False, (
            "this TensorRT-LLM's RLHF worker extension has no reset_prefix_cache, so a refit "
            "could not drop the KV blocks of the old weights; a newer release reuses them"
        )
    return True, None


def trtllm_sampling_kwargs(
    params: SamplingParams, *, processed_logprobs: bool = True
) -> dict[str, Any]:
    """``tensorrt_llm.SamplingParams`` fields for ``params`` (the seed and ``max_tokens`` are
    set per prompt by the engine). Greedy is ``top_k=1``, the convention of every 1.x release;
    ``top_k=0`` means all tokens, as ours does. ``processed_logprobs``: the installed release
    has ``logprobs_mode`` (see the module docstring for when it is asked for)."""
    kwargs: dict[str, Any] = {
        "max_tokens": params.max_new_tokens,
        "seed": params.seed,
        "logprobs": 1,
        "stop": list(params.stop_strings) or None,
        "stop_token_ids": list(params.stop_token_ids) or None,
        "include_stop_str_in_output": True,
        "ignore_eos": True,
        "detokenize": False,
    }
    if params.temperature == 0:
        kwargs["top_k"] = 1
    else:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        if params.temperature != 1 and processed_logprobs:
            kwargs["logprobs_mode"] = "processed"
    return kwargs


def stop_string_cut(
    token_ids: Sequence[int], stop_strings: Sequence[str], decode: Callable[[list[int]], str]
) -> tuple[int, str] | None:
    """``(n, stop)``: the first ``n`` tokens are the shortest prefix whose decoded text contains
    a stop string, ``stop`` the first of ``stop_strings`` in it; None when there is none.

    A longer prefix decodes to a longer text, so the prefixes that contain a stop string are a
    suffix of the lengths and a binary search finds the first in ``log n`` decodes.
    """

    def first_stop(count: int) -> str | None:
        text = decode(list(token_ids[:count]))
        return next((stop for stop in stop_strings if stop in text), None)

    if not stop_strings or not token_ids or first_stop(len(token_ids)) is None:
        return None
    low, high = 1, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if first_stop(middle) is None:
            low = middle + 1
        else:
            high = middle
    return low, first_stop(low)


def trtllm_generation(
    completion: Any,
    prompt_tokens: int,
    decode: Callable[[list[int]], str],
    stop_strings: Sequence[str] = (),
) -> Generation:
    """A ``tensorrt_llm`` ``CompletionOutput`` (``token_ids``, ``logprobs`` as floats or
    ``{token: Logprob}`` per position, ``finish_reason``, ``stop_reason``) as a
    :class:`Generation`, cut at the first stop string (see the module docstring)."""
    token_ids = [int(token) for token in completion.token_ids]
    logprobs = sampled_logprobs(token_ids, completion.logprobs, LIBRARY)
    reason = finish_reason(completion.finish_reason, LIBRARY)
    stop = completion.stop_reason if reason == "stop" else None
    cut = stop_string_cut(token_ids, stop_strings, decode)
    # A stop token on the last token was checked before the stop strings, as the reference does.
    if cut is not None and (cut[0] < len(token_ids) or not isinstance(stop, int)):
        (kept, stop), reason = cut, "stop"
        token_ids, logprobs = token_ids[:kept], logprobs[:kept]
    return Generation(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=reason,
        text=decode(token_ids),
        prompt_tokens=prompt_tokens,
        extra={} if stop is None else {"stop": stop},
    )


class TRTLLMEngine(LibraryEngineMixin):
    """Batched generation with TensorRT-LLM on the GPU.

    ``directory``: an HF Qwen3 directory (PyTorch backend), built engines or a TensorRT-LLM
    checkpoint (TensorRT backend); ``tokenizer`` is the policy's, used by TensorRT-LLM for stop
    strings and here to decode ``Generation.text``. ``free_gpu_memory_fraction``: the share of
    the memory left after loading the weights that goes to the KV cache. ``refit``: start the
    PyTorch backend so that :meth:`update_weights` works (see the module docstring).
    ``max_seq_len`` null: the model's (or the built engine's). ``prefix_caching``: reuse KV-cache
    blocks where a refit can reset them (see the module docstring).
    """

    def __init__(
        self,
        directory: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "bfloat16",
        free_gpu_memory_fraction: float = 0.5,
        max_batch_size: int = 64,
        max_seq_len: int | None = None,
        refit: bool = False,
        prefix_caching: bool = True,
    ) -> None:
        trtllm = import_trtllm()
        require_cuda("trtllm")
        if dtype not in ENGINE_DTYPES:
            raise EngineError(f"dtype must be one of {'|'.join(ENGINE_DTYPES)}, got {dtype!r}")
        directory = Path(directory)
        if not (directory / "config.json").is_file():
            raise EngineError(
                f"{directory}: no config.json; expected an HF directory, "
                "built engines or a TensorRT-LLM checkpoint"
            )
        config = json.loads((directory / "config.json").read_text())
        self.backend = trtllm_backend(directory)
        limit, self.vocab_size = model_limits(config)
        self.max_seq_len = max_seq_len or limit
        self.tokenizer = tokenizer
        self.tensor_parallel_size = tensor_parallel_size
        self.dtype = ENGINE_DTYPES[dtype]
        self.refit = refit
        self.last_refit_seconds: float | None = None
        self._warned: set[str] = set()
        self._sampling_params = trtllm.SamplingParams
        self._processed_logprobs = "logprobs_mode" in {
            f.name for f in dataclasses.fields(trtllm.SamplingParams)
        }
        from tensorrt_llm.llmapi import KvCacheConfig

        self.block_reuse, why_not = block_reuse(
            prefix_caching, refit, refit and rlhf_extension_resets_prefix_cache()
        )
        if why_not is not None:
            log.info("trtllm: KV-cache block reuse is off: %s", why_not)
        kv_cache = KvCacheConfig(
            free_gpu_memory_fraction=free_gpu_memory_fraction, enable_block_reuse=self.block_reuse
        )
        common = {
            "tokenizer": tokenizer,
            "tensor_parallel_size": tensor_parallel_size,
            "kv_cache_config": kv_cache,
        }
        if self.backend == TENSORRT:
            if refit:
                raise EngineError(self._built_engine_refit())
            from tensorrt_llm._tensorrt_engine import LLM

            # The TensorRT backend derives logprobs from the generation logits; a checkpoint
            # is built here with our limits, built engines keep theirs.
            limits = (
                {}
                if any(directory.glob("rank*.engine"))
                else {"max_batch_size": max_batch_size, "max_seq_len": self.max_seq_len}
            )
            self.llm = LLM(model=str(directory), gather_generation_logits=True, **limits, **common)
        else:
            self.model_config = served_model_config(config)
            self.llm = trtllm.LLM(
                model=str(directory),
                dtype=dtype,
                max_batch_size=max_batch_size,
                max_seq_len=self.max_seq_len,
                **self._refit_workers(trtllm, refit),
                **common,
            )

    @staticmethod
    def _refit_workers(trtllm: ModuleType, refit: bool) -> dict[str, Any]:
        """The LLM arguments that start weight-update workers (PyTorch backend)."""
        if not refit:
            return {}
        if importlib.util.find_spec("tensorrt_llm.llmapi.rlhf_utils") is None:
            raise EngineError(
                f"TensorRT-LLM {trtllm.__version__} cannot update weights in place "
                "(that needs >= 1.1: the Ray orchestrator and "
                "tensorrt_llm.llmapi.rlhf_utils); upgrade it or train with "
                "rollout.engine=vllm"
            )
        return {"orchestrator_type": "ray", "ray_worker_extension_cls": _RLHF_EXTENSION}

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[Generation]:
        """Continue every prompt in one TensorRT-LLM call, each with its own seed; results in prompt
        order."""
        if not prompts:
            return []
        self._check_refitted()
        check_prompts(prompts, self.max_seq_len, self.vocab_size)
        self._check_logprob_convention(params)
        shared = trtllm_sampling_kwargs(params, processed_logprobs=self._processed_logprobs)
        requests = [
            self._sampling_params(
                **{
                    **shared,
                    "seed": seed,
                    "max_tokens": min(params.max_new_tokens, self.max_seq_len - len(prompt)),
                }
            )
            for prompt, seed in zip(prompts, prompt_seeds(params, len(prompts), seeds))
        ]
        outputs = self.llm.generate(
            [list(prompt) for prompt in prompts], sampling_params=requests, use_tqdm=False
        )
        return [
            trtllm_generation(output.outputs[0], len(prompt), self._decode, params.stop_strings)
            for prompt, output in zip(prompts, outputs)
        ]

    def update_weights(self, weights: WeightUpdate) -> None:
        """Load HF-named tensors, whole or bucket by bucket, into the running model through
        CUDA IPC (checked first; see the module docstring); the seconds it took are in
        ``last_refit_seconds``."""
        if self.backend == TENSORRT:
            raise EngineError(self._built_engine_refit())
        if not self.refit:
            raise EngineError(
                "this trtllm engine was started without refit=True, so it has no "
                "weight-update workers; rebuild it with refit=True"
            )
        from tensorrt_llm._torch.utils import get_device_uuid
        from torch.multiprocessing.reductions import reduce_tensor

        def load(group: list[tuple[str, torch.Tensor]]) -> None:
            # One copy per engine GPU; the tensors must stay alive until the call returns.
            copies = {
                device: [(name, tensor.to(f"cuda:{device}")) for name, tensor in group]
                for device in range(self.tensor_parallel_size)
            }
            handles = {
                get_device_uuid(device): [(name, reduce_tensor(tensor)) for name, tensor in tensors]
                for device, tensors in copies.items()
            }
            self.llm._collective_rpc("update_weights", (handles,))

        started = time.perf_counter()
        loaded = self._load_weights(weights, load)
        self.llm._collective_rpc("update_weights", (None,))  # finalise: post-load processing
        if self.block_reuse:  # recent finalising steps reset it too: this does not rely on it
            self.llm._collective_rpc("reset_prefix_cache")
        torch.cuda.ipc_collect()
        self.last_refit_seconds = time.perf_counter() - started
        log.info("trtllm refit: %d tensors in %.2f s", loaded, self.last_refit_seconds)

    def _check_logprob_convention(self, params: SamplingParams) -> None:
        if params.temperature in (0, 1):
            return
        if not self._processed_logprobs:
            self._warn_once(
                "raw",
                "this TensorRT-LLM release reports logprobs before "
                "temperature (no SamplingParams.logprobs_mode); the reference "
                "engine's are after it",
            )
        elif params.top_k or params.top_p < 1:
            self._warn_once(
                "truncated",
                "TensorRT-LLM reports logprobs of the top-k/top-p "
                "truncated distribution; the reference engine's are before "
                "truncation",
            )

    @staticmethod
    def _built_engine_refit() -> str:
        return (
            "a built TensorRT engine cannot be refit in place: its weights are compiled in. "
            "Re-export the checkpoint (nemo-orch export --format trtllm), rebuild it with "
            "trtllm-build and load the new engine directory, or serve the policy from an HF "
            "directory (the PyTorch backend), which refits in place"
        )
