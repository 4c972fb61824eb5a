"""Environments: where tasks come from, their tools and their scoring (``env.*``).

:func:`build_environment` makes one source's environment; :func:`build_mixture` the
configured sources with their weights (a single source is a mixture of one).
"""

from __future__ import annotations

from nemo_orch.config import Config, ConfigError, EnvSourceConfig
from nemo_orch.envs.interfaces import Environment, Scored
from nemo_orch.envs.mixture import Mixture

__all__ = ["Environment", "Mixture", "Scored", "build_environment", "build_mixture"]


def build_environment(config: Config, source: EnvSourceConfig | None = None) -> Environment:
    """The environment of ``source`` (None: ``env`` itself, which must be one source)."""
    source = config.env if source is None else source
    if source.kind == "mixture":
        raise ConfigError(
            "env: a mixture has several environments; this command runs one "
            "(pick a source: env=NAME)"
        )
    val_fraction = config.env.val_fraction
    if source.kind == "offline":
        from nemo_orch.envs.offline import OfflineEnvironment

        return OfflineEnvironment(config, source)
    if source.kind == "toolscale":
        from nemo_orch.envs.toolscale import ToolScaleEnvironment

        return ToolScaleEnvironment(config, source, val_fraction)
    if source.kind == "tau2":
        from nemo_orch.envs.tau2 import Tau2Environment

        return Tau2Environment(config, source, val_fraction)
    if source.kind == "qa":
        from nemo_orch.envs.qa import QAEnvironment

        return QAEnvironment(config, source, val_fraction)
    from nemo_orch.envs.tasks import TaskFileEnvironment

    return TaskFileEnvironment(config, source, val_fraction)


def build_mixture(config: Config) -> Mixture:
    """Every source of ``env`` with its weight."""
    sources = config.env.source_list()
    return Mixture(
        [build_environment(config, source) for source in sources],
        [source.weight for source in sources],
    )
