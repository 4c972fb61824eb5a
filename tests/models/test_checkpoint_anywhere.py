"""A checkpoint works from any working directory. ``start_checkpoint`` is trained as users train,
from a directory of its own with paths relative to it, so its saved config names a tokenizer
(and the run's directory) that do not exist anywhere else: export, evaluation, serving and
``rollout.policy=`` use it from a temporary directory here (GRPO's ``trainer.init_from=`` does
in every GRPO test)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
from omegaconf import OmegaConf
from support.cli_helpers import run_cli_here

from nemo_orch import config as config_lib
from nemo_orch.models import checkpoint, convert
from nemo_orch.serve.orchestrator import start_orchestrator


def test_the_fixture_names_paths_of_the_directory_that_trained_it(
    start_checkpoint, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    saved = OmegaConf.load(start_checkpoint / checkpoint.CONFIG_FILE)
    assert saved.tokenizer.path == "tokenizer" and not Path("tokenizer").exists()
    assert saved.run.output_dir == "runs"


def test_export_from_another_directory(start_checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_cli_here("export", "--format", "hf", "--checkpoint", str(start_checkpoint), "--out", "hf")
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["num_hidden_layers"] == 2 and (tmp_path / "hf" / "tokenizer.json").exists()
    printed = OmegaConf.create(
        run_cli_here(
            "export",
            "--format",
            "hf",
            "--checkpoint",
            str(start_checkpoint),
            "--out",
            "hf",
            "--print-config",
        ).stdout
    )
    assert printed.tokenizer.path == str((start_checkpoint / "tokenizer").resolve())


def test_the_training_inputs_a_checkpoint_names_need_not_exist(start_checkpoint, tmp_path):
    """What trained a checkpoint (its data, starting weights, pairs, tasks) is not what it needs:
    a checkpoint moved away from all of them still loads, with its own model and tokenizer."""
    moved = tmp_path / "moved" / "step_2"
    shutil.copytree(start_checkpoint, moved)
    saved = OmegaConf.load(moved / checkpoint.CONFIG_FILE)
    for key, value in (
        ("data.sft_path", "runs/data/sft.jsonl"),
        ("trainer.init_from", "runs/base/checkpoints"),
        ("dpo.pairs_path", "pairs.jsonl"),
        ("env.path", "my_tasks.jsonl"),
        ("rollout.policy", "runs/other"),
    ):
        OmegaConf.update(saved, key, value)
    (moved / checkpoint.CONFIG_FILE).write_text(OmegaConf.to_yaml(saved))
    config = convert.checkpoint_config(
        checkpoint.open_checkpoint(moved), ["model.params_dtype=bfloat16"]
    )
    assert config.model.num_layers == saved.model.num_layers == 2
    assert config.model.params_dtype == "bfloat16"  # overrides come last
    assert config.tokenizer.path == str((moved / "tokenizer").resolve())
    assert config.data.sft_path is None and config.trainer.init_from is None


def test_eval_and_serve_a_checkpoint_from_another_directory(
    start_checkpoint, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    Path("tasks.jsonl").write_text(
        "".join(
            json.dumps({"id": f"t{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i)})
            + "\n"
            for i in range(2)
        )
    )
    policy = [
        f"rollout.policy={start_checkpoint}",
        "rollout.max_turns=1",
        "rollout.max_new_tokens=4",
        "model.max_position_embeddings=2560",
    ]
    run_cli_here(
        "eval",
        "--benchmark",
        "tasks",
        "--agent",
        "orchestrator",
        "env.path=tasks.jsonl",
        "eval.tasks=2",
        *policy,
    )
    (report,) = Path("runs").glob("**/report.json")
    assert json.loads(report.read_text())["systems"]["orchestrator"]["tasks"] == 2
    config = config_lib.load([*policy, "serve.http_port=0", "serve.metrics_port=null"])
    with start_orchestrator(config) as server:
        models = httpx.get(f"{server.url}/models").json()
    assert [entry["id"] for entry in models["data"]] == [config.run.name]
