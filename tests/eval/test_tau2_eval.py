"""``nemo-orch eval --benchmark tau2``: the gold replay through the command line, its reports and
its user errors."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("tau2")

from nemo_orch.cli import EXIT_USER_ERROR, main  # noqa: E402

pytestmark = pytest.mark.tau2


def _eval(*args: str) -> int:
    return main(["eval", "--benchmark", "tau2", "--agent", "gold-replay", *args])


def test_the_first_tasks_pass_and_are_reported(tmp_path, capsys):
    out = tmp_path / "report"
    assert _eval("--domain", "retail", "--split", "train", "--limit", "3",
                 "--out", str(out)) == 0
    report = json.loads((out / "report.json").read_text())
    assert {key: report[key] for key in ("benchmark", "domain", "split", "agent", "tasks",
                                         "passed", "pass_rate")} == {
        "benchmark": "tau2", "domain": "retail", "split": "train", "agent": "gold-replay",
        "tasks": 3, "passed": 3, "pass_rate": 1.0}
    first = report["results"][0]
    assert first["task_id"] == "tau2-retail-0" and first["reward"] == 1.0 and first["passed"]
    assert first["failures"] == [] and first["breakdown"]["components"] == {"DB": 1.0,
                                                                           "COMMUNICATE": 1.0}
    assert all(check["matched"] for check in first["breakdown"]["actions"])
    # A gold action may fail inside tau2 itself (here: a product id that does not exist).
    assert report["results"][2]["tool_errors"] == [
        "assistant.get_product_details: Error: Product not found"]
    assert "Pass rate **1.000** (3/3 tasks)" in (out / "report.md").read_text()
    assert "pass rate 1.000 (3/3 tasks)" in capsys.readouterr().out


def test_the_report_goes_under_the_run_output_dir_by_default(tmp_path):
    assert _eval("--domain", "retail", "--split", "train", "--limit", "1",
                 f"run.output_dir={tmp_path}") == 0
    report = json.loads(
        (tmp_path / "eval" / "tau2-retail-train-gold-replay" / "report.json").read_text())
    assert report["tasks"] == 1 and report["pass_rate"] == 1.0


def test_a_full_telecom_split_passes(tmp_path):
    assert _eval("--domain", "telecom", "--split", "train", "--out", str(tmp_path)) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tasks"] == 74 and report["passed"] == 74 and report["pass_rate"] == 1.0
    markdown = (tmp_path / "report.md").read_text()
    # telecom task ids contain "|", which would break the markdown table.
    assert "airplane_mode_on\\|user_abroad" in markdown


@pytest.mark.parametrize("args, message", [
    (["--domain", "shopping"], "unknown tau2 domain 'shopping'"),
    (["--domain", "retail", "--split", "dev"], "tau2 domain 'retail' has no split 'dev'"),
    (["--domain", "retail", "--limit", "0"], "limit must be >= 1"),
])
def test_user_errors_exit_2_with_a_message(args, message, tmp_path, capsys):
    assert _eval(*args, "--out", str(tmp_path)) == EXIT_USER_ERROR
    assert f"nemo-orch eval: error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize("option, value", [("--benchmark", "hle"), ("--agent", "gpt-5")])
def test_only_what_works_is_offered(option, value, capsys):
    arguments = {"--benchmark": "tau2", "--agent": "gold-replay", option: value}
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--domain", "retail", *(item for pair in arguments.items()
                                              for item in pair)])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
