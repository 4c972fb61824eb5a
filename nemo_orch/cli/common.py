"""What the command groups share: registering a command with its config options, the errors a
user can fix, the exit code they get, and JSON on stdout."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

from nemo_orch import config as config_lib
from nemo_orch.config import Config

EXIT_USER_ERROR = 2

Handler: TypeAlias = Callable[[Config, argparse.Namespace], int]
ConfigLoader: TypeAlias = Callable[[argparse.Namespace], Config]


def overrides_config(args: argparse.Namespace) -> Config:
    """A command's config: the defaults with its ``key=value`` overrides."""
    return config_lib.load(args.overrides)


class CommandParser(argparse.ArgumentParser):
    """A command's parser that can hand a leading word to a parser of its own, as ``eval
    compare RUN...`` beside ``eval``'s own options and overrides: argparse's subparsers cannot sit
    beside a command's positionals without showing in its usage and help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.word_parsers: dict[str, argparse.ArgumentParser] = {}

    def parse_known_args(  # type: ignore[override]  # typeshed overloads it on namespace
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # The word's parser is strict: its errors name it (``nemo-orch eval compare: error``).
        if args and args[0] in self.word_parsers:
            return self.word_parsers[args[0]].parse_args(args[1:], namespace), []
        return super().parse_known_args(args, namespace)


Commands: TypeAlias = "argparse._SubParsersAction[CommandParser]"


def add_command(
    group: Commands,
    name: str,
    handler: Handler,
    help_text: str,
    positionals: tuple[str, ...] = (),
    load_config: ConfigLoader = overrides_config,
) -> CommandParser:
    """Register a command that takes ``key=value`` overrides and ``--print-config``; ``main``
    loads its config with ``load_config(args)`` and calls ``handler(config, args)``."""
    # help is %-formatted by argparse (hence 95%% in it), the description is not
    sub = group.add_parser(name, help=help_text, description=help_text.replace("%%", "%"))
    for positional in positionals:  # before the overrides, which take the rest
        sub.add_argument(positional)
    sub.add_argument("overrides", nargs="*", help="config overrides: key=value, group=option")
    sub.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit"
    )
    sub.set_defaults(handler=handler, load_config=load_config)
    return sub


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors that end a command with one line and :data:`EXIT_USER_ERROR` rather than a
    traceback (imported when a command runs: most live in heavy modules)."""
    from nemo_orch.call_kinds import InfrastructureError
    from nemo_orch.clients.http import HTTPError
    from nemo_orch.data.conversations import DataError
    from nemo_orch.models.checkpoint import CheckpointError
    from nemo_orch.models.tokenizer import TokenizerError
    from nemo_orch.rollout.engines.base import EngineError
    from nemo_orch.tools.base import ToolError

    return (
        config_lib.ConfigError,
        CheckpointError,
        DataError,
        TokenizerError,
        ToolError,
        EngineError,
        HTTPError,
        InfrastructureError,
        FileNotFoundError,
    )


def is_rank_zero() -> bool:
    """Under torchrun only rank 0 prints a command's summary."""
    return os.environ.get("RANK", "0") == "0"


def print_json(value: object) -> None:
    """One line of JSON: readable text, escaped where it holds what UTF-8 cannot carry (a lone
    surrogate a JSON escape in a tool call can produce)."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value)
    print(text)
