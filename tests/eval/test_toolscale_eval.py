"""The offline ToolScale set from the command line: `synth --offline` writes it, `eval
--benchmark toolscale --agent gold-replay` replays every task through the toolbox (1.0), and bad
task files and domains are clear errors."""

from __future__ import annotations

import json

from cli_helpers import run_cli


def test_offline_synth_then_gold_replay(tmp_path):
    data = tmp_path / "toolscale"
    made = run_cli("synth", "--offline", "--tasks-per-domain", "40", "--seed", "5",
                   f"synth.out_dir={data}")
    assert "shop: 13 tools, 40 tasks" in made.stdout
    summary = json.loads((data / "summary.json").read_text())
    assert [d["name"] for d in summary["domains"]] == ["shop", "clinic", "mobile"]
    again = tmp_path / "again"
    run_cli("synth", "--offline", "--tasks-per-domain", "40", "--seed", "5",
            f"synth.out_dir={again}")
    for domain in ("shop", "clinic", "mobile"):
        assert ((data / domain / "tasks.jsonl").read_bytes()
                == (again / domain / "tasks.jsonl").read_bytes())
        out = tmp_path / f"eval-{domain}"
        result = run_cli("eval", "--benchmark", "toolscale", "--domain", domain, "--data",
                         str(data), "--agent", "gold-replay", "--out", str(out))
        assert "pass rate 1.000 (40/40 tasks)" in result.stdout
        report = json.loads((out / "report.json").read_text())
        assert report["accuracy"] == 1.0 and len(report["results"]) == 40
        assert report["calls_per_task"] > 1 and report["accuracy_ci95"][0] > 0.9
        assert "| 3 | 1.000 |" in (out / "report.md").read_text()


def test_bad_data_is_a_clear_error(tmp_path):
    data = tmp_path / "toolscale"
    run_cli("synth", "--offline", "--tasks-per-domain", "3", f"synth.out_dir={data}")
    tasks = data / "shop" / "tasks.jsonl"
    lines = tasks.read_text().splitlines()
    lines[1] = lines[1].replace('"user_scenario"', '"user_scenari0"')
    tasks.write_text("\n".join(lines) + "\n")
    broken = run_cli("eval", "--benchmark", "toolscale", "--domain", "shop", "--data",
                     str(data), "--agent", "gold-replay", expect=2)
    assert f"{tasks}:2: user_scenario: Field required" in broken.stderr
    # A task whose gold action fails is dropped and reported, never scored.
    lines[1] = lines[1].replace('"user_scenari0"', '"user_scenario"')
    record = json.loads(lines[2])
    record["evaluation_criteria"]["actions"].append(
        {"action_id": "x", "name": "cancel_pending_order", "arguments": {"order_id": "#O999"}})
    lines[2] = json.dumps(record)
    tasks.write_text("\n".join(lines) + "\n")
    out = tmp_path / "eval"
    run_cli("eval", "--benchmark", "toolscale", "--domain", "shop", "--data", str(data),
            "--agent", "gold-replay", "--out", str(out))
    report = json.loads((out / "report.json").read_text())
    assert report["tasks"] == 2 and report["accuracy"] == 1.0
    assert [(d["task_id"], d["filter"]) for d in report["dropped"]] == [
        (record["id"], "execution")]
    assert "no orders record" in (out / "report.md").read_text()
    missing = run_cli("eval", "--benchmark", "toolscale", "--domain", "bank", "--data",
                      str(data), "--agent", "gold-replay", expect=2)
    assert "no domain.json" in missing.stderr
