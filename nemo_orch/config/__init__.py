"""The configuration tree: one validated dataclass per concern, loaded and checked once.

``conf/train.yaml`` composes the groups (``model``, ``tools``, ``reward``, ``rollout``, ``data``,
``trainer``, ``launcher``) with Hydra; the merged tree is checked against :class:`Config`, so an
unknown key, a wrong type or a missing file fails here with a :class:`ConfigError` naming it, and
code past this point reads typed fields without defaults of its own. Keys that take a model,
tokenizer or dataset also take a Hugging Face Hub id (``org/name[@revision]``), resolved here to
the local snapshot (:mod:`nemo_orch.config.hub`).

Each section's dataclass lives in a module of its own (``run``, ``model`` with ``parallel`` and
``tokenizer``, ``data``, ``tools``, ``reward``, ``grpo``, ``dpo``, ``rollout``, ``trainer``,
``launcher``, ``synth``, ``env``, ``eval``, ``serve``, ``calls``; shared checks in ``base``, Hub ids in
``hub``); this root holds :class:`Config` and composes, loads and validates it, and re-exports
every section's names.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_orch.config.base import CONF_DIR, ConfigError, _require, _require_file, resolve_conf_path
from nemo_orch.config.calls import CALL_MODES, CallsConfig
from nemo_orch.config.data import (
    AGENT_KINDS,
    DEMO_ROUTERS,
    GOLD_REPLAY,
    MONOLITH,
    NAIVE_ROUTERS,
    ORCHESTRATOR,
    ROUTERS,
    DataConfig,
)
from nemo_orch.config.dpo import DPO_LOSSES, DPOConfig
from nemo_orch.config.env import (
    BENCHMARKS,
    ENV_KINDS,
    QA_PRESETS,
    RETRIEVAL_SCOPES,
    EncoderConfig,
    EnvConfig,
    EnvSourceConfig,
    RetrievalConfig,
    UserConfig,
)
from nemo_orch.config.eval import EvalConfig, MonolithConfig
from nemo_orch.config.grpo import AsyncGRPOConfig, CurriculumStage, GRPOConfig, PPOConfig
from nemo_orch.config.hub import pin_hub_paths, resolve_hub_ids
from nemo_orch.config.launcher import (
    CONTAINER_SQSH,
    SECRET_MARKERS,
    ExpertServerConfig,
    LauncherConfig,
    RayClusterConfig,
    SlurmConfig,
)
from nemo_orch.config.model import CHAT_FORMATS, ModelConfig, ParallelConfig, TokenizerConfig
from nemo_orch.config.reward import RewardConfig
from nemo_orch.config.rollout import ExternalAgentConfig, RayConfig, RolloutConfig
from nemo_orch.config.run import RunConfig
from nemo_orch.config.serve import SERVE_KINDS, ServeConfig
from nemo_orch.config.synth import SynthConfig
from nemo_orch.config.tools import McpServerConfig, ToolsConfig
from nemo_orch.config.trainer import TrainerConfig

__all__ = [
    # the root
    "Config",
    "MOVED_KEYS",
    "RECIPES_DIR",
    "compose",
    "load",
    "load_saved",
    "recipes",
    "replace",
    "to_yaml",
    "validate",
    # base
    "CONF_DIR",
    "ConfigError",
    "resolve_conf_path",
    # the sections
    "RunConfig",
    "ModelConfig",
    "ParallelConfig",
    "TokenizerConfig",
    "CHAT_FORMATS",
    "DataConfig",
    "AGENT_KINDS",
    "DEMO_ROUTERS",
    "GOLD_REPLAY",
    "MONOLITH",
    "NAIVE_ROUTERS",
    "ORCHESTRATOR",
    "ROUTERS",
    "ToolsConfig",
    "McpServerConfig",
    "RewardConfig",
    "CurriculumStage",
    "GRPOConfig",
    "AsyncGRPOConfig",
    "PPOConfig",
    "DPO_LOSSES",
    "DPOConfig",
    "CALL_MODES",
    "CallsConfig",
    "ExternalAgentConfig",
    "RayConfig",
    "RolloutConfig",
    "TrainerConfig",
    "CONTAINER_SQSH",
    "SECRET_MARKERS",
    "SlurmConfig",
    "RayClusterConfig",
    "ExpertServerConfig",
    "LauncherConfig",
    "SynthConfig",
    "ENV_KINDS",
    "BENCHMARKS",
    "QA_PRESETS",
    "RETRIEVAL_SCOPES",
    "EnvSourceConfig",
    "EnvConfig",
    "UserConfig",
    "RetrievalConfig",
    "EncoderConfig",
    "MonolithConfig",
    "EvalConfig",
    "SERVE_KINDS",
    "ServeConfig",
]

# Keys that moved: their old spelling fails with a message naming the new one.
_OPTIMIZER_FIELDS = (
    "lr",
    "min_lr",
    "warmup_steps",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "grad_clip",
)
# Keys that moved, to where: an override of the old key is refused naming the new one; a config
# saved before the move loads with the value moved (see :func:`_migrate_moved`).
MOVED_KEYS = {
    "eval.data": "env.path",
    "eval.domain": "env.domain",
    "eval.split": "env.split",
    "eval.limit": "env.limit",
    "grpo.eval_tasks": "eval.tasks",
    **{
        f"{section}.{name}": f"{section}.optim.{name}"
        for section in ("trainer", "grpo")
        for name in _OPTIMIZER_FIELDS
    },
}


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    calls: CallsConfig = field(default_factory=CallsConfig)

    def __post_init__(self) -> None:
        _require(
            self.model.num_layers % self.parallel.pp == 0,
            "model.num_layers must be divisible by parallel.pp",
        )
        _require(
            self.model.num_query_groups % self.parallel.tp == 0,
            "model.num_query_groups must be divisible by parallel.tp",
        )
        _require(
            self.model.vocab_size % self.parallel.tp == 0,
            "model.vocab_size must be divisible by parallel.tp",
        )
        _require(
            self.model.ffn_hidden_size % self.parallel.tp == 0,
            "model.ffn_hidden_size must be divisible by parallel.tp",
        )
        _require(
            not self.parallel.sequence_parallel
            or self.model.transformer_impl == "transformer_engine",
            "parallel.sequence_parallel requires transformer_engine",
        )
        micro_batches = self.trainer.global_batch_size // self.trainer.micro_batch_size
        _require(
            micro_batches % self.parallel.dp == 0,
            "trainer.global_batch_size / trainer.micro_batch_size must be divisible by parallel.dp",
        )
        _require(
            self.dpo.global_batch_size % (self.dpo.micro_batch_size * self.parallel.dp) == 0,
            "dpo.global_batch_size must be a multiple of dpo.micro_batch_size x parallel.dp",
        )
        _require(
            self.data.seq_length <= self.model.max_position_embeddings,
            "data.seq_length must be <= model.max_position_embeddings",
        )
        _require(
            self.tokenizer.path is not None or self.tokenizer.vocab_size <= self.model.vocab_size,
            "tokenizer.vocab_size must be <= model.vocab_size",
        )
        _require(
            (self.rollout.max_context_tokens or 0) <= self.model.max_position_embeddings,
            "rollout.max_context_tokens must be <= model.max_position_embeddings",
        )
        _require(
            self.rollout.backend != "ray"
            or not any(source.user.simulated for source in self.env.source_list()),
            "rollout.backend=ray: the Ray workers do not run tau2's LLM user yet; use "
            "rollout.backend=local with env.user.base_url",
        )
        if self.grpo.async_grpo.enabled:
            _require(
                not (self.rollout.colocate and self.rollout.engine in ("trtllm", "vllm")),
                "grpo.async_grpo generates while the policy trains: the rollout engine "
                "needs GPUs of its own (rollout.colocate=false, e.g. the recipe "
                "orchestrator-qwen3-8b-1n8g-tp4pp1-fp8-async)",
            )

    def resolved_rollout(self, positions: int | None = None) -> RolloutConfig:
        """``rollout`` with the context budget resolved (null: ``positions``, the policy's,
        which default to ``model.max_position_embeddings``)."""
        return dataclasses.replace(
            self.rollout,
            max_context_tokens=self.rollout.max_context_tokens
            or positions
            or self.model.max_position_embeddings,
        )

    @property
    def tokenizer_dir(self) -> Path:
        """The policy's tokenizer: ``tokenizer.path``, else the one trained into the run."""
        return (
            Path(self.tokenizer.path)
            if self.tokenizer.path is not None
            else (self.run.dir / "tokenizer")
        )

    @property
    def eval_seed(self) -> int:
        """The evaluation's seed: ``eval.seed``, else the run's."""
        return self.run.seed if self.eval.seed is None else self.eval.seed

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per data-parallel rank per step."""
        return self.trainer.global_batch_size // (self.trainer.micro_batch_size * self.parallel.dp)


RECIPES_DIR = CONF_DIR / "recipes"


def recipes() -> list[str]:
    """The names ``recipe=NAME`` accepts: the files of ``conf/recipes/``."""
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


def _recipe_overrides(overrides: list[str] | tuple[str, ...], staging: Path) -> list[str]:
    """``recipe=NAME`` selects ``conf/recipes/NAME.yaml``: a config group (Hydra's ``recipes``,
    last in ``train.yaml``'s defaults) whose files are ``@package _global_`` with their own
    ``override /group: option`` defaults, so a recipe composes over the defaults and the
    command line's overrides still win. ``recipe=PATH.yaml`` takes a recipe kept anywhere:
    copied into ``staging/recipes/`` and found there through Hydra's search path."""
    selected = []
    for override in overrides:
        key, _, name = override.partition("=")
        if key not in ("recipe", "recipes"):
            selected.append(override)
            continue
        if name.endswith((".yaml", ".yml")):
            path = Path(name).expanduser()
            _require(path.is_file(), f"recipe={name}: no such file")
            (staging / "recipes").mkdir(exist_ok=True)
            staged = f"file-{path.stem}"
            shutil.copyfile(path, staging / "recipes" / f"{staged}.yaml")
            selected += [f"recipes={staged}", f"hydra.searchpath=[file://{staging}]"]
            continue
        _require(
            name in recipes(),
            f"unknown recipe {name!r}; available: "
            f"{', '.join(recipes()) or 'none'} (conf/recipes/), or a path to a .yaml file",
        )
        selected.append(f"recipes={name}")
    return selected


def _check_moved(overrides: list[str] | tuple[str, ...]) -> None:
    for override in overrides:
        key = override.partition("=")[0].lstrip("+~")
        _require(
            key not in MOVED_KEYS,
            f"{key} is now {MOVED_KEYS.get(key)} (where tasks come "
            "from lives under env.*, how they are evaluated under eval.*, each stage's "
            "optimizer under trainer.optim and grpo.optim)",
        )


@functools.cache
def _store_schemas() -> None:
    """Register, once per process, what the conf files compose over.

    Every file composes over the dataclasses' defaults (`train.yaml` starts from them), so a
    YAML file states only what differs and any key can be set on any option. As plain values:
    the types are checked once, by validate (a typed tree would refuse a dict for a section
    whose default is null, such as launcher.ray={nodes: 1}). The env presets start from the
    typed EnvConfig instead (`defaults: [schema]`): a mixture's sources are then typed
    entries, each of whose options (env.sources.0.name=...) can be set."""
    from hydra.core.config_store import ConfigStore

    defaults = OmegaConf.to_container(OmegaConf.structured(Config), enum_to_str=True)
    del defaults["env"]
    ConfigStore.instance().store(name="config_schema", node=defaults)
    ConfigStore.instance().store(group="env", name="schema", node=EnvConfig)


def compose(config_name: str = "train", overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with Hydra overrides (``key=value``, ``group=option``,
    ``recipe=NAME``)."""
    _check_moved(overrides)
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException, OverrideParseException

    _store_schemas()
    try:
        with (
            tempfile.TemporaryDirectory(prefix="nemo-orch-recipe-") as staging,
            initialize_config_dir(config_dir=str(CONF_DIR), version_base=None),
        ):
            return hydra_compose(config_name, overrides=_recipe_overrides(overrides, Path(staging)))
    except OverrideParseException as error:  # Hydra's message quotes the value, not the key
        key = error.override.partition("=")[0]
        reason = str(error.message).splitlines()[0]
        raise ConfigError(
            f"{key}: cannot parse {error.override!r}: {reason} (quote values "
            "with brackets, commas or spaces)"
        ) from None
    except HydraException as error:
        raise ConfigError(_hydra_message(error)) from None


def _hydra_message(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    # Hydra's search-path listing and doc links help nobody fix a typo.
    kept = [
        line
        for line in lines
        if not line.startswith(
            ("Config search path", "\tprovider", "See https://", "To append to your config")
        )
    ]
    if kept and kept[0].startswith("Could not override"):
        # A dict value with a key the config lacks fails on that key, deeper than the override's.
        unknown = getattr(error.__cause__, "full_key", None)
        kept[0] = (
            f"Unknown config key '{unknown}'.{_new_key_hint(unknown)}"
            if unknown
            else kept[0].replace("Could not override", "Unknown config key")
        )
    return "\n".join(kept)


def _new_key_hint(key: str) -> str:
    """How to add ``key`` when it names a new entry of a mapping the schema leaves open (e.g.
    an alias of ``tools.endpoints``): Hydra takes a key that is not there yet only with ``+``."""
    parent = key.rpartition(".")[0]
    node = OmegaConf.select(OmegaConf.structured(Config), parent) if parent else None
    if isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict:
        return f" A new key of {parent} is added with +: +{key}=VALUE."
    return ""


def validate(tree: DictConfig | dict) -> Config:
    """Check a composed tree against the schema and build the typed :class:`Config`, its Hugging
    Face Hub ids resolved to local snapshots first (:mod:`nemo_orch.config.hub`), so the
    sections' checks and everything downstream see local paths."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), tree)
        resolve_hub_ids(merged)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None)
        reason = str(error).splitlines()[0]
        raise ConfigError(f"{key}: {reason}" if key else reason) from None


def load(overrides: list[str] | tuple[str, ...] = (), config_name: str = "train") -> Config:
    """Compose, resolve and validate: the single entry point for configuration."""
    return validate(compose(config_name, overrides))


def to_yaml(config: Config) -> str:
    """The config as YAML, for a run to save: a Hub snapshot's path is written as the id pinned
    to its commit (``org/name@<commit>``), which loads again on any machine."""
    tree = OmegaConf.structured(config)
    pin_hub_paths(tree)
    return OmegaConf.to_yaml(tree)


def load_saved(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Reload a config saved beside a checkpoint, with ``key=value`` overrides, validated again."""
    path = Path(path)
    _require_file(str(path), "config")
    try:
        tree = OmegaConf.load(path)
        _migrate_moved(tree)
        tree.merge_with_dotlist(list(overrides))
    except Exception as error:  # malformed YAML or override of any kind
        raise ConfigError(f"{path}: not a readable YAML config ({error})") from None
    return validate(tree)


def _migrate_moved(tree: DictConfig) -> None:
    """A config saved before a key moved (:data:`MOVED_KEYS`) still loads: the old key goes; its
    value moves to the new key, unless the saved config holds that one too (then it wins)."""
    for old, new in MOVED_KEYS.items():
        section, _, name = old.rpartition(".")
        node = OmegaConf.select(tree, section)
        if isinstance(node, DictConfig) and name in node:
            value = node[name]
            del node[name]
            parent, _, leaf = new.rpartition(".")
            target = OmegaConf.select(tree, parent)
            if not (isinstance(target, DictConfig) and leaf in target):
                OmegaConf.update(tree, new, value, force_add=True)


def replace(config: Config, **sections: object) -> Config:
    """A copy with whole sections replaced, validated again."""
    return validate(OmegaConf.structured(dataclasses.replace(config, **sections)))
