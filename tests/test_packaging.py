"""The package as a user installs it: the wheel that ``containers/install_package.sh`` builds
(the container's install), installed into a fresh virtual environment outside the checkout,
runs ``nemo-orch`` from another directory with the configuration tree it carries."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from support.cli_helpers import grpo_overrides, grpo_stage, sum_task_overrides

ROOT = Path(__file__).resolve().parents[1]
# What the Dockerfile copies before it installs the package.
SOURCES = (
    "setup.py",
    "pyproject.toml",
    "MANIFEST.in",
    "README.md",
    "requirements.txt",
    "requirements-serve.txt",
    "requirements-launch.txt",
    "requirements-tau2.txt",
    "nemo_orch",
    "containers/install_package.sh",
)


def _dependencies_without_nemo_orch(view: Path) -> Path:
    """A directory of links to this environment's installed packages less nemo-orch's own
    (its editable install would shadow the wheel): the fresh environment's dependencies, read
    through a ``.pth`` line, with nothing downloaded."""
    view.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if "nemo_orch" not in entry.name:
            (view / entry.name).symlink_to(entry)
    return view


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fresh environment's ``bin/`` with the wheel installed (built from a copy of the
    checkout's sources, so the checkout gets no build directory)."""
    work = tmp_path_factory.mktemp("packaging")
    source = work / "source"
    for name in SOURCES:
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, target)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    (Path(purelib.stdout.strip()) / "dependencies.pth").write_text(
        f"{_dependencies_without_nemo_orch(work / 'dependencies')}\n"
    )
    subprocess.run(
        [source / "containers" / "install_package.sh", python, source], check=True, cwd=work
    )
    return venv / "bin"


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_the_wheel_carries_its_configuration_and_runs_from_anywhere(installed, tmp_path):
    shown = _run(
        installed / "python",
        "-c",
        "import nemo_orch, nemo_orch.config as c; print(nemo_orch.__file__); "
        "print(c.CONF_DIR); print(*c.recipes())",
        cwd=tmp_path,
    )
    package, conf_dir, recipes = shown.stdout.splitlines()
    venv = installed.parent
    assert Path(package).is_relative_to(venv) and Path(conf_dir).is_relative_to(venv)
    assert not Path(package).is_relative_to(ROOT)
    # every file of the package's sources is in the wheel: modules, prompts, the conf tree
    tracked = subprocess.run(
        ["git", "ls-files", "nemo_orch"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    missing = [
        name
        for name in tracked
        if not (Path(package).parent / Path(name).relative_to("nemo_orch")).is_file()
    ]
    assert not missing and Path(conf_dir) == Path(package).parent / "conf", missing[:10]
    assert set(recipes.split()) == {
        path.stem for path in (ROOT / "nemo_orch" / "conf" / "recipes").glob("*.yaml")
    }
    # the extras name what their requirement files pin (setup.py reads them at build time)
    declared = _run(
        installed / "python",
        "-c",
        "import importlib.metadata as m; print(*m.requires('nemo-orch'), sep='\\n')",
        cwd=tmp_path,
    ).stdout.splitlines()
    for extra in ("serve", "launch", "tau2"):
        pinned = [
            line.strip()
            for line in (ROOT / f"requirements-{extra}.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")
        ]
        assert {f'{pin}; extra == "{extra}"' for pin in pinned} <= set(declared), extra
    assert any(line.startswith("tensorrt-llm") and 'extra == "gpu"' in line for line in declared)
    printed = _run(
        installed / "nemo-orch", "train", "--print-config", "grpo.kl_coef=0.05", cwd=tmp_path
    ).stdout
    assert "kl_coef: 0.05" in printed and "vocab_size:" in printed


def test_the_installed_command_trains(installed, start_checkpoint, tmp_path):
    """A short ``nemo-orch grpo`` by the installed command, from a directory outside the
    checkout: the shipped tool declarations and the trainer resolve from the wheel."""
    _run(
        installed / "nemo-orch",
        "grpo",
        *grpo_overrides(start_checkpoint, tmp_path, *sum_task_overrides(tmp_path)),
        cwd=tmp_path,
    )
    assert (grpo_stage(tmp_path) / "checkpoints" / "step_2").is_dir()
