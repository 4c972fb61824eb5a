"""The command line's layout: each command group's module (``nemo_orch/cli/``) registers its
commands, and the top-level help lists every one of them."""

from __future__ import annotations

import pytest

from nemo_orch import cli

# Each command the help lists, with the group module that owns it and a command line that parses.
COMMANDS = {
    "train": ("train", ["train"]),
    "sft": ("train", ["sft"]),
    "grpo": ("train", ["grpo"]),
    "dpo": ("train", ["dpo"]),
    "export": ("model", ["export", "--format", "hf", "--checkpoint", "c", "--out", "o"]),
    "import": ("model", ["import", "--format", "hf", "--hf-dir", "h", "--out", "o"]),
    "tools": ("tools", ["tools", "list"]),
    "rollout": ("rollout", ["rollout", "--tasks", "t.jsonl", "--out", "o.jsonl"]),
    "eval": ("eval", ["eval", "--benchmark", "offline", "--agent", "random"]),
    "serve": ("serve", ["serve", "reward"]),
    "synth": ("data", ["synth", "--offline"]),
    "plan": ("launch", ["plan"]),
    "launch": ("launch", ["launch", "--dryrun"]),
    "index": ("data", ["index", "build", "--corpus", "c.jsonl", "--out", "o"]),
}


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    usage = capsys.readouterr().out.split("\n\n")[0]
    assert "{" + ",".join(COMMANDS) + "}" in "".join(usage.split())


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_is_handled_by_its_groups_module(command):
    group, argv = COMMANDS[command]
    args = cli.parse_args(argv)
    assert args.command == command
    assert args.handler.__module__ == f"nemo_orch.cli.{group}"


@pytest.mark.parametrize(
    "group, subcommands",
    [
        ("tools", ["list", "call", "parse"]),
        ("serve", ["reward", "tool", "orchestrator", "mcp"]),
        ("index", ["build", "import"]),
    ],
)
def test_nested_commands_are_listed(group, subcommands, capsys):
    with pytest.raises(SystemExit):
        cli.main([group, "--help"])
    assert "{" + ",".join(subcommands) + "}" in "".join(capsys.readouterr().out.split())


def test_eval_compare_is_a_parse_path_of_eval():
    """``eval compare RUN...`` parses to a command that loads no config; ``eval``'s own
    overrides still take a word ``compare`` after its options."""
    args = cli.parse_args(["eval", "compare", "a", "b=c"])
    assert args.command == "eval" and args.runs == ["a", "b=c"]
    assert args.run_without_config.__module__ == "nemo_orch.cli.eval"
    assert not hasattr(args, "handler")
    later = cli.parse_args(["eval", "--benchmark", "offline", "--agent", "random", "compare"])
    assert later.overrides == ["compare"] and not hasattr(later, "run_without_config")
