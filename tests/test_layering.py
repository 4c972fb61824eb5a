"""The package's structure: generic code reaches an environment only through the environment
seam (``nemo_orch.envs`` and its ``interfaces``), never the offline world's internals."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nemo_orch"
OFFLINE = "nemo_orch.envs.offline"
# The main job is the offline world's own recipe (`nemo-orch train` refuses any other env): it
# and its report may read the world's oracle.
MAIN_JOB = {"train/main_job.py", "eval/main_job_report.py"}


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports, at any depth (lazy imports inside functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_generic_code_imports_no_environment_internals():
    leaks = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("envs/") or relative in MAIN_JOB:
            continue
        offline = sorted(
            name for name in _imports(path) if name == OFFLINE or name.startswith(OFFLINE + ".")
        )
        if offline:
            leaks[relative] = offline
    assert not leaks, leaks


def test_the_seam_is_what_the_world_is_reached_by():
    """The check above reads real imports: the offline world's own modules do import it."""
    assert any(name.startswith(OFFLINE) for name in _imports(PACKAGE / "envs" / "__init__.py"))


# A module longer than this holds more than one concern: split it along its seam.
MAX_MODULE_LINES = 600


def test_no_module_outgrows_one_concern():
    long = {
        path.relative_to(PACKAGE).as_posix(): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, long
