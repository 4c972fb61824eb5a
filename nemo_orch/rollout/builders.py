"""Builders from the validated config to the rollout's parts: tools and engine.

Recipes (``nemo-orch rollout``, GRPO, evaluation) call these instead of reading config fields
themselves, so every entry point builds the same parts the same way.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

from nemo_orch.config import Config, ConfigError, ToolsConfig, resolve_conf_path
from nemo_orch.data.domain import Domain
from nemo_orch.reward.outcome import OutcomeScorer
from nemo_orch.tools.domain import domain_tools, load_domains
from nemo_orch.tools.pricing import price_overrides
from nemo_orch.tools.registry import Toolbox, build_tools, load_declarations

if TYPE_CHECKING:  # torch and transformers load only for commands that generate
    from transformers import PreTrainedTokenizerBase

    from nemo_orch.rollout.engines.base import Engine


def build_toolbox(tools: ToolsConfig) -> Toolbox:
    """The declared tools, priced with ``tools.prices`` over the list prices, and the domains'
    tools, not yet started (``async with toolbox`` warms them up)."""
    with price_overrides(tools.prices):
        declared = build_tools(load_declarations([resolve_conf_path(p)
                                                  for p in tools.declarations]))
    domain = [tool for loaded in build_domains(tools).values() for tool in domain_tools(loaded)]
    return Toolbox([*declared, *domain], cache_entries=tools.cache_entries,
                   cache_bytes=tools.cache_mb << 20)


def build_domains(tools: ToolsConfig) -> dict[str, Domain]:
    """The configured domains (``tools.domains``), by name."""
    return load_domains([resolve_conf_path(path) for path in tools.domains])


def build_scorer(config: Config, judge_in_flight: int | None = None) -> OutcomeScorer:
    """The outcome scorer: the reward protocol, with the configured domains' databases and at
    most ``judge_in_flight`` judge requests at once (None: no bound)."""
    return OutcomeScorer(config.reward, domains=build_domains(config.tools),
                         judge_in_flight=judge_in_flight)


def declared_schemas(tools: ToolsConfig) -> list[dict[str, Any]]:
    """The declared tools' OpenAI schemas, read from their files without building them."""
    declarations = load_declarations([resolve_conf_path(path) for path in tools.declarations])
    return [declaration.spec.schema() for declaration in declarations]


def _policy_dir(config: Config, scratch: Path) -> Path:
    """An HF directory holding the policy: ``rollout.policy`` as is when it is one, else the
    checkpoint it names (or the run's latest) exported to ``scratch``."""
    from nemo_orch.models import checkpoint
    from nemo_orch.models.hf_mapping import HF_CONFIG

    if config.rollout.policy is not None and (Path(config.rollout.policy) / HF_CONFIG).is_file():
        return Path(config.rollout.policy)
    source = config.rollout.policy or checkpoint.checkpoints_dir(config)
    if config.rollout.policy is None and checkpoint.latest_checkpoint(Path(source)) is None:
        raise ConfigError(f"rollout.policy is not set and {source} holds no checkpoint: train "
                          "first (make train) or point rollout.policy at a checkpoint or an HF "
                          "directory")
    from nemo_orch.models import convert

    return convert.export(str(source), "hf", str(scratch / "policy"))


def build_engine(config: Config, max_requests: int = 8
                 ) -> tuple["Engine", "PreTrainedTokenizerBase"]:
    """The policy's generation engine and the tokenizer its token ids belong to; a served
    policy gets at most ``max_requests`` requests in flight."""
    from nemo_orch.models.tokenizer import load_tokenizer

    rollout = config.rollout
    if rollout.engine == "hf":
        from nemo_orch.rollout.engines.hf import HFEngine

        with tempfile.TemporaryDirectory(prefix="nemo-orch-policy-") as scratch:
            directory = _policy_dir(config, Path(scratch))
            tokenizer = load_tokenizer(directory)
            return HFEngine.from_pretrained(directory, tokenizer=tokenizer,
                                            base=config.model), tokenizer
    if rollout.engine == "openai":
        from nemo_orch.rollout.engines.openai import OpenAIClient, OpenAIEngine

        if config.tokenizer.path is None:
            raise ConfigError("rollout.engine=openai needs tokenizer.path (the served model's "
                              "tokenizer) to keep token-level trajectories")
        tokenizer = load_tokenizer(config.tokenizer.path)
        client = OpenAIClient(rollout.base_url, rollout.model_name,
                              api_key_env=rollout.api_key_env, max_in_flight=max_requests)
        return OpenAIEngine(client, tokenizer, concurrency=max_requests), tokenizer
    raise ConfigError(f"rollout.engine={rollout.engine} needs a GPU engine (TensorRT-LLM/vLLM), "
                      "which is not part of this installation")
