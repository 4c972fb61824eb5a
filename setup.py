"""nemo-orch: train tool-orchestrating LLMs with RL on the Megatron/NeMo stack."""

from pathlib import Path

from setuptools import find_packages, setup

# In requirements.txt for `make test`, not installed with us.
TEST_ONLY = ("pytest", "hypothesis", "openai")


def package_files(package: str, folder: str) -> list[str]:
    """Every file under ``package/folder``, relative to the package (its package data)."""
    root = Path(__file__).with_name(package)
    return sorted(
        str(path.relative_to(root)) for path in (root / folder).rglob("*") if path.is_file()
    )


def requirements(name: str = "requirements.txt") -> list[str]:
    lines = Path(__file__).with_name(name).read_text().splitlines()
    runtime = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return [r for r in runtime if not r.startswith(TEST_ONLY)]


setup(
    name="nemo-orch",
    version="0.1.0",
    description="Train orchestrator LLMs (ToolOrchestra-style GRPO) on Megatron-Core",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["nemo_orch", "nemo_orch.*"]),
    # The configuration tree (nemo_orch/conf/: groups, recipes, tool declarations, samples).
    package_data={
        "nemo_orch": package_files("nemo_orch", "conf"),
        "nemo_orch.envs.toolscale": ["prompts/*.txt"],
    },
    install_requires=requirements(),
    extras_require={
        # CUDA-only cores; imported lazily and exercised by `pytest -m gpu`.
        "gpu": ["transformer-engine[pytorch]", "tensorrt-llm", "vllm", "faiss-gpu-cu12"],
        # PyTriton (`nemo-orch serve reward|tool`); see requirements-serve.txt for the pins.
        "serve": requirements("requirements-serve.txt"),
        # NeMo-Run (`nemo-orch launch`) and Ray (`rollout.backend=ray`): requirements-launch.txt.
        "launch": requirements("requirements-launch.txt"),
        # tau2-bench's domains, tasks and evaluator (`make` installs it: requirements-tau2.txt).
        "tau2": requirements("requirements-tau2.txt"),
        "dev": ["pytest==9.2.0", "hypothesis==6.170.17"],
    },
    entry_points={"console_scripts": ["nemo-orch=nemo_orch.cli:main"]},
)
