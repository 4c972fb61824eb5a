"""The GPU engines (TensorRT-LLM, vLLM): on CPU, everything around the libraries -- sampling
translations, result mapping, stop-string cuts, refit checks, configuration, and the error a
missing library or GPU gives; on a GPU (``-m gpu``), each engine against the CPU reference."""

from __future__ import annotations

import gc
import importlib.machinery
import importlib.util
import json
import re
import shutil
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from support.cli_helpers import run_cli

from nemo_orch import config as config_lib
from nemo_orch.config import ConfigError, ModelConfig
from nemo_orch.data.tasks import Task, write_tasks
from nemo_orch.models import trtllm as trtllm_checkpoint
from nemo_orch.models.hf_mapping import SeededHFWeights, save_hf_checkpoint
from nemo_orch.rollout import builders
from nemo_orch.rollout.engines import base as base_engine_module
from nemo_orch.rollout.engines import trtllm as trtllm_engine_module
from nemo_orch.rollout.engines import vllm as vllm_engine_module
from nemo_orch.rollout.engines.base import (
    Engine,
    EngineError,
    Generation,
    SamplingParams,
    Sleepable,
    check_prompts,
    checked_buckets,
    finish_reason,
    hf_shapes,
    prompt_seeds,
    sampled_logprobs,
    weight_buckets,
)
from nemo_orch.rollout.engines.hf import HFEngine, kv_bytes_per_token
from nemo_orch.rollout.engines.trtllm import (
    TRTLLMEngine,
    block_reuse,
    model_limits,
    stop_string_cut,
    trtllm_backend,
    trtllm_generation,
    trtllm_sampling_kwargs,
)
from nemo_orch.rollout.engines.vllm import VLLMEngine, vllm_generation, vllm_sampling_kwargs

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)
INSTALLED = {
    "trtllm": importlib.util.find_spec("tensorrt_llm") is not None,
    "vllm": importlib.util.find_spec("vllm") is not None,
}
EXTRA = {
    "trtllm": "needs TensorRT-LLM, which is not installed: pip install 'nemo-orch[gpu]'",
    "vllm": "needs vLLM, which is not installed: pip install 'nemo-orch[gpu]'",
}


@dataclass
class Logprob:
    """Shaped like ``vllm.logprobs.Logprob`` and ``tensorrt_llm``'s ``Logprob``."""

    logprob: float
    rank: int | None = None


@dataclass
class Completion:
    """Shaped like ``RequestOutput.outputs[0]`` of both libraries (``CompletionOutput``)."""

    token_ids: list[int]
    logprobs: list[Any]
    finish_reason: str | None
    stop_reason: int | str | None = None
    text: str = field(default="ignored: the engines decode with the policy's tokenizer")


CHARS = "<x/answer>"


def char_decode(tokens: list[int]) -> str:
    """A tokenizer whose token ``i`` is the character ``CHARS[i]``."""
    return "".join(CHARS[token] for token in tokens)


def char_tokens(text: str) -> list[int]:
    return [CHARS.index(char) for char in text]


# ----------------------------------------------------------------------------- sampling


def test_vllm_greedy_and_disabled_top_k_use_vllm_conventions():
    greedy = vllm_sampling_kwargs(
        SamplingParams(max_new_tokens=5, temperature=0, top_k=7, top_p=0.5, seed=3)
    )
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"]) == (0, -1, 1.0)
    sampled = vllm_sampling_kwargs(SamplingParams(temperature=0.7, top_p=0.9))
    assert (sampled["temperature"], sampled["top_k"], sampled["top_p"]) == (0.7, -1, 0.9)
    assert vllm_sampling_kwargs(SamplingParams(top_k=20))["top_k"] == 20


def test_vllm_kwargs_keep_stops_and_ask_for_the_sampled_logprob():
    kwargs = vllm_sampling_kwargs(
        SamplingParams(
            max_new_tokens=9, stop_token_ids=(4, 5), stop_strings=("</answer>",), seed=11
        )
    )
    assert kwargs["max_tokens"] == 9 and kwargs["seed"] == 11
    assert kwargs["stop"] == ["</answer>"] and kwargs["stop_token_ids"] == [4, 5]
    assert kwargs["include_stop_str_in_output"] and kwargs["ignore_eos"]
    assert kwargs["logprobs"] == 0 and kwargs["detokenize"]
    # Without stop strings there is nothing to detokenize for: the engine decodes the text.
    plain = vllm_sampling_kwargs(SamplingParams())
    assert plain["detokenize"] is False and plain["stop"] == [] and plain["seed"] is None


def test_trtllm_greedy_is_top_k_one_with_raw_logprobs():
    kwargs = trtllm_sampling_kwargs(SamplingParams(max_new_tokens=5, temperature=0, top_p=0.5))
    assert kwargs["top_k"] == 1
    assert "temperature" not in kwargs and "top_p" not in kwargs and "logprobs_mode" not in kwargs


def test_trtllm_asks_for_processed_logprobs_only_off_temperature_one():
    assert trtllm_sampling_kwargs(SamplingParams(temperature=0.7))["logprobs_mode"] == "processed"
    assert "logprobs_mode" not in trtllm_sampling_kwargs(SamplingParams(temperature=1.0))
    older = trtllm_sampling_kwargs(SamplingParams(temperature=0.7), processed_logprobs=False)
    assert "logprobs_mode" not in older
    kwargs = trtllm_sampling_kwargs(SamplingParams(temperature=0.7, top_p=0.9, top_k=0))
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (0.7, 0.9, 0)


def test_trtllm_kwargs_keep_stops_and_ask_for_the_sampled_logprob():
    kwargs = trtllm_sampling_kwargs(
        SamplingParams(max_new_tokens=9, stop_token_ids=(4,), stop_strings=("</answer>",), seed=11)
    )
    assert kwargs["max_tokens"] == 9 and kwargs["seed"] == 11
    assert kwargs["stop"] == ["</answer>"] and kwargs["stop_token_ids"] == [4]
    assert kwargs["include_stop_str_in_output"] and kwargs["ignore_eos"]
    assert kwargs["logprobs"] == 1 and kwargs["detokenize"] is False
    plain = trtllm_sampling_kwargs(SamplingParams())
    assert plain["stop"] is None and plain["stop_token_ids"] is None


def test_prompt_seeds_differ_per_prompt_or_are_the_callers():
    assert prompt_seeds(SamplingParams(seed=7), 3) == [7, 8, 9]
    drawn = prompt_seeds(SamplingParams(), 4)
    assert len(set(drawn)) == 4 and drawn == list(range(drawn[0], drawn[0] + 4))
    assert prompt_seeds(SamplingParams(seed=7), 2, [40, 3]) == [40, 3]
    with pytest.raises(EngineError, match="1 seeds for 2 prompts"):
        prompt_seeds(SamplingParams(), 2, [1])


# ----------------------------------------------------------------------------- results


def test_vllm_result_maps_to_a_generation():
    completion = Completion(
        [5, 6, 7],
        [{5: Logprob(-0.5, 1)}, {6: Logprob(-1.5, 2)}, {7: Logprob(-0.1, 1), 9: Logprob(-3.0, 2)}],
        "stop",
        7,
    )
    generation = vllm_generation(completion, prompt_tokens=4, decode=lambda t: f"text{t}")
    assert generation == Generation(
        [5, 6, 7], [-0.5, -1.5, -0.1], "stop", "text[5, 6, 7]", 4, {"stop": 7}
    )
    ended = vllm_generation(Completion([5], [{5: Logprob(-0.5)}], "length"), 2, char_decode)
    assert ended.finish_reason == "length" and ended.extra == {}


@pytest.mark.parametrize(
    "completion,message",
    [
        (Completion([5], [{5: Logprob(-1.0)}], "abort"), "finish reason 'abort'"),
        (Completion([5, 6], [{5: Logprob(-1.0)}], "length"), "1 logprobs for 2 tokens"),
        (Completion([5], None, "length"), "0 logprobs for 1 tokens"),
        (Completion([5], [{6: Logprob(-1.0)}], "length"), "no logprob for sampled token 5"),
    ],
)
def test_malformed_results_are_engine_errors(completion, message):
    with pytest.raises(EngineError, match=message):
        vllm_generation(completion, 1, char_decode)


def test_trtllm_result_takes_float_or_dict_logprobs():
    floats = trtllm_generation(Completion([1, 2], [-0.25, -0.5], "length"), 3, char_decode)
    assert (floats.token_ids, floats.logprobs, floats.text) == ([1, 2], [-0.25, -0.5], "x/")
    dicts = trtllm_generation(
        Completion([1, 2], [{1: Logprob(-0.25)}, {2: -0.5, 3: -0.9}], "stop", 2), 3, char_decode
    )
    assert dicts.logprobs == [-0.25, -0.5] and dicts.extra == {"stop": 2}
    assert finish_reason("length", "x") == "length"
    with pytest.raises(EngineError, match="cancelled"):
        trtllm_generation(Completion([1], [-0.1], "cancelled"), 1, char_decode)


def test_trtllm_result_is_cut_after_the_token_completing_a_stop_string():
    tokens = char_tokens("xx</answer>xxx")
    completion = Completion(tokens, [-float(i) for i in range(len(tokens))], "length")
    generation = trtllm_generation(completion, 5, char_decode, ("nope", "</answer>"))
    assert generation.text == "xx</answer>" and generation.token_ids == tokens[:11]
    assert generation.logprobs == [-float(i) for i in range(11)]
    assert (generation.finish_reason, generation.extra) == ("stop", {"stop": "</answer>"})


def test_a_stop_token_at_the_end_wins_over_a_stop_string_it_completes():
    tokens = char_tokens("xx</answer>")
    completion = Completion(tokens, [-1.0] * len(tokens), "stop", stop_reason=tokens[-1])
    generation = trtllm_generation(completion, 5, char_decode, ("</answer>",))
    assert generation.token_ids == tokens and generation.extra == {"stop": tokens[-1]}


def test_stop_string_cut_matches_the_reference_rule(tiny_tokenizer):
    tokens = tiny_tokenizer.encode(
        "Paris is the capital.</answer> and then more text", add_special_tokens=False
    )

    def decode(ids: list[int]) -> str:
        return tiny_tokenizer.decode(ids, skip_special_tokens=True)

    # The reference engine stops after the first token whose decoded continuation has the stop.
    expected = next(n for n in range(1, len(tokens) + 1) if "</answer>" in decode(tokens[:n]))
    assert stop_string_cut(tokens, ["</answer>"], decode) == (expected, "</answer>")
    assert stop_string_cut(tokens, ["</tool_call>"], decode) is None
    assert (
        stop_string_cut(tokens, [], decode) is None and stop_string_cut([], ["x"], decode) is None
    )


def test_sampled_logprobs_reads_plain_floats():
    assert sampled_logprobs([3, 4], [-1, -2.5], "lib") == [-1.0, -2.5]


# ----------------------------------------------------------------------------- directories


def test_trtllm_backend_and_limits_follow_the_directory(random_policy_dir, tmp_path):
    assert trtllm_backend(random_policy_dir) == "pytorch"
    hf_config = json.loads((random_policy_dir / "config.json").read_text())
    assert model_limits(hf_config) == (1024, 1024)

    model = ModelConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        vocab_size=512,
        max_position_embeddings=256,
    )
    checkpoint = trtllm_checkpoint.save_trtllm_checkpoint(
        tmp_path / "checkpoint", SeededHFWeights(model, seed=0), model, tp=1, dtype="float32"
    )
    assert trtllm_backend(checkpoint) == "tensorrt"
    assert model_limits(json.loads((checkpoint / "config.json").read_text())) == (256, 512)

    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    (engine_dir / "rank0.engine").write_bytes(b"")
    engine_config = {
        "pretrained_config": {"vocab_size": 512, "max_position_embeddings": 256},
        "build_config": {"max_seq_len": 128, "max_batch_size": 8},
    }
    assert trtllm_backend(engine_dir) == "tensorrt"
    assert model_limits(engine_config) == (128, 512)
    with pytest.raises(EngineError, match="no 'vocab_size'"):
        model_limits({"max_position_embeddings": 10})


# ----------------------------------------------------------------------------- refit checks


def small_model() -> ModelConfig:
    return ModelConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        vocab_size=256,
        max_position_embeddings=64,
    )


def test_refit_state_must_cover_the_model_with_its_shapes():
    model = small_model()
    state = dict(SeededHFWeights(model, seed=0))
    shapes = hf_shapes(model)
    assert list(checked_buckets(state, shapes)) == [state]
    for bad, message in (
        (
            {k: v for k, v in state.items() if k != "lm_head.weight"},
            "missing \\['lm_head.weight'\\]",
        ),
        ({**state, "extra": torch.zeros(1)}, "unexpected \\['extra'\\]"),
        ({**state, "model.norm.weight": torch.ones(3)}, "model.norm.weight: shape \\(3,\\)"),
    ):
        with pytest.raises(EngineError, match=message):  # before any bucket is handed out
            next(checked_buckets(bad, shapes))


def test_a_refit_stream_is_checked_bucket_by_bucket():
    model = small_model()
    state = dict(SeededHFWeights(model, seed=0))
    shapes = hf_shapes(model)
    names = list(state)
    buckets = [{name: state[name]} for name in names]
    assert list(checked_buckets(iter(buckets), shapes)) == buckets
    for bad, message, good_before in (
        ([*buckets[:2], buckets[1]], "bucket 2.*sent before \\['" + names[1], 2),
        ([buckets[0], {"extra": torch.zeros(1)}], "bucket 1.*unexpected \\['extra'\\]", 1),
        ([buckets[0], {"model.norm.weight": torch.ones(3)}], "shape \\(3,\\)", 1),
        (
            buckets[:-1],
            f"without 1 of the model's tensors: missing \\['{names[-1]}'\\]",
            len(buckets) - 1,
        ),
    ):
        stream = checked_buckets(iter(bad), shapes)
        assert [next(stream) for _ in range(good_before)] == bad[:good_before]
        with pytest.raises(EngineError, match=message):
            next(stream)


def test_weight_buckets_bound_the_bytes_in_flight():
    state = {"a": torch.ones(4), "b": torch.ones(4), "c": torch.ones(16), "d": torch.ones(2)}
    buckets = list(weight_buckets(state, torch.bfloat16, max_bytes=16))
    assert [[name for name, _ in bucket] for bucket in buckets] == [["a", "b"], ["c"], ["d"]]
    assert all(t.dtype == torch.bfloat16 for bucket in buckets for _, t in bucket)


def test_prompts_are_checked_like_the_reference_engine():
    check_prompts([[1, 2], [3]], max_seq_len=4, vocab_size=10)
    for prompts, message in (([[]], "empty"), ([[1] * 4], "at most 3"), ([[10]], "outside")):
        with pytest.raises(EngineError, match=message):
            check_prompts(prompts, max_seq_len=4, vocab_size=10)


# ----------------------------------------------------------------------------- protocols, config


def test_only_vllm_can_sleep():
    assert issubclass(VLLMEngine, Sleepable) and issubclass(VLLMEngine, Engine)
    assert issubclass(TRTLLMEngine, Engine) and not issubclass(TRTLLMEngine, Sleepable)
    assert not issubclass(HFEngine, Sleepable)


@pytest.mark.parametrize("engine", ["trtllm", "vllm"])
def test_gpu_rollout_groups_compose(engine):
    rollout = config_lib.load([f"rollout={engine}"]).rollout
    assert rollout.engine == engine and rollout.colocate and rollout.engine_tp == 1
    assert (rollout.engine_dtype, rollout.gpu_memory_utilization) == ("bfloat16", 0.5)
    # The group changes the engine and nothing else.
    assert rollout == config_lib.load([f"rollout.engine={engine}"]).rollout


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.colocate=false"], "rollout.colocate=false only applies to the GPU engines"),
        (["rollout=vllm", "rollout.engine_tp=0"], "rollout.engine_tp must be >= 1"),
        (["rollout=vllm", "rollout.engine_dtype=fp8"], "rollout.engine_dtype must be"),
        (["rollout=vllm", "rollout.gpu_memory_utilization=0"], "gpu_memory_utilization"),
        (["rollout=trtllm", "rollout.gpu_memory_utilization=1.5"], "gpu_memory_utilization"),
        (["rollout=vllm", "rollout.sleep_level=3"], "rollout.sleep_level must be 1 or 2"),
        (["rollout.prefix_cache_mb=0"], "rollout.prefix_cache_mb must be >= 1"),
    ],
)
def test_engine_options_are_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_lib.load(overrides)


def test_a_gpu_engine_may_keep_its_own_memory():
    assert config_lib.load(["rollout=vllm", "rollout.colocate=false"]).rollout.colocate is False


# ----------------------------------------------------------------------------- missing pieces


@pytest.mark.parametrize("engine", ["trtllm", "vllm"])
def test_a_missing_library_is_one_clear_error(engine, random_policy_dir, tiny_tokenizer):
    if INSTALLED[engine]:
        pytest.skip(f"{engine} is installed here")
    config = config_lib.load([f"rollout={engine}", f"rollout.policy={random_policy_dir}"])
    with pytest.raises(EngineError, match=re.escape(EXTRA[engine])):
        builders.build_engine(config)
    with pytest.raises(EngineError, match="pip install 'nemo-orch\\[gpu\\]'"):
        builders.build_rollout_engine(config, {}, tiny_tokenizer)
    engine_class = TRTLLMEngine if engine == "trtllm" else VLLMEngine
    with pytest.raises(EngineError, match="nemo-orch\\[gpu\\]"):
        engine_class(random_policy_dir, tiny_tokenizer)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible")
@pytest.mark.parametrize("engine,module", [("trtllm", "tensorrt_llm"), ("vllm", "vllm")])
def test_a_gpu_engine_without_cuda_says_so(engine, module, random_policy_dir, monkeypatch):
    # The library is "installed" (an empty module): the next thing missing is the GPU.
    stand_in = types.ModuleType(module)
    stand_in.__spec__ = importlib.machinery.ModuleSpec(module, None)
    monkeypatch.setitem(sys.modules, module, stand_in)
    config = config_lib.load([f"rollout={engine}", f"rollout.policy={random_policy_dir}"])
    with pytest.raises(EngineError, match=f"rollout.engine={engine} needs a CUDA GPU"):
        builders.build_engine(config)


@pytest.mark.parametrize("engine", ["trtllm", "vllm"])
def test_the_cli_reports_a_missing_library_as_a_user_error(engine, random_policy_dir, tmp_path):
    if INSTALLED[engine]:
        pytest.skip(f"{engine} is installed here")
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(tasks, [Task("q1", "What is 2 + 3?", answer="5")])
    result = run_cli(
        "rollout",
        "--tasks",
        str(tasks),
        "--out",
        str(tmp_path / "out.jsonl"),
        f"rollout.policy={random_policy_dir}",
        f"rollout.engine={engine}",
        expect=2,
    )
    assert f"nemo-orch rollout: error: rollout.engine={engine} {EXTRA[engine]}" in result.stderr
    assert "Traceback" not in result.stderr


def test_grpo_builds_the_cpu_engine_from_the_policy_weights(tiny_tokenizer):
    config = config_lib.Config()
    weights = dict(SeededHFWeights(config.model, seed=4))
    engine = builders.build_rollout_engine(config, weights, tiny_tokenizer)
    assert isinstance(engine, HFEngine) and not isinstance(engine, Sleepable)
    assert torch.equal(engine.model.model.norm.weight, weights["model.norm.weight"])
    served = config_lib.replace(
        config,
        rollout=config_lib.load(
            [
                "rollout.engine=openai",
                "rollout.base_url=http://127.0.0.1:1/v1",
                "rollout.model_name=m",
            ]
        ).rollout,
    )
    with pytest.raises(ConfigError, match="a served model cannot be refit"):
        builders.build_rollout_engine(served, weights, tiny_tokenizer)


# ----------------------------------------------------------------------------- prefix caching


@pytest.mark.parametrize(
    "overrides,capacity_mb",
    [([], 512), (["rollout.prefix_cache_mb=8"], 8), (["rollout.prefix_caching=false"], None)],
)
def test_the_cpu_engine_caches_prefixes_as_configured(overrides, capacity_mb, tiny_tokenizer):
    config = config_lib.load(overrides)
    engine = builders.build_rollout_engine(
        config, dict(SeededHFWeights(config.model, seed=4)), tiny_tokenizer
    )
    if capacity_mb is None:
        assert engine.prefix_cache is None
    else:
        capacity = (capacity_mb << 20) // kv_bytes_per_token(config.model)
        assert engine.prefix_cache.capacity_blocks == capacity // engine.prefix_cache.block_size


def stand_in(monkeypatch, name: str, **attributes: Any) -> types.ModuleType:
    """An "installed" module ``name`` holding ``attributes``."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    return module


@dataclass
class _VLLMEngineArgs:
    logprobs_mode: str = "processed_logprobs"


@dataclass
class _TRTLLMSamplingParams:
    logprobs_mode: str = "processed"


@pytest.fixture
def no_cuda_check(monkeypatch):
    """The GPU engines built against stand-in libraries on this CPU."""
    for module in (base_engine_module, trtllm_engine_module, vllm_engine_module):
        monkeypatch.setattr(module, "require_cuda", lambda engine: None)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_vllm_is_asked_for_prefix_caching_as_configured(
    prefix_caching, random_policy_dir, no_cuda_check, monkeypatch
):
    built: list[dict[str, Any]] = []
    stand_in(
        monkeypatch,
        "vllm",
        EngineArgs=_VLLMEngineArgs,
        SamplingParams=dict,
        LLM=lambda **kwargs: built.append(kwargs),
    )
    config = config_lib.load(
        [
            "rollout=vllm",
            f"rollout.policy={random_policy_dir}",
            f"rollout.prefix_caching={str(prefix_caching).lower()}",
        ]
    )
    builders.build_engine(config)
    assert built[0]["enable_prefix_caching"] is prefix_caching


@pytest.mark.parametrize(
    "prefix_caching,refit,resettable,reuse",
    [
        (True, False, False, True),  # nothing to refit: nothing goes stale
        (True, True, True, True),  # every refit resets the reused blocks
        (True, True, False, False),  # blocks of the old weights would be reused
        (False, False, True, False),
    ],
)
def test_trtllm_reuses_kv_blocks_only_where_a_refit_can_drop_them(
    prefix_caching, refit, resettable, reuse
):
    reused, why_not = block_reuse(prefix_caching, refit, resettable)
    assert reused is reuse and (why_not is None) is reuse


@pytest.mark.parametrize("resettable", [True, False])
def test_a_refittable_trtllm_engine_reuses_blocks_when_its_extension_resets_them(
    resettable, tiny_tokenizer, no_cuda_check, monkeypatch, caplog
):
    kv_configs: list[dict[str, Any]] = []
    extension = type("WorkerExtension", (), {"reset_prefix_cache": lambda self: None})
    if not resettable:
        extension = type("WorkerExtension", (), {})
    stand_in(
        monkeypatch,
        "tensorrt_llm",
        SamplingParams=_TRTLLMSamplingParams,
        LLM=lambda **kwargs: None,
        __version__="1.1",
    )
    stand_in(monkeypatch, "tensorrt_llm.llmapi", KvCacheConfig=lambda **kw: kv_configs.append(kw))
    stand_in(monkeypatch, "tensorrt_llm.llmapi.rlhf_utils", WorkerExtension=extension)
    config = config_lib.load(["rollout=trtllm"])
    caplog.set_level("INFO", logger=trtllm_engine_module.__name__)
    engine = builders.build_rollout_engine(
        config, dict(SeededHFWeights(config.model, seed=0)), tiny_tokenizer
    )
    assert engine.refit and engine.block_reuse is resettable
    assert kv_configs[0]["enable_block_reuse"] is resettable
    assert ("no reset_prefix_cache" in caplog.text) is not resettable


# ----------------------------------------------------------------------------- on a GPU

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_model() -> ModelConfig:
    # Head size 64 (the attention kernels' smallest common size) and a larger init std than the
    # default, so the logits are peaked and greedy picks have few near-ties.
    return ModelConfig(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=64,
        ffn_hidden_size=256,
        vocab_size=1024,
        max_position_embeddings=512,
        init_method_std=0.1,
    )


@pytest.fixture(scope="module")
def gpu_policy_dir(tiny_tokenizer_dir, tmp_path_factory) -> Path:
    """A random tiny Qwen3 in HF format with the test tokenizer (``random_policy_dir`` with
    kernel-friendly head sizes)."""
    directory = save_hf_checkpoint(
        tmp_path_factory.mktemp("gpu-policy"), SeededHFWeights(gpu_model(), seed=0), gpu_model()
    )
    for file in tiny_tokenizer_dir.iterdir():
        shutil.copy(file, directory / file.name)
    return directory


@pytest.fixture(scope="module")
def gpu_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(9, 1000, (n,), generator=generator).tolist() for n in (3, 11, 6)]


def reference(weights: Any, tokenizer: Any) -> HFEngine:
    return HFEngine(gpu_model(), weights, tokenizer=tokenizer)


def assert_agrees(
    reference_engine: HFEngine,
    prompts: list[list[int]],
    generations: list[Generation],
    temperature: float,
    tol: float = 0.1,
) -> None:
    """Each generation is what the reference engine would have produced, up to bf16: its
    logprobs are the reference's for the same tokens (teacher-forced, under the reference
    convention) and, greedy, each token is the reference's argmax up to a near-tie."""
    for prompt, generation in zip(prompts, generations):
        assert generation.token_ids and generation.prompt_tokens == len(prompt)
        with torch.no_grad():
            logits = (
                reference_engine.model(input_ids=torch.tensor([prompt + generation.token_ids]))
                .logits[0]
                .float()
            )
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1] / (temperature or 1.0), -1)
        chosen = logprobs.gather(-1, torch.tensor(generation.token_ids)[:, None])[:, 0]
        assert generation.logprobs == pytest.approx(chosen.tolist(), abs=tol)
        if temperature == 0:
            assert bool((chosen >= logprobs.max(-1).values - tol).all())


def release(engine: Any) -> None:
    shutdown = getattr(engine.llm, "shutdown", None)
    if shutdown is not None:
        shutdown()
    del engine.llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def vllm_engine(gpu_policy_dir, tiny_tokenizer):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    engine = VLLMEngine(
        gpu_policy_dir, tiny_tokenizer, gpu_memory_utilization=0.3, max_batch_size=16
    )
    yield engine
    release(engine)


@gpu
@needs_cuda
def test_vllm_greedy_matches_the_reference(vllm_engine, gpu_prompts, tiny_tokenizer):
    generations = vllm_engine.generate(gpu_prompts, GREEDY)
    weights = SeededHFWeights(gpu_model(), seed=0)
    assert_agrees(reference(weights, tiny_tokenizer), gpu_prompts, generations, 0)
    assert all(g.finish_reason == "length" and len(g.token_ids) == 12 for g in generations)
    assert generations[0].text == tiny_tokenizer.decode(
        generations[0].token_ids, skip_special_tokens=True
    )


@gpu
@needs_cuda
def test_vllm_samples_with_the_reference_logprobs(vllm_engine, gpu_prompts, tiny_tokenizer):
    params = SamplingParams(max_new_tokens=10, temperature=0.7, seed=3)
    generations = vllm_engine.generate(gpu_prompts, params)
    weights = SeededHFWeights(gpu_model(), seed=0)
    assert_agrees(reference(weights, tiny_tokenizer), gpu_prompts, generations, 0.7)
    group = vllm_engine.generate([gpu_prompts[0]] * 4, SamplingParams(temperature=1.0, seed=5))
    assert len({tuple(g.token_ids) for g in group}) > 1  # a GRPO group is not one sample


@gpu
@needs_cuda
def test_vllm_refit_serves_the_new_weights(vllm_engine, gpu_prompts, tiny_tokenizer):
    before = vllm_engine.generate(gpu_prompts, GREEDY)
    new = dict(SeededHFWeights(gpu_model(), seed=1))
    vllm_engine.update_weights(new)
    try:
        after = vllm_engine.generate(gpu_prompts, GREEDY)
        assert [g.token_ids for g in after] != [g.token_ids for g in before]
        assert_agrees(reference(new, tiny_tokenizer), gpu_prompts, after, 0)
        assert vllm_engine.last_refit_seconds > 0
    finally:
        vllm_engine.update_weights(dict(SeededHFWeights(gpu_model(), seed=0)))
    assert [g.token_ids for g in vllm_engine.generate(gpu_prompts, GREEDY)] == [
        g.token_ids for g in before
    ]


def long_prompt(gpu_prompts: list[list[int]]) -> list[int]:
    """80 tokens: whole 16-token KV blocks to reuse."""
    return [token for prompt in gpu_prompts for token in prompt] * 4


@gpu
@needs_cuda
def test_vllm_reuses_a_prefix_until_a_refit(vllm_engine, gpu_prompts, tiny_tokenizer):
    prompt = long_prompt(gpu_prompts)

    def greedy() -> tuple[Generation, int]:
        """The prompt continued, and how many of its tokens vLLM read from its prefix cache."""
        params = vllm_engine._sampling_params(**{**vllm_sampling_kwargs(GREEDY), "seed": 0})
        output = vllm_engine.llm.generate(
            [{"prompt_token_ids": prompt}], sampling_params=[params], use_tqdm=False
        )[0]
        generation = vllm_generation(output.outputs[0], len(prompt), vllm_engine._decode)
        return generation, output.num_cached_tokens or 0

    greedy()
    assert greedy()[1] >= 64
    new = dict(SeededHFWeights(gpu_model(), seed=1))
    vllm_engine.update_weights(new)
    try:
        after, cached = greedy()
        assert cached == 0  # computed again, with the new weights
        assert_agrees(reference(new, tiny_tokenizer), [prompt], [after], 0)
    finally:
        vllm_engine.update_weights(dict(SeededHFWeights(gpu_model(), seed=0)))


@gpu
@needs_cuda
def test_vllm_sleeps_and_wakes(vllm_engine, gpu_prompts):
    before = vllm_engine.generate(gpu_prompts, GREEDY)
    vllm_engine.sleep()
    with pytest.raises(EngineError, match="asleep"):
        vllm_engine.generate(gpu_prompts, GREEDY)
    vllm_engine.wake_up()
    assert [g.token_ids for g in vllm_engine.generate(gpu_prompts, GREEDY)] == [
        g.token_ids for g in before
    ]
    # Level 2 drops the weights: only a refit makes the engine usable again.
    vllm_engine.sleep_level = 2
    try:
        vllm_engine.sleep()
        vllm_engine.wake_up()
        with pytest.raises(EngineError, match="update_weights before generating"):
            vllm_engine.generate(gpu_prompts, GREEDY)
        vllm_engine.update_weights(dict(SeededHFWeights(gpu_model(), seed=0)))
    finally:
        vllm_engine.sleep_level = 1
    assert [g.token_ids for g in vllm_engine.generate(gpu_prompts, GREEDY)] == [
        g.token_ids for g in before
    ]


@pytest.fixture(scope="module")
def trtllm_engine(gpu_policy_dir, tiny_tokenizer):
    pytest.importorskip("tensorrt_llm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    refit = importlib.util.find_spec("tensorrt_llm.llmapi.rlhf_utils") is not None
    engine = TRTLLMEngine(
        gpu_policy_dir, tiny_tokenizer, free_gpu_memory_fraction=0.2, max_batch_size=16, refit=refit
    )
    yield engine
    release(engine)


@gpu
@needs_cuda
def test_trtllm_greedy_matches_the_reference(trtllm_engine, gpu_prompts, tiny_tokenizer):
    generations = trtllm_engine.generate(gpu_prompts, GREEDY)
    weights = SeededHFWeights(gpu_model(), seed=0)
    assert_agrees(reference(weights, tiny_tokenizer), gpu_prompts, generations, 0)
    assert all(g.finish_reason == "length" and len(g.token_ids) == 12 for g in generations)


@gpu
@needs_cuda
def test_trtllm_samples_with_the_reference_logprobs(trtllm_engine, gpu_prompts, tiny_tokenizer):
    group = trtllm_engine.generate([gpu_prompts[0]] * 4, SamplingParams(temperature=1.0, seed=5))
    assert len({tuple(g.token_ids) for g in group}) > 1  # per-prompt seeds
    weights = SeededHFWeights(gpu_model(), seed=0)
    assert_agrees(reference(weights, tiny_tokenizer), [gpu_prompts[0]] * 4, group, 1.0)
    if not trtllm_engine._processed_logprobs:
        pytest.skip("this TensorRT-LLM reports logprobs before temperature")
    params = SamplingParams(max_new_tokens=10, temperature=0.7, seed=3)
    assert_agrees(
        reference(weights, tiny_tokenizer),
        gpu_prompts,
        trtllm_engine.generate(gpu_prompts, params),
        0.7,
    )


@gpu
@needs_cuda
def test_trtllm_stop_strings_cut_like_the_reference(trtllm_engine, gpu_prompts):
    free = trtllm_engine.generate([gpu_prompts[2]], GREEDY)[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    stopped = trtllm_engine.generate(
        [gpu_prompts[2]], SamplingParams(max_new_tokens=12, temperature=0, stop_strings=(stop,))
    )[0]
    assert stopped.finish_reason == "stop" and stopped.extra == {"stop": stop}
    assert stop in stopped.text and stopped.token_ids == free.token_ids[: len(stopped.token_ids)]


@gpu
@needs_cuda
def test_trtllm_reused_blocks_do_not_outlive_a_refit(trtllm_engine, gpu_prompts, tiny_tokenizer):
    if not trtllm_engine.block_reuse:
        pytest.skip("this TensorRT-LLM cannot reset its prefix cache on a refit: no block reuse")
    prompt = long_prompt(gpu_prompts)
    weights = SeededHFWeights(gpu_model(), seed=0)
    first = trtllm_engine.generate([prompt], GREEDY)
    again = trtllm_engine.generate([prompt, prompt], GREEDY)  # from the reused blocks
    assert [g.token_ids for g in again] == [first[0].token_ids] * 2
    assert_agrees(reference(weights, tiny_tokenizer), [prompt] * 2, again, 0)
    if not trtllm_engine.refit:
        return
    new = dict(SeededHFWeights(gpu_model(), seed=1))
    trtllm_engine.update_weights(new)
    try:
        after = trtllm_engine.generate([prompt], GREEDY)
        assert_agrees(reference(new, tiny_tokenizer), [prompt], after, 0)  # no stale block
    finally:
        trtllm_engine.update_weights(dict(SeededHFWeights(gpu_model(), seed=0)))


@gpu
@needs_cuda
def test_trtllm_refit_serves_the_new_weights(trtllm_engine, gpu_prompts, tiny_tokenizer):
    if not trtllm_engine.refit:
        pytest.skip("this TensorRT-LLM has no in-place weight update (needs >= 1.1)")
    new = dict(SeededHFWeights(gpu_model(), seed=1))
    trtllm_engine.update_weights(new)
    try:
        after = trtllm_engine.generate(gpu_prompts, GREEDY)
        assert_agrees(reference(new, tiny_tokenizer), gpu_prompts, after, 0)
        assert trtllm_engine.last_refit_seconds > 0
    finally:
        trtllm_engine.update_weights(dict(SeededHFWeights(gpu_model(), seed=0)))
