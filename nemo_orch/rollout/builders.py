"""Builders from the validated config to the rollout's parts: tools, engine and settings.

Recipes (``nemo-orch rollout``, GRPO, evaluation) call these instead of reading config fields
themselves, so every entry point builds the same parts the same way.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nemo_orch.config import (
    Config,
    ConfigError,
    RetrievalConfig,
    RolloutConfig,
    ToolsConfig,
    resolve_conf_path,
)
from nemo_orch.tools.base import BuildSettings
from nemo_orch.tools.domain import build_domains, domain_tools
from nemo_orch.tools.registry import Toolbox, load_declarations, offered_and_parts

if TYPE_CHECKING:  # torch and transformers load only for commands that generate or score
    import torch
    from transformers import PreTrainedTokenizerBase

    from nemo_orch.rollout.engines.base import Engine
    from nemo_orch.rollout.engines.trtllm import TRTLLMEngine
    from nemo_orch.rollout.engines.vllm import VLLMEngine
    from nemo_orch.tools.base import ToolSpec

GPU_ENGINES = ("trtllm", "vllm")


def build_toolbox(tools: ToolsConfig, retrieval: RetrievalConfig | None = None) -> Toolbox:
    """The declared tools, priced with ``tools.prices`` over the list prices, the domains' tools
    and the tools of the MCP servers of ``tools.mcp`` (listed now: the toolbox's sources), not
    yet started (``async with toolbox`` warms them up and connects the MCP servers).
    ``retrieval``: the setting ``search``'s document retrieval runs under (an environment's
    ``env.retrieval``; None: the defaults, web search only)."""
    build = BuildSettings(tools.prices, tools.endpoints, retrieval)
    offered, parts = offered_and_parts(
        load_declarations([resolve_conf_path(p) for p in tools.declarations]), build
    )
    domain = [tool for loaded in build_domains(tools).values() for tool in domain_tools(loaded)]
    sources = []
    if tools.mcp:
        from nemo_orch.tools.mcp import mcp_source  # the mcp SDK loads only where configured

        sources = [mcp_source(server) for server in tools.mcp]
    return Toolbox(
        [*offered, *domain],
        cache_entries=tools.cache_entries,
        cache_bytes=tools.cache_mb << 20,
        parts=parts,
        show_prices=tools.show_prices,
        simulated_latency_s=tools.simulated_latency_s,
        modeled_time=tools.timing == "modeled",
        sources=sources,
    )


def declared_specs(tools: ToolsConfig) -> list[ToolSpec]:
    """The specs of the declared tools offered to the policy, read from their files without
    building them."""
    declarations = load_declarations([resolve_conf_path(path) for path in tools.declarations])
    return [declaration.spec for declaration in declarations if not declaration.part]


def offered_schemas(tools: ToolsConfig) -> list[dict[str, Any]]:
    """The OpenAI schemas of the tools offered to every task, as an episode lists them (with
    prices where ``tools.show_prices``): the declared tools, then the MCP servers' (listed now;
    a domain's tools are offered to its own tasks only). The tools are built, not started."""
    toolbox = build_toolbox(tools)
    return toolbox.schemas([*(spec.name for spec in declared_specs(tools)), *toolbox.source_of])


def _policy_dir(config: Config, scratch: Path) -> Path:
    """An HF directory holding the policy: ``rollout.policy`` as is when it is one, else the
    checkpoint it names (or the run's latest) exported to ``scratch``."""
    from nemo_orch.models import checkpoint
    from nemo_orch.models.hf_mapping import HF_CONFIG

    if config.rollout.policy is not None and (Path(config.rollout.policy) / HF_CONFIG).is_file():
        return Path(config.rollout.policy)
    source = config.rollout.policy or checkpoint.checkpoints_dir(config)
    if config.rollout.policy is None and checkpoint.latest_checkpoint(Path(source)) is None:
        raise ConfigError(
            f"rollout.policy is not set and {source} holds no checkpoint: train "
            "first (make train) or point rollout.policy at a checkpoint or an HF "
            "directory"
        )
    from nemo_orch.models import convert

    return convert.export(str(source), "hf", str(scratch / "policy"))


def build_engine(config: Config, max_requests: int = 8) -> tuple[Engine, PreTrainedTokenizerBase]:
    """The policy's generation engine and the tokenizer its token ids belong to; a served
    policy gets at most ``max_requests`` requests in flight."""
    from nemo_orch.models.tokenizer import load_tokenizer

    rollout = config.rollout
    if rollout.engine == "hf":
        from nemo_orch.rollout.engines.hf import HFEngine

        with tempfile.TemporaryDirectory(prefix="nemo-orch-policy-") as scratch:
            directory = _policy_dir(config, Path(scratch))
            tokenizer = load_tokenizer(directory)
            return HFEngine.from_pretrained(
                directory,
                tokenizer=tokenizer,
                base=config.model,
                prefix_caching=rollout.prefix_caching,
                prefix_cache_mb=rollout.prefix_cache_mb,
            ), tokenizer
    if rollout.engine in GPU_ENGINES:
        _require_gpu_engine(rollout.engine)  # before exporting a checkpoint for nothing

        def start(scratch: Path) -> TRTLLMEngine | VLLMEngine:
            directory = _policy_dir(config, scratch)
            tokenizer = load_tokenizer(_tokenizer_dir(config, directory))
            return _gpu_engine(config, directory, tokenizer, refit=False)

        engine = _in_scratch_dir(start)
        return engine, engine.tokenizer
    from nemo_orch.clients.openai import OpenAIClient
    from nemo_orch.rollout.engines.openai import OpenAIEngine

    if config.tokenizer.path is None:
        raise ConfigError(
            "rollout.engine=openai needs tokenizer.path (the served model's "
            "tokenizer) to keep token-level trajectories"
        )
    tokenizer = load_tokenizer(config.tokenizer.path)
    client = OpenAIClient(
        rollout.base_url,
        rollout.model_name,
        dialect=rollout.dialect,
        name="rollout (the policy)",
        api_key_env=rollout.api_key_env,
        max_in_flight=max_requests,
    )
    return OpenAIEngine(client, tokenizer, concurrency=max_requests), tokenizer


def rollout_settings(config: Config, engine: Engine | None) -> RolloutConfig:
    """``rollout`` for episodes of ``engine``: with ``rollout.max_context_tokens`` null, the
    context budget is the positions of the policy the engine loaded (its ``model_config``: a
    checkpoint or HF directory decides its own shape, whatever ``model.*`` says), else of
    ``model.*`` (a served model, or no engine)."""
    return config.resolved_rollout(
        getattr(engine, "model_config", config.model).max_position_embeddings
    )


def build_rollout_engine(
    config: Config, weights: Mapping[str, torch.Tensor], tokenizer: PreTrainedTokenizerBase
) -> Engine:
    """GRPO's engine, started from the policy's full HF-named ``weights`` and refit from them
    after every step. A GPU engine loads them from an HF directory written to a scratch
    directory, which lives as long as the engine."""
    rollout = config.rollout
    if rollout.engine == "hf":
        from nemo_orch.rollout.engines.hf import HFEngine

        return HFEngine(
            config.model,
            weights,
            tokenizer=tokenizer,
            prefix_caching=rollout.prefix_caching,
            prefix_cache_mb=rollout.prefix_cache_mb,
        )
    if rollout.engine not in GPU_ENGINES:
        raise ConfigError(
            f"GRPO cannot train through rollout.engine={rollout.engine}: a served "
            "model cannot be refit; use rollout=hf|trtllm|vllm"
        )
    _require_gpu_engine(rollout.engine)

    def start(scratch: Path) -> TRTLLMEngine | VLLMEngine:
        from nemo_orch.models.hf_mapping import save_hf_checkpoint
        from nemo_orch.models.tokenizer import save_tokenizer, special_token_ids
        from nemo_orch.rollout.engines.base import ENGINE_DTYPES

        save_hf_checkpoint(
            scratch,
            weights,
            config.model,
            dtype=ENGINE_DTYPES[rollout.engine_dtype],
            special_tokens=special_token_ids(tokenizer),
        )
        save_tokenizer(tokenizer, scratch)
        return _gpu_engine(config, scratch, tokenizer, refit=True)

    return _in_scratch_dir(start)


def _require_gpu_engine(name: str) -> None:
    """The library of GPU engine ``name`` and a CUDA GPU, or one clear error."""
    from nemo_orch.rollout.engines.base import require_cuda

    if name == "trtllm":
        from nemo_orch.rollout.engines.trtllm import import_trtllm

        import_trtllm()
    else:
        from nemo_orch.rollout.engines.vllm import import_vllm

        import_vllm()
    require_cuda(name)


def _tokenizer_dir(config: Config, directory: Path) -> Path:
    """The policy directory when it has a tokenizer, else ``tokenizer.path`` (a directory of
    built TensorRT engines has none)."""
    if (directory / "tokenizer.json").is_file():
        return directory
    if config.tokenizer.path is None:
        raise ConfigError(f"{directory} has no tokenizer: set tokenizer.path to the policy's")
    return Path(config.tokenizer.path)


def _gpu_engine(
    config: Config, directory: Path, tokenizer: PreTrainedTokenizerBase, *, refit: bool
) -> TRTLLMEngine | VLLMEngine:
    rollout = config.rollout
    if rollout.engine == "trtllm":
        from nemo_orch.rollout.engines.trtllm import TRTLLMEngine

        return TRTLLMEngine(
            directory,
            tokenizer,
            tensor_parallel_size=rollout.engine_tp,
            dtype=rollout.engine_dtype,
            free_gpu_memory_fraction=rollout.gpu_memory_utilization,
            max_batch_size=rollout.max_batch_size,
            refit=refit,
            prefix_caching=rollout.prefix_caching,
        )
    from nemo_orch.rollout.engines.vllm import VLLMEngine

    return VLLMEngine(
        directory,
        tokenizer,
        tensor_parallel_size=rollout.engine_tp,
        dtype=rollout.engine_dtype,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        seed=config.run.seed,
        max_batch_size=rollout.max_batch_size,
        sleep_mode=rollout.colocate,
        sleep_level=rollout.sleep_level,
        prefix_caching=rollout.prefix_caching,
    )


def _in_scratch_dir(
    start: Callable[[Path], TRTLLMEngine | VLLMEngine],
) -> TRTLLMEngine | VLLMEngine:
    """The engine ``start(scratch)`` builds in a fresh scratch directory, which is removed when
    the engine is garbage-collected (or at exit): a GPU library may read its model directory
    after it has started."""
    scratch = Path(tempfile.mkdtemp(prefix="nemo-orch-engine-"))
    try:
        engine = start(scratch)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    weakref.finalize(engine, shutil.rmtree, scratch, ignore_errors=True)
    return engine
