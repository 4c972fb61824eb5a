"""The documentation site (``mkdocs.yml``) builds with every warning an error, offline, and holds
each page of the nav, the generated configuration reference and the API rendered from the code's
docstrings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        for target in entry.values() if isinstance(entry, dict) else [entry]:
            pages += _nav_pages(target) if isinstance(target, list) else [target]
    return pages


def test_the_site_builds_strictly_with_every_page(tmp_path: Path) -> None:
    # The Material theme's notice about its successor is not a warning of this site's.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, build.stderr

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = _nav_pages(config["nav"])
    assert sorted(pages) == sorted(path.name for path in (ROOT / "docs").glob("*.md"))
    for page in pages:
        built = tmp_path / ("index.html" if page == "index.md" else f"{page[:-3]}/index.html")
        assert built.is_file(), page

    reference = (tmp_path / "configuration" / "index.html").read_text()
    assert "<td><code>grpo.kl_coef</code></td>" in reference
    api = (tmp_path / "api" / "index.html").read_text()
    for name in (
        "nemo_orch.envs.interfaces.Environment",
        "nemo_orch.tools.base.ToolSpec",
        "nemo_orch.tools.base.Tool.call",
        "nemo_orch.rollout.engines.base.Engine",
        "nemo_orch.rollout.engines.base.SamplingParams",
        "nemo_orch.reward.combine.score_group",
    ):
        assert f'id="{name}"' in api, name
