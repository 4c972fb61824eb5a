"""What every section shares: the ``conf/`` directory, :class:`ConfigError` and the checks."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Optional

# The configuration tree ships inside the package (``nemo_orch/conf/``): an installed wheel
# finds it wherever it runs. Hydra composes from a directory, so the package must be installed
# unzipped, as pip installs wheels.
CONF_DIR = Path(str(resources.files("nemo_orch") / "conf"))


class ConfigError(ValueError):
    """A user mistake in the configuration; the message names the key or file."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _require_file(path: Optional[str], key: str) -> None:
    if path is not None and not Path(path).exists():
        raise ConfigError(f"{key}: no such file or directory: {path}")


def resolve_conf_path(path: str) -> Path:
    """Relative paths in tool/task settings are relative to ``conf/`` (where they ship), unless
    they exist relative to the working directory."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate
    return CONF_DIR / candidate
