"""Shared fixtures: offline data, a small tokenizer trained on it, an in-process Megatron world.
The helpers the tests share live in ``support/`` (importable from every test directory)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from transformers import PreTrainedTokenizerBase

from nemo_orch.envs.offline.generator import generate_conversations
from nemo_orch.models.tokenizer import load_tokenizer, render_conversation, train_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
# Tests never download: a Hugging Face Hub id they name must be in a cache they laid out.
os.environ["HF_HUB_OFFLINE"] = "1"

# Property-based tests draw the same examples on every run (CI never flakes on a new draw; a
# failure reproduces) and keep no example database in the checkout.
settings.register_profile("nemo-orch", derandomize=True, database=None, deadline=None)
settings.load_profile("nemo-orch")


@pytest.fixture(scope="session")
def offline_conversations() -> list[dict[str, Any]]:
    return generate_conversations(300, seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(
    offline_conversations: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    directory = tmp_path_factory.mktemp("tok")
    texts = (render_conversation(c["messages"], c["tools"]) for c in offline_conversations)
    train_tokenizer(texts, vocab_size=1000, min_frequency=2, out_dir=directory)
    return directory


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def random_policy_dir(tiny_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 in HF format with the test tokenizer: a policy to roll out."""
    import shutil

    from nemo_orch.config import ModelConfig
    from nemo_orch.models.hf_mapping import SeededHFWeights, save_hf_checkpoint

    model = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        vocab_size=1024,
        max_position_embeddings=1024,
    )
    directory = save_hf_checkpoint(
        tmp_path_factory.mktemp("policy"), SeededHFWeights(model, seed=0), model
    )
    for file in tiny_tokenizer_dir.iterdir():
        shutil.copy(file, directory / file.name)
    return directory


@pytest.fixture(scope="session")
def megatron_world():
    """A single-rank Megatron world in this process (gloo on 127.0.0.1)."""
    from nemo_orch import distributed
    from nemo_orch.config import ParallelConfig

    context = distributed.initialize(ParallelConfig(), seed=0)
    yield context
    distributed.shutdown()


@pytest.fixture(scope="session")
def start_checkpoint(tiny_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two SFT steps of the tiny long-context model: a checkpoint (with its tokenizer) for
    ``nemo-orch grpo trainer.init_from=``.

    Trained as users train, from a directory of its own with paths relative to it (its saved
    config names ``tokenizer`` and ``runs/``): every test that uses it from elsewhere checks
    that a checkpoint works from any working directory."""
    import shutil

    from support.cli_helpers import TINY_LONG_MODEL, run_cli, small_sft_overrides

    out = tmp_path_factory.mktemp("start")
    shutil.copytree(tiny_tokenizer_dir, out / "tokenizer")
    run_cli(
        "sft",
        *small_sft_overrides(Path("tokenizer"), Path("runs"), "sft"),
        *TINY_LONG_MODEL,
        "trainer.max_steps=2",
        "trainer.optim.warmup_steps=1",
        cwd=out,
    )
    return out / "runs" / "sft" / "checkpoints" / "step_2"


@pytest.fixture(scope="session")
def tiny_main_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """``nemo-orch train`` with a few steps of each stage (``TINY_MAIN_JOB``), run as a newcomer
    runs ``make train``: from a directory of its own, whose ``runs/latest`` is the run. Its
    directory and the completed process."""
    from support.cli_helpers import TINY_MAIN_JOB, run_cli

    directory = tmp_path_factory.mktemp("main_job")
    return directory, run_cli("train", *TINY_MAIN_JOB, cwd=directory)


@pytest.fixture(scope="session")
def toolscale_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline ToolScale domains (shop, clinic, mobile), 6 tasks each."""
    from nemo_orch.envs.toolscale.generator import write_offline

    directory = tmp_path_factory.mktemp("toolscale")
    write_offline(directory, 6, 0)
    return directory


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Path]:
    """The one-node SLURM of ``scripts/slurm_local.sh`` (its ``slurm.conf``, also in
    ``SLURM_CONF`` for the session): reused when already up (``.ci/run`` starts it), else
    started here (installed first where this is a root machine with apt) and stopped after.
    Skips, saying why, where SLURM is absent and cannot be installed."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "slurm_local.sh"
    started = subprocess.run([script, "status"]).returncode != 0
    if started:
        up = subprocess.run([script, "up"], capture_output=True, text=True)
        if up.returncode == 3:
            pytest.skip(up.stderr.strip().splitlines()[-1])
        assert up.returncode == 0, f"scripts/slurm_local.sh up failed:\n{up.stderr}"
    conf = Path(
        subprocess.run([script, "env"], capture_output=True, text=True, check=True)
        .stdout.strip()
        .partition("=")[2]
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", str(conf))
        yield conf
    if started:
        subprocess.run([script, "down"], check=True)
