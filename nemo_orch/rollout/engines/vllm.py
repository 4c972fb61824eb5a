"""vLLM's offline ``LLM`` behind the :class:`~nemo_orch.rollout.engines.base.Engine` seam.

Built from an HF Qwen3 directory (with its tokenizer, which vLLM detokenizes stop strings with).
Prompts go in as token ids and the sampled tokens come back with their logprobs, under the
CPU reference engine's rules (:mod:`.hf`): stop tokens and stop strings are kept, EOS does not
end a sequence unless it is a stop token, and each prompt gets its own seed.

Logprobs: the engine runs with ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2), i.e.
``log_softmax`` of the logits after temperature and top-k/top-p. That is the reference
convention (``log_softmax(logits / temperature)``, or of the raw logits when greedy) whenever
top-k and top-p are off -- the GRPO setting. With them on, vLLM renormalises over the kept
tokens, so each logprob is higher than the reference by the log of the kept mass; a warning says
so once.

Refit: HF-named tensors go to every worker through ``collective_rpc`` and the model's own
``load_weights`` (which shards them for tensor parallelism), in buckets of at most 512 MiB; the
prefix cache (vLLM's automatic prefix caching, on with ``rollout.prefix_caching``: an episode's
turns and a group's shared prompt reuse their KV blocks) is reset afterwards so no KV block
computed with the old weights is reused. The
engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while it starts): the
engine-core client's msgpack transport would deliver the tensors as ``[dtype, shape, bytes]``
lists, while the in-process path hands them to the executor as they are (tensor-parallel workers
receive them pickled). Colocated with the trainer, that is also where the GPU is.

Colocation: ``sleep()`` (vLLM's sleep mode) releases the KV cache and offloads the weights to
the CPU (level 1) or drops them (level 2, after which only a refit makes the engine usable).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from nemo_orch.models.hf_mapping import load_hf_checkpoint_config
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

LIBRARY = "vLLM"
_EXTENSION = "nemo_orch.rollout.engines.vllm.VLLMWorkerExtension"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def import_vllm() -> ModuleType:
    """The ``vllm`` package, or the one error that says what to install."""
    if importlib.util.find_spec("vllm") is None:
        raise EngineError(
            "rollout.engine=vllm needs vLLM, which is not installed: pip install "
            "'nemo-orch[gpu]' (or pip install 'vllm>=0.10.2')"
        )
    try:
        import vllm
    except Exception as error:  # a broken install fails in many ways (CUDA libraries, ABI)
        raise EngineError(f"vLLM is installed but does not import: {error}") from error
    return vllm


def vllm_sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """``vllm.SamplingParams`` fields for ``params`` (the seed and ``max_tokens`` are set per
    prompt by the engine). ``top_k=0`` (off) is vLLM's -1; temperature 0 is vLLM's greedy;
    ``logprobs=0`` returns the sampled token's logprob only; detokenizing is needed only to
    match stop strings (the engine decodes the text itself)."""
    greedy = params.temperature == 0
    return {
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": 1.0 if greedy else params.top_p,
        "top_k": -1 if greedy or params.top_k == 0 else params.top_k,
        "seed": params.seed,
        "stop": list(params.stop_strings),
        "stop_token_ids": list(params.stop_token_ids),
        "include_stop_str_in_output": True,
        "ignore_eos": True,
        "logprobs": 0,
        "detokenize": bool(params.stop_strings),
        "skip_special_tokens": True,
    }


def vllm_generation(
    completion: Any, prompt_tokens: int, decode: Callable[[list[int]], str]
) -> Generation:
    """A ``vllm.CompletionOutput`` (``token_ids``, ``logprobs`` as ``{token: Logprob}`` per
    position, ``finish_reason``, ``stop_reason``) as a :class:`Generation`."""
    token_ids = [int(token) for token in completion.token_ids]
    logprobs = sampled_logprobs(token_ids, completion.logprobs, LIBRARY)
    reason = finish_reason(completion.finish_reason, LIBRARY)
    stop = completion.stop_reason if reason == "stop" else None
    return Generation(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=reason,
        text=decode(token_ids),
        prompt_tokens=prompt_tokens,
        extra={} if stop is None else {"stop": stop},
    )


@contextlib.contextmanager
def _engine_core_in_process() -> Iterator[None]:
    """Start vLLM's engine core in this process (see the module docstring), leaving the
    environment as it was for anything else that starts vLLM."""
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


class VLLMWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); ``collective_rpc`` calls it."""

    def nemo_orch_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Load full HF-named tensors into this worker's model; vLLM's per-parameter loaders
        take this rank's tensor-parallel slice and fuse q/k/v and gate/up."""
        self.model_runner.get_model().load_weights(weights=weights)
        return len(weights)


class VLLMEngine(LibraryEngineMixin):
    """Batched generation with vLLM on the GPU, refit in place from HF-named weights.

    ``directory``: an HF Qwen3 directory with its tokenizer; ``tokenizer`` (the same) decodes
    ``Generation.text``. ``sleep_mode`` enables :meth:`sleep` / :meth:`wake_up` (colocation);
    ``sleep_level`` is what :meth:`sleep` does (see the module docstring). ``max_model_len``
    null: the model's ``max_position_embeddings``. ``prefix_caching``: vLLM's automatic prefix
    caching, passed explicitly rather than left to the release's default.
    """

    def __init__(
        self,
        directory: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        sleep_mode: bool = True,
        sleep_level: int = 1,
        prefix_caching: bool = True,
    ) -> None:
        vllm = import_vllm()
        require_cuda("vllm")
        if "logprobs_mode" not in {f.name for f in dataclasses.fields(vllm.EngineArgs)}:
            raise EngineError(
                f"vLLM {vllm.__version__} cannot report logprobs after "
                "temperature (logprobs_mode); the vllm engine needs vLLM >= 0.10.2"
            )
        if dtype not in ENGINE_DTYPES:
            raise EngineError(f"dtype must be one of {'|'.join(ENGINE_DTYPES)}, got {dtype!r}")
        if sleep_level not in (1, 2):
            raise EngineError(f"sleep_level must be 1 or 2, got {sleep_level}")
        directory = Path(directory)
        if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
            raise EngineError(
                f"{directory}: no tokenizer; vLLM matches stop strings with the "
                "tokenizer of the model directory"
            )
        self.model_config = served_model_config(load_hf_checkpoint_config(directory))
        self.tokenizer = tokenizer
        self.dtype = ENGINE_DTYPES[dtype]
        self.max_seq_len = max_model_len or self.model_config.max_position_embeddings
        self.sleep_mode, self.sleep_level = sleep_mode, sleep_level
        self.asleep = False
        self.weights_discarded = False
        self.last_refit_seconds: float | None = None
        self._warned: set[str] = set()
        self._sampling_params = vllm.SamplingParams
        with _engine_core_in_process():
            self.llm = vllm.LLM(
                model=str(directory),
                tokenizer=str(directory),
                dtype=dtype,
                tensor_parallel_size=tensor_parallel_size,
                seed=seed,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_sleep_mode=sleep_mode,
                max_model_len=self.max_seq_len,
                max_num_seqs=max_batch_size,
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=prefix_caching,
                worker_extension_cls=_EXTENSION,
            )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[Generation]:
        """Continue every prompt in one vLLM call, each with its own seed; results in prompt
        order."""
        if not prompts:
            return []
        self._check_usable()
        check_prompts(prompts, self.max_seq_len, self.model_config.vocab_size)
        if params.temperature > 0 and (params.top_k or params.top_p < 1):
            self._warn_once(
                "truncated",
                "vLLM reports logprobs of the top-k/top-p truncated "
                "distribution; the reference engine's are before truncation",
            )
        shared = vllm_sampling_kwargs(params)
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
            [{"prompt_token_ids": list(prompt)} for prompt in prompts],
            sampling_params=requests,
            use_tqdm=False,
        )
        return [
            vllm_generation(output.outputs[0], len(prompt), self._decode)
            for prompt, output in zip(prompts, outputs)
        ]

    def update_weights(self, weights: WeightUpdate) -> None:
        """Load HF-named tensors, whole or bucket by bucket, into the running model (checked
        first; see the module docstring); the seconds it took are in ``last_refit_seconds``."""
        if self.asleep:
            raise EngineError(
                "the vllm engine is asleep: wake_up() before update_weights, its "
                "weights are not on the GPU"
            )
        started = time.perf_counter()
        loaded = self._load_weights(
            weights, lambda group: self.llm.collective_rpc("nemo_orch_load_weights", args=(group,))
        )
        self.llm.reset_prefix_cache()
        self.weights_discarded = False
        self.last_refit_seconds = time.perf_counter() - started
        log.info("vllm refit: %d tensors in %.2f s", loaded, self.last_refit_seconds)

    def sleep(self) -> None:
        """Release the GPU memory for training (see ``sleep_level``); no-op when asleep."""
        if not self.sleep_mode:
            raise EngineError(
                "this vllm engine was built without sleep mode "
                "(rollout.colocate=false), so it cannot sleep"
            )
        if self.asleep:
            return
        started = time.perf_counter()
        self.llm.sleep(level=self.sleep_level)
        self.asleep = True
        self.weights_discarded = self.weights_discarded or self.sleep_level == 2
        log.info("vllm sleep (level %d) in %.2f s", self.sleep_level, time.perf_counter() - started)

    def wake_up(self) -> None:
        """Take the GPU memory back; no-op when awake."""
        if not self.asleep:
            return
        started = time.perf_counter()
        self.llm.wake_up()
        self.asleep = False
        log.info("vllm wake-up in %.2f s", time.perf_counter() - started)

    def _check_usable(self) -> None:
        self._check_refitted()
        if self.asleep:
            raise EngineError("the vllm engine is asleep: wake_up() before generating")
        if self.weights_discarded:
            raise EngineError(
                "sleep at level 2 dropped the vllm engine's weights: "
                "update_weights before generating"
            )
