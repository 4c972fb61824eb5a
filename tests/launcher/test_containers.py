"""containers/: the Dockerfile is pinned, and the launcher's default image is what the Enroot
recipe writes."""

import ast
import re
import shlex
from pathlib import Path

from nemo_orch import config as config_lib

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS = ROOT / "containers"


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continued lines joined."""
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            logical.append(current.strip())
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in logical]


def setup_version() -> str:
    """setup.py's version, read without running it."""
    call = next(
        node
        for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"
    )
    return next(
        ast.literal_eval(keyword.value) for keyword in call.keywords if keyword.arg == "version"
    )


PINNED = r"[A-Za-z0-9_.\-\[\]]+==[\w.+\-]+"


def pip_requirements(instructions: list[tuple[str, str]]) -> list[str]:
    """The package specs of every ``pip install`` in RUN lines, ARG defaults substituted."""
    args = dict(arg.split("=", 1) for kind, arg in instructions if kind == "ARG")
    specs = []
    for kind, command in instructions:
        if kind != "RUN":
            continue
        for part in command.split("&&"):
            words = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], part))
            if words[:2] != ["pip", "install"]:
                continue
            options_with_values = {"-c", "-r", "--extra-index-url"}
            skip = False
            for word in words[2:]:
                if skip or word.startswith("-"):
                    skip = word in options_with_values
                    continue
                specs.append(word)
    return specs


def test_the_dockerfile_starts_from_a_pinned_ngc_pytorch_image():
    instructions = dockerfile_instructions((CONTAINERS / "Dockerfile").read_text())
    kinds = [kind for kind, _ in instructions]
    assert kinds[0] == "FROM" and kinds.count("FROM") == 1
    image = instructions[0][1]
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", image), image
    assert "latest" not in image and image in (CONTAINERS / "README.md").read_text()
    assert {"RUN", "COPY", "WORKDIR", "ENV", "ARG"} <= set(kinds)


def test_every_pip_install_is_pinned_and_the_extras_come_from_their_files():
    instructions = dockerfile_instructions((CONTAINERS / "Dockerfile").read_text())
    specs = pip_requirements(instructions)
    packages = [spec for spec in specs if spec != "."]
    assert packages and all(re.fullmatch(PINNED, spec) for spec in packages), packages
    # requirements.txt goes in whole but for the CPU torch pin, the serve and launch extras from
    # the files setup.py reads them from (all pinned); the package itself without deps
    runs = " ".join(command for kind, command in instructions if kind == "RUN")
    assert "grep -v -E '^(torch|pytest)==' requirements.txt" in runs
    for extra in ("serve", "launch"):
        assert f"-r requirements-{extra}.txt" in runs
        lines = (ROOT / f"requirements-{extra}.txt").read_text().splitlines()
        assert all(re.fullmatch(PINNED, line) for line in lines if line and line[0] != "#")
    # the package: its wheel, by the script tests/test_packaging.py runs into a fresh venv
    assert "containers/install_package.sh python ." in runs
    script = (CONTAINERS / "install_package.sh").read_text()
    assert "pip install --quiet --no-deps --no-index" in script and " -e " not in script


def test_the_launchers_default_image_is_what_the_enroot_recipe_writes():
    script = (CONTAINERS / "enroot.sh").read_text()
    image = re.search(r"^IMAGE=(\S+)$", script, re.M).group(1)
    version = setup_version()
    assert image == f"nemo-orch:{version}"
    assert 'OUT="$JOB_DIR/containers/${IMAGE/:/+}.sqsh"' in script  # enroot's own name
    assert config_lib.CONTAINER_SQSH == image.replace(":", "+") + ".sqsh"
    assert (
        f"docker build -f containers/Dockerfile -t {image} ."
        in (CONTAINERS / "Dockerfile").read_text()
    )
    slurm = config_lib.load(["recipe=orchestrator-qwen3-8b-2n8g-tp4pp1-fp8"]).launcher.slurm
    assert slurm.image == f"{slurm.job_dir}/containers/nemo-orch+{version}.sqsh"
    readme = (CONTAINERS / "README.md").read_text()
    assert f"containers/{config_lib.CONTAINER_SQSH}" in readme and "enroot import" in readme
