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
    assert _eval("env.domain=retail", "env.split=train", "env.limit=3", f"eval.out_dir={out}") == 0
    report = json.loads((out / "report.json").read_text())
    row = report["systems"]["gold-replay"]
    assert report["benchmark"] == "tau2"
    first, _, third = _episodes(out)
    assert first["task_id"] == "tau2-retail-0" and first["outcome"]["correct"]
    scored = first["details"]["tau2"]
    assert scored["reward"] == 1.0 and scored["failures"] == []
    assert scored["breakdown"]["components"] == {"DB": 1.0, "COMMUNICATE": 1.0}
    assert all(check["matched"] for check in scored["breakdown"]["actions"])
    # A gold action may fail inside tau2 itself (here: a product id that does not exist):
    # tau2 replays the same failure and would score it 1.0; here the episode is gold_error,
    # listed and left out of accuracy, not a pass.
    assert [
        (call["error"], call["kind"])
        for turn in third["episode"]["ledger"]
        for call in turn["calls"]
        if call["error"]
    ] == [("Product not found", "tool_error")]
    assert third["episode"]["termination"] == "gold_error"
    assert (row["tasks"], row["scored"], row["correct"], row["accuracy"]) == (3, 2, 2, 1.0)
    (decided,) = row["infra_decided_episodes"]
    assert (decided["episode"], decided["reason"]) == ("tau2-retail-2@0", "gold_error")
    assert decided["detail"] == "tool_error: Product not found"
    markdown = (out / "report.md").read_text()
    assert "| gold-replay * | 3 | 1.000 (0.342-1.000) | 1 |" in markdown
    assert "- tau2-retail-2@0: gold_error at " in markdown
    assert "gold-replay" in capsys.readouterr().out


def test_a_failing_gold_action_is_never_a_demonstration():
    from nemo_orch import config as config_lib
    from nemo_orch.envs import build_environment
    from nemo_orch.eval.harness import successful_episodes
    from nemo_orch.eval.systems import System

    config = config_lib.load(["env=tau2", "env.domain=retail", "env.split=train", "env.limit=3"])
    demonstrated = successful_episodes(
        config, build_environment(config), System("gold-replay", "gold-replay"), 3
    )
    assert sorted(t.task_id for t in demonstrated) == ["tau2-retail-0", "tau2-retail-1"]


def test_the_report_goes_under_the_run_output_dir_by_default(tmp_path):
    assert (
        _eval("env.domain=retail", "env.split=train", "env.limit=1", f"run.output_dir={tmp_path}")
        == 0
    )
    report = json.loads((tmp_path / "eval" / "tau2" / "report.json").read_text())
    assert report["systems"]["gold-replay"]["accuracy"] == 1.0


def test_a_full_telecom_split_passes(tmp_path):
    assert _eval("env.domain=telecom", "env.split=train", f"eval.out_dir={tmp_path}") == 0
    row = json.loads((tmp_path / "report.json").read_text())["systems"]["gold-replay"]
    assert (row["tasks"], row["correct"]) == (74, 74)
    # The user's gold actions ran on the user-side tools (telecom), and are counted.
    assert "toggle_airplane_mode" in row["tool_mix"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["env.domain=shopping"], "unknown tau2 domain 'shopping'"),
        (["env.domain=retail", "env.split=dev"], "tau2 domain 'retail' has no split 'dev'"),
        (["env.domain=retail", "env.limit=0"], "env.limit must be null or >= 1"),
        (["env.domain=null"], "a tau2 environment needs its domain"),
        (["env.domain=retail", "eval.domain=retail"], "eval.domain is now env.domain"),
    ],
)
def test_user_errors_exit_2_with_a_message(overrides, message, tmp_path, capsys):
    assert _eval(*overrides, f"eval.out_dir={tmp_path}") == EXIT_USER_ERROR
    assert message in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


def test_unknown_choices_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--benchmark", "tau3", "--agent", "gold-replay"])
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_pass_hat_k_is_tau2s_over_tasks():
    """pass^k of a report: tau2's own per-task formula, averaged over tasks."""
    from tau2.metrics.agent_metrics import pass_hat_k

    from nemo_orch.eval.report import EpisodeResult, pass_hat_ks

    outcomes = {
        "a": [True, True, True, False],
        "b": [False, True, False, False],
        "c": [True, True, True, True],
        "d": [False] * 4,
    }
    results = [
        EpisodeResult(task, correct, 0.0, 0.0, 1)
        for trial in range(4)
        for task, runs in outcomes.items()
        for correct in [runs[trial]]
    ]
    expected = {
        str(k): sum(pass_hat_k(4, sum(runs), k) for runs in outcomes.values()) / 4
        for k in range(1, 5)
    }
    assert pass_hat_ks(results) == pytest.approx(expected)
    assert pass_hat_ks(results)["1"] == pytest.approx(8 / 16)  # pass^1: the accuracy
    with pytest.raises(ValueError, match="as many trials of every task"):
        pass_hat_ks(results[:-1])


def test_trials_with_an_llm_user_report_pass_hat_k_and_the_protocol(
    tmp_path, random_policy_dir, tiny_tokenizer
):
    """``eval.num_trials=2`` with the user of ``env.user`` (the SIMULATED one on 127.0.0.1):
    each task twice, pass^1 and pass^2 and the protocol in report.json and report.md."""
    from support.simulated_tau2_user import MODEL, simulated_user_server

    out = tmp_path / "report"
    with simulated_user_server(tiny_tokenizer) as url:
        assert (
            _eval(
                "env.domain=mock",
                "env.limit=2",
                "eval.num_trials=2",
                f"env.user.base_url={url}",
                f"env.user.model={MODEL}",
                f"rollout.policy={random_policy_dir}",
                "rollout.max_turns=2",
                "rollout.max_new_tokens=8",
                f"eval.out_dir={out}",
                agent="orchestrator",
            )
            == 0
        )
    report = json.loads((out / "report.json").read_text())
    row = report["systems"]["orchestrator"]
    assert row["tasks"] == 4 and set(row["pass_hat_k"]) == {"1", "2"}
    assert row["pass_hat_k"]["1"] == row["accuracy"]
    episodes = [
        json.loads(line)
        for line in (out / "episodes" / "orchestrator.jsonl").read_text().splitlines()[1:]
    ]
    assert sorted((e["task_id"], e["trial"]) for e in episodes) == sorted(
        (task, trial) for task in {e["task_id"] for e in episodes} for trial in (0, 1)
    )
    assert len({e["seed"] for e in episodes}) == 4  # each trial its own seed
    assert all(e["episode"]["user"]["messages"] >= 1 for e in episodes)
    notes = report["notes"]
    assert notes["protocol"].startswith(f"LLM user {MODEL} at {url}")
    assert "max_steps 200" in notes["protocol"] and notes["split"] == "mock test"
    assert "naming no tool of the domain" in notes["protocol"]  # a difference that remains
    assert notes["submission"] == "standard (the domain's tools only)"
    markdown = (out / "report.md").read_text()
    assert "| system | pass^1 | pass^2 |" in markdown and "protocol: LLM user" in markdown
