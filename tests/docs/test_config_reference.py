"""``scripts/config_reference.py``: docs/configuration.md is current, every key has a meaning,
and the check names what is wrong."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nemo_orch.config import Config

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "config_reference.py"
_spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
config_reference = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = config_reference  # its dataclasses look their module up by name
_spec.loader.exec_module(config_reference)


@dataclass
class _Inner:
    # How deep it goes.
    depth: int = 1
    width: int = 2


@dataclass
class _Section:
    """A section for the test. ``documented`` is stated here. Nothing more."""

    documented: int = 0
    # Stated above.
    commented: str = "x"
    beside: bool = True  # Stated beside.
    bare: float = 1.0
    inner: _Inner = field(default_factory=_Inner)
    stages: list[_Inner] = field(default_factory=list)


def test_the_reference_is_current_and_every_key_has_a_meaning() -> None:
    assert config_reference.main(["--check"]) == 0


def test_the_reference_covers_every_section_and_key() -> None:
    sections = {section.path: section for section in config_reference.describe(Config)}
    for name in (
        "run",
        "model",
        "trainer",
        "trainer.optim",
        "rollout",
        "rollout.ray",
        "tools",
        "grpo",
        "grpo.ppo",
        "grpo.curriculum[]",
        "env.sources[]",
        "launcher.experts[]",
    ):
        assert name in sections
    keys = {key.path: key for section in sections.values() for key in section.keys}
    assert keys["grpo.kl_coef"].default == "`0.1`"
    # A nested section keeps the defaults of its own instance: GRPO's optimizer is not SFT's.
    assert keys["grpo.optim.lr"].default == "`0.00025`"
    assert keys["trainer.optim.lr"].default == "`0.002`"
    assert keys["launcher.experts[].name"].default == "required"
    assert "trainer.optim" not in keys  # a section, not a key


def test_meanings_come_from_comments_and_the_docstring() -> None:
    sections = config_reference.describe(_Section, "demo")
    keys = {key.path: key for section in sections for key in section.keys}
    assert keys["demo.documented"].meaning == "`documented` is stated here."
    assert keys["demo.commented"].meaning == "Stated above."
    assert keys["demo.beside"].meaning == "Stated beside."
    assert keys["demo.inner.depth"].meaning == "How deep it goes."
    assert keys["demo.stages"].type == "`list[_Inner]`"
    assert "demo.stages[].depth" in keys


def test_a_field_without_a_meaning_fails_the_check_by_name() -> None:
    sections = config_reference.describe(_Section, "demo")
    missing = ["demo.bare", "demo.inner.width", "demo.stages", "demo.stages[].width"]
    assert sorted(config_reference.undocumented(sections)) == missing
    problems = config_reference.problems(sections, config_reference.render(sections))
    assert sorted(problem.split(":")[0] for problem in problems) == missing


@pytest.mark.parametrize("edit", ["change", "drop"])
def test_a_stale_reference_fails_the_check_naming_the_key(edit: str) -> None:
    sections = config_reference.describe(Config)
    current = config_reference.render(sections)
    row = next(line for line in current.splitlines() if line.startswith("| `rollout.top_k` |"))
    stale = current.replace(row, row.replace("`0`", "`5`") if edit == "change" else "")
    (problem,) = config_reference.problems(sections, stale)
    assert "stale" in problem and "rollout.top_k" in problem


def test_the_command_writes_the_reference_and_checks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    reference = tmp_path / "configuration.md"
    monkeypatch.setattr(config_reference, "REFERENCE", reference)
    assert config_reference.main([]) == 0
    assert config_reference.main(["--check"]) == 0
    reference.write_text(
        reference.read_text().replace(
            "| `run.seed` | `int` | `1234` |", "| `run.seed` | `int` | `7` |"
        )
    )
    assert config_reference.main(["--check"]) == 1
    assert "is stale (run.seed)" in capsys.readouterr().err
