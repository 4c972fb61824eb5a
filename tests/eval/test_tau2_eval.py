"""``nemo-orch eval --benchmark tau2``: the gold replay through the command line, scored by
tau2's own evaluator, its reports and its user errors."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("tau2")

from nemo_orch.cli import EXIT_USER_ERROR, main  # noqa: E402

pytestmark = pytest.mark.tau2


def _eval(*overrides: str, agent: str = "gold-replay") -> int:
    return main(["eval", "--benchmark", "tau2", "--agent", agent, *overrides])


def _episodes(out) -> list[dict]:
    lines = (out / "episodes" / "gold-replay.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[1:]]


def test_the_first_tasks_pass_and_are_reported(tmp_path, capsys):
    out = tmp_path / "report"
    assert _eval("env.domain=retail", "env.split=train", "env.limit=3",
                 f"eval.out_dir={out}") == 0
    report = json.loads((out / "report.json").read_text())
    row = report["systems"]["gold-replay"]
    assert report["benchmark"] == "tau2"
    assert (row["tasks"], row["correct"], row["accuracy"]) == (3, 3, 1.0)
    first, _, third = _episodes(out)
    assert first["task_id"] == "tau2-retail-0" and first["outcome"]["correct"]
    scored = first["details"]["tau2"]
    assert scored["reward"] == 1.0 and scored["failures"] == []
    assert scored["breakdown"]["components"] == {"DB": 1.0, "COMMUNICATE": 1.0}
    assert all(check["matched"] for check in scored["breakdown"]["actions"])
    # A gold action may fail inside tau2 itself (here: a product id that does not exist).
    assert [call["error"] for turn in third["episode"]["ledger"] for call in turn["calls"]
            if call["error"]] == ["Product not found"]
    assert "| gold-replay * | 3 | 1.000" in (out / "report.md").read_text()
    assert "gold-replay" in capsys.readouterr().out


def test_the_report_goes_under_the_run_output_dir_by_default(tmp_path):
    assert _eval("env.domain=retail", "env.split=train", "env.limit=1",
                 f"run.output_dir={tmp_path}") == 0
    report = json.loads((tmp_path / "eval" / "tau2" / "report.json").read_text())
    assert report["systems"]["gold-replay"]["accuracy"] == 1.0


def test_a_full_telecom_split_passes(tmp_path):
    assert _eval("env.domain=telecom", "env.split=train", f"eval.out_dir={tmp_path}") == 0
    row = json.loads((tmp_path / "report.json").read_text())["systems"]["gold-replay"]
    assert (row["tasks"], row["correct"]) == (74, 74)
    # The user's gold actions ran on the user-side tools (telecom), and are counted.
    assert "toggle_airplane_mode" in row["tool_mix"]


@pytest.mark.parametrize("overrides, message", [
    (["env.domain=shopping"], "unknown tau2 domain 'shopping'"),
    (["env.domain=retail", "env.split=dev"], "tau2 domain 'retail' has no split 'dev'"),
    (["env.domain=retail", "env.limit=0"], "env.limit must be null or >= 1"),
    (["env.domain=null"], "a tau2 environment needs its domain"),
    (["env.domain=retail", "eval.domain=retail"], "eval.domain is now env.domain"),
])
def test_user_errors_exit_2_with_a_message(overrides, message, tmp_path, capsys):
    assert _eval(*overrides, f"eval.out_dir={tmp_path}") == EXIT_USER_ERROR
    assert message in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


def test_unknown_choices_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--benchmark", "tau3", "--agent", "gold-replay"])
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err
