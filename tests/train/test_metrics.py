"""MetricsLogger: metrics.jsonl and the optional Weights & Biases run (offline: no network)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from nemo_orch import config as config_lib
from nemo_orch.config import ConfigError
from nemo_orch.train.metrics import MetricsLogger, wandb_run_id


@pytest.fixture
def wandb_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """wandb, kept offline and quiet, with its home-directory files under tmp_path."""
    wandb = pytest.importorskip("wandb")
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_ERROR_REPORTING": "false",  # no Sentry reports
        "WANDB_X_DISABLE_STATS": "true",  # no system-metrics sampler
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield wandb
    wandb.teardown()  # stop the wandb-core service this test started


def logged_steps(run_dir: Path, start_step: int, steps: range, **wandb_options) -> None:
    logger = MetricsLogger(
        run_dir, enabled=True, start_step=start_step, max_steps=steps.stop - 1, **wandb_options
    )
    for step in steps:
        logger.log(step, {"loss": 1.0 / step, "tokens": 64})
    logger.close()


def wandb_history(run_file: Path) -> list[dict[str, float]]:
    """The history records of a ``.wandb`` log, read with wandb's internal reader (pinned)."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    store, rows = DataStore(), []
    store.open_for_scan(str(run_file))
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def test_wandb_offline_run_holds_the_logged_steps_and_resumes_the_same_id(
    wandb_offline, tmp_path: Path
):
    run_dir = tmp_path / "run"
    options = dict(
        wandb_project="nemo-orch-test",
        wandb_mode="offline",
        run_name="tiny",
        config={"run": {"name": "tiny"}, "trainer": {"lr": 0.5}},
    )
    logged_steps(run_dir, 0, range(1, 4), **options)
    logged_steps(run_dir, 3, range(4, 6), **options)  # resumed from step 3
    # finish() can return before the wandb-core service has flushed the .wandb file; stopping the
    # service waits for it, as process exit does.
    wandb_offline.teardown()

    # One offline run directory per attempt (a second one started within the same second gets a
    # "-1" suffix), both holding the same run id, so `wandb sync` continues a single W&B run.
    run_files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [path.name for path in run_files] == [f"run-{wandb_run_id(run_dir)}.wandb"] * 2
    assert all(path.stat().st_size > 0 for path in run_files)
    # Attempt order by first step: directory names do not sort by attempt ("-1" sorts first).
    attempts = sorted(map(wandb_history, run_files), key=lambda rows: rows[0]["_step"])
    history = [row for rows in attempts for row in rows]
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["_step"] for row in history] == [row["step"] for row in jsonl] == [1, 2, 3, 4, 5]
    assert [row["train/loss"] for row in history] == [row["loss"] for row in jsonl]
    assert {"train/tokens", "train/tokens_per_s"} <= history[0].keys()


def test_no_project_creates_nothing_wandb_related(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("WANDB_MODE", "offline")  # a regression would at least stay offline
    run_dir = tmp_path / "run"
    logged_steps(run_dir, 0, range(1, 3))
    assert sorted(path.name for path in run_dir.iterdir()) == ["metrics.jsonl", "tensorboard"]
    assert not list(tmp_path.rglob("*wandb*"))


def test_missing_wandb_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match="pip install"):
        MetricsLogger(tmp_path, enabled=True, start_step=0, max_steps=1, wandb_project="p")


def test_wandb_mode_is_validated():
    assert config_lib.load().run.wandb_mode == "offline"
    with pytest.raises(ConfigError, match="run.wandb_mode"):
        config_lib.load(["run.wandb_mode=bogus"])


def test_the_progress_bar_names_its_stage_and_shows_its_metrics(tmp_path, capsys):
    logger = MetricsLogger(
        tmp_path,
        enabled=True,
        start_step=0,
        max_steps=2,
        stage="grpo",
        shown=("reward", "kl", "loss"),
    )
    logger.log(1, {"reward": 0.625, "kl": 0.0125, "loss": 0.5, "tokens": 64})
    logger.log(2, {"reward": 0.75, "loss": 0.25, "tokens": 64})  # a metric may be missing
    logger.close()
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert any(
        line.startswith("grpo:") and "reward=0.6250, kl=0.0125, loss=0.5000, tok_s=" in line
        for line in bar
    )
    assert "grpo: 100%" in bar[-1] and "reward=0.7500, loss=0.2500" in bar[-1]
