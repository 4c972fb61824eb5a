"""The offline ToolScale set from the command line: `synth --offline` writes it, `eval
--benchmark toolscale --agent gold-replay` replays every task through the toolbox (1.0), and bad
task files and domains are clear errors."""

from __future__ import annotations

import json

from support.cli_helpers import run_cli, run_cli_here


def test_offline_synth_then_gold_replay(tmp_path):
    data = tmp_path / "toolscale"
    made = run_cli(
        "synth", "--offline", "--tasks-per-domain", "40", "--seed", "5", f"synth.out_dir={data}"
    )
    assert "shop: 13 tools, 40 tasks" in made.stdout
    summary = json.loads((data / "summary.json").read_text())
    assert [d["name"] for d in summary["domains"]] == ["shop", "clinic", "mobile"]
    again = tmp_path / "again"
    run_cli(
        "synth", "--offline", "--tasks-per-domain", "40", "--seed", "5", f"synth.out_dir={again}"
    )
    for domain in ("shop", "clinic", "mobile"):
        assert (data / domain / "tasks.jsonl").read_bytes() == (
            again / domain / "tasks.jsonl"
        ).read_bytes()
    out = tmp_path / "eval"
    result = run_cli(
        "eval",
        "--benchmark",
        "toolscale",
        "--agent",
        "gold-replay",
        f"env.path={data}",
        f"eval.out_dir={out}",
    )
    assert result.stdout.splitlines()[-1].split()[:3] == ["gold-replay", "120", "1.000"]
    row = json.loads((out / "report.json").read_text())["systems"]["gold-replay"]
    assert row["accuracy"] == 1.0 and row["tasks"] == 120
    assert row["calls_per_task"] > 1 and row["accuracy_ci95"][0] > 0.95
    assert {"shop/", "clinic/", "mobile/"} == {
        line.split('"task_id": "')[1].split("/")[0] + "/"
        for line in (out / "episodes" / "gold-replay.jsonl").read_text().splitlines()[1:]
    }


def test_bad_data_is_a_clear_error(tmp_path):
    data = tmp_path / "toolscale"
    run_cli_here("synth", "--offline", "--tasks-per-domain", "3", f"synth.out_dir={data}")
    tasks = data / "shop" / "tasks.jsonl"
    lines = tasks.read_text().splitlines()
    lines[1] = lines[1].replace('"user_scenario"', '"user_scenari0"')
    tasks.write_text("\n".join(lines) + "\n")
    shop = (
        "eval",
        "--benchmark",
        "toolscale",
        "--agent",
        "gold-replay",
        f"env.path={data}",
        "env.domain=shop",
    )
    broken = run_cli_here(*shop, expect=2)
    assert f"{tasks}:2: user_scenario: Field required" in broken.stderr
    # A task whose gold action fails is dropped and reported, never scored.
    lines[1] = lines[1].replace('"user_scenari0"', '"user_scenario"')
    record = json.loads(lines[2])
    record["evaluation_criteria"]["actions"].append(
        {"action_id": "x", "name": "cancel_pending_order", "arguments": {"order_id": "#O999"}}
    )
    lines[2] = json.dumps(record)
    tasks.write_text("\n".join(lines) + "\n")
    out = tmp_path / "eval"
    run_cli_here(*shop, f"eval.out_dir={out}")
    report = json.loads((out / "report.json").read_text())
    assert report["systems"]["gold-replay"]["tasks"] == 2
    assert report["systems"]["gold-replay"]["accuracy"] == 1.0
    assert [(d["task_id"], d["filter"]) for d in report["notes"]["dropped"]] == [
        (record["id"], "execution")
    ]
    assert "no orders record" in (out / "report.md").read_text()
    missing = run_cli_here(
        "eval",
        "--benchmark",
        "toolscale",
        "--agent",
        "gold-replay",
        f"env.path={data}",
        "env.domain=bank",
        expect=2,
    )
    assert "no domain.json" in missing.stderr
    offline = run_cli_here("eval", "--benchmark", "offline", "--agent", "gold-replay", expect=2)
    assert "gold-replay needs gold actions" in offline.stderr
