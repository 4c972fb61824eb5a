"""tau2 domains from directories outside tau2 (ToolOrchestra's layout), registered in tau2's own
registry: their tools, databases and tau2's evaluator run unchanged, their tasks read from a
ToolScale parquet file in the published layout or from the directory's ``tasks.json``."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("tau2")

from support.tau2_bank import TOOLS, task_row, write_domain, write_rows  # noqa: E402
from support.tau2_replay import gold_replay_turns  # noqa: E402

from nemo_orch import config as config_lib  # noqa: E402
from nemo_orch.cli import EXIT_USER_ERROR, main  # noqa: E402
from nemo_orch.config import ConfigError  # noqa: E402
from nemo_orch.envs.tau2 import adapter  # noqa: E402
from nemo_orch.envs.tau2.adapter import (  # noqa: E402
    ASSISTANT,
    ExecutedCall,
    Tau2Error,
    Turn,
    load_domain,
    read_task_file,
    score_episode,
)
from nemo_orch.envs.tau2.external import register_domain_directory  # noqa: E402
from nemo_orch.tools.base import ToolContext  # noqa: E402

pytestmark = pytest.mark.tau2


@pytest.fixture(scope="module")
def bank_files(tmp_path_factory) -> tuple[Path, Path]:
    """The bank's directory and its tasks' parquet file (tau2's registry lives as long as the
    process: one bank directory for the whole module)."""
    parent = tmp_path_factory.mktemp("domains")
    return write_domain(parent), write_rows(parent / "train-00000-of-00001.parquet")


@pytest.fixture(scope="module")
def bank(bank_files):
    directory, rows = bank_files
    register_domain_directory(directory)
    return load_domain("bank", "test", tasks_path=rows)


def _task(domain, tau2_id):
    return next(task for task in domain.tasks if task.metadata["tau2_task"]["id"] == tau2_id)


def _eval(*overrides: str) -> int:
    return main(["eval", "--benchmark", "tau2", "--agent", "gold-replay", *overrides])


def test_gold_replay_of_the_parquet_tasks_passes_through_the_cli(bank_files, tmp_path):
    directory, rows = bank_files
    assert (
        _eval(
            "env.domain=bank",
            f"env.tau2_domains=[{directory}]",
            f"env.path={rows}",
            f"eval.out_dir={tmp_path}",
        )
        == 0
    )
    report = json.loads((tmp_path / "report.json").read_text())
    row = report["systems"]["gold-replay"]
    assert (row["tasks"], row["correct"], row["accuracy"]) == (3, 3, 1.0)
    assert row["tool_mix"] == {"deposit": 0.5, "get_balance": 0.5}
    # The weather row is not a bank task; a file is one task set, whatever env.split says.
    assert [episode["task_id"] for episode in report["episodes"]["gold-replay"]] == [
        "tau2-bank-deposit-50",
        "tau2-bank-balance-A2",
        "tau2-bank-deposit-25",
    ]
    assert "(one task set, no splits)" in report["notes"]["split"]


def documented_command(page: Path, marker: str) -> list[str]:
    """The command of ``page``'s bash blocks whose text holds ``marker``, its continuation
    lines joined, split as the shell splits it (comments dropped)."""
    commands = page.read_text().replace("\\\n", " ").splitlines()
    (command,) = [line for line in commands if marker in line and line.startswith("nemo-orch")]
    return shlex.split(command, comments=True)


def test_the_documented_toolscale_hub_command_runs_as_written(bank_files, tmp_path, monkeypatch):
    """docs/interop.md's command for ``nvidia/ToolScale``, its one placeholder path filled in,
    against an offline cache holding the published rows as two shards of one split, with the
    datasets library's metadata and the card beside them."""
    import pyarrow.parquet as pq
    from support.hub_cache import offline_hub, parquet_bytes

    directory, rows = bank_files
    published = pq.read_table(rows)
    half = published.num_rows // 2
    offline_hub(tmp_path, monkeypatch).add(
        "nvidia/ToolScale",
        {
            "data/train-00000-of-00002.parquet": parquet_bytes(published.slice(0, half)),
            "data/train-00001-of-00002.parquet": parquet_bytes(published.slice(half)),
            "data/dataset_infos.json": b'{"default": {"splits": {"train": {}}}}',
            "README.md": b"---\nlicense: cc-by-4.0\n---\n",
            ".gitattributes": b"*.parquet filter=lfs diff=lfs merge=lfs -text\n",
        },
        repo_type="dataset",
    )
    command = documented_command(
        Path(__file__).parents[2] / "docs" / "interop.md", "env.path=nvidia/ToolScale"
    )
    assert command[0] == "nemo-orch"
    arguments = [word.replace("path/to/domains/bank", str(directory)) for word in command[1:]]
    assert main([*arguments, f"eval.out_dir={tmp_path / 'report'}"]) == 0
    row = json.loads((tmp_path / "report" / "report.json").read_text())["systems"]["gold-replay"]
    assert (row["tasks"], row["correct"], row["accuracy"]) == (3, 3, 1.0)


def test_the_domain_is_tau2s_own(bank):
    """The tools are the toolkit's, with tau2's schemas; the policy is policy.md; the rows'
    nulls are dropped (the merged ``arguments`` struct's ``city`` of the weather tool)."""
    assert sorted(bank.assistant_toolbox().specs) == ["deposit", "get_balance"]
    assert bank.assistant_toolbox().specs["deposit"].parameters["required"] == [
        "account_id",
        "amount",
    ]
    assert bank.policy.startswith("# Bank policy") and bank.user_tools == []
    assert adapter.tau2_task_of(_task(bank, "deposit-50")).evaluation_criteria.actions[
        1
    ].arguments == {"account_id": "A1", "amount": 50.0}
    assert "bank" in adapter.domains() and adapter.splits("bank") == []


def test_a_wrong_deposit_scores_zero_by_tau2s_evaluator(bank):
    task = _task(bank, "deposit-50")
    turns = asyncio.run(gold_replay_turns(bank, task))
    assert score_episode(task, turns).passed
    context = ToolContext(task_id=task.id, episode_id="wrong", task=task)
    arguments = {"account_id": "A1", "amount": 5.0}
    wrong = asyncio.run(bank.assistant_toolbox().call("deposit", arguments, context))
    bank.environments.release("wrong", 0)
    assert wrong.error is None and '"balance": 105.0' in wrong.output
    turns[-2] = Turn(ASSISTANT, calls=(ExecutedCall("deposit", arguments, wrong),))
    score = score_episode(task, turns)
    assert score.reward == 0.0 and score.breakdown["db_match"] is False
    assert any("database" in failure for failure in score.failures)


def test_registering_again_is_a_no_op_and_a_taken_name_is_an_error(bank, bank_files, tmp_path):
    directory, _ = bank_files
    assert register_domain_directory(directory) == "bank"
    with pytest.raises(Tau2Error, match=f"already has a domain 'bank' \\(from {directory}\\)"):
        register_domain_directory(write_domain(tmp_path, "bank"))
    with pytest.raises(Tau2Error, match="already has a domain 'mock' \\(from tau2 itself\\)"):
        register_domain_directory(write_domain(tmp_path / "other", "mock"))


def test_relative_imports_and_the_directorys_tasks_json(tmp_path):
    """tools.py may import its data model relatively; without a task file, the domain's tasks
    are its tasks.json (tau2's own format: nulls and free-text instructions allowed)."""
    directory = write_domain(
        tmp_path, "vault", TOOLS.replace("tau2.domains.{name}.data_model", ".data_model")
    )
    tasks = [
        {
            "id": "top-up",
            "description": None,
            "initial_state": None,
            "user_scenario": {"persona": None, "instructions": "Deposit 10 into A1."},
            "evaluation_criteria": {
                "actions": [
                    {
                        "action_id": "0",
                        "name": "deposit",
                        "info": None,
                        "arguments": {"account_id": "A1", "amount": 10.0},
                    }
                ],
                "communicate_info": [],
                "reward_basis": ["DB"],
            },
        }
    ]
    (directory / "tasks.json").write_text(json.dumps(tasks))
    assert register_domain_directory(directory) == "vault"
    vault = load_domain("vault", "train")  # no splits: every split names the one task set
    (task,) = vault.tasks
    assert task.id == "tau2-vault-top-up"
    assert score_episode(task, asyncio.run(gold_replay_turns(vault, task))).passed
    empty = write_domain(tmp_path, "empty_vault")
    register_domain_directory(empty)
    with pytest.raises(Tau2Error, match=f"'empty_vault' has no tasks: no {empty}/tasks.json"):
        load_domain("empty_vault", "test")


def _unlink_policy(directory: Path) -> None:
    (directory / "policy.md").unlink()


def _raise_in_tools(directory: Path) -> None:
    (directory / "tools.py").write_text(
        "import json\n\nraise RuntimeError('the tools are broken')\n"
    )


@pytest.mark.parametrize(
    "name, breaks, message",
    [
        ("no_policy", _unlink_policy, "{d}/policy.md: no such file"),
        (
            "tools_raise",
            _raise_in_tools,
            "{d}/tools.py:3: cannot import the tau2 domain's tools.py: "
            "RuntimeError: the tools are broken",
        ),
    ],
    ids=["no_policy", "tools_raise"],
)
def test_a_broken_directory_exits_2_naming_the_file(name, breaks, message, tmp_path, capsys):
    directory = write_domain(tmp_path.resolve(), name)
    breaks(directory)
    assert (
        _eval(
            f"env.domain={name}",
            f"env.tau2_domains=[{directory}]",
            f"eval.out_dir={tmp_path / 'out'}",
        )
        == EXIT_USER_ERROR
    )
    assert message.format(d=directory) in capsys.readouterr().err
    assert f"tau2.domains.{name}" not in sys.modules and name not in adapter.domains()


@pytest.mark.parametrize(
    "name, part, content, message",
    [
        (
            "no_toolkit",
            "tools.py",
            "from tau2.environment.toolkit import ToolKitBase\n",
            "tools.py: a tau2 domain's tools.py defines exactly one ToolKitBase subclass; found none",
        ),
        (
            "two_dbs",
            "data_model.py",
            "from tau2.environment.db import DB\n\n\nclass A(DB):\n"
            "    pass\n\n\nclass B(DB):\n    pass\n",
            "data_model.py: a tau2 domain's data_model.py defines exactly one DB subclass; found A, B",
        ),
        (
            "bad_db",
            "db.json",
            '{"accounts": {"A1": {"account_id": "A1"}}}',
            "db.json: not a BankDB database",
        ),
        ("bad_syntax", "data_model.py", "def broken(:\n", "data_model.py:1: cannot import"),
    ],
    ids=["no_toolkit", "two_dbs", "bad_db", "bad_syntax"],
)
def test_a_domain_tau2_cannot_build_is_an_error_naming_the_file(
    name, part, content, message, tmp_path
):
    directory = write_domain(tmp_path.resolve(), name)
    (directory / part).write_text(content)
    with pytest.raises(Tau2Error, match=f"^{directory}/{message}"):
        register_domain_directory(directory)
    assert f"tau2.domains.{name}" not in sys.modules


def test_task_file_errors_name_the_file_and_row(tmp_path):
    rows = [task_row("ok", "bank", [], []), task_row("bad", "bank", [], [])]
    rows[1]["evaluation_criteria"]["actions"] = [{"action_id": "0", "arguments": {}}]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(
        Tau2Error,
        match=r"rows.json\[row 1\]: not a tau2 task: evaluation_"
        r"criteria.actions.0.name: Field required",
    ):
        read_task_file(path, "bank", {})
    with pytest.raises(
        Tau2Error,
        match="no task of tau2 domain 'safe'; its rows name bank "
        r"\(2\)",
    ):
        read_task_file(path, "safe", {})


def test_config_keeps_tau2_domains_to_tau2(tmp_path):
    with pytest.raises(ConfigError, match="a toolscale environment has no option tau2_domains"):
        config_lib.load(["env=toolscale", f"env.tau2_domains=[{tmp_path}]"])
    with pytest.raises(ConfigError, match=r"env.tau2_domains\[0\]: no such directory"):
        config_lib.load(["env=tau2", f"env.tau2_domains=[{tmp_path / 'missing'}]"])
    config = config_lib.load(["env=tau2", f"env.tau2_domains=[{tmp_path}]"])
    assert config.env.tau2_domains == [str(tmp_path)] and config.env.path is None
