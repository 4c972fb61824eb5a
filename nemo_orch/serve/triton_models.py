"""The Triton models ``nemo-orch serve`` runs: outcome scoring (``reward``) and tools.

- ``reward``: the configured :class:`~nemo_orch.reward.outcome.OutcomeScorer` (exact, numeric,
  the LLM judge, database state); the protocol is :mod:`nemo_orch.reward.remote`'s.
- one model per tool, named after it: inputs ``arguments`` and ``context`` (JSON objects, the
  latter as :func:`~nemo_orch.tools.remote.context_to_json` writes it), output ``result`` (a
  :class:`~nemo_orch.tools.base.ToolResult` as JSON, tool failures included). Calls go through
  the server's toolbox, so its concurrency bounds, timeouts and cache hold across all clients.

Items of one batch run concurrently on the server's event loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from nemo_orch.config import Config, ConfigError
from nemo_orch.reward.outcome import OutcomeScorer
from nemo_orch.reward.remote import (
    REWARD_DESCRIPTIONS,
    REWARD_INPUTS,
    REWARD_MODEL,
    REWARD_OUTPUTS,
    parse_reward_item,
)
from nemo_orch.serve.triton import BadRequest, TextModel
from nemo_orch.tools.registry import Toolbox
from nemo_orch.tools.remote import TOOL_DESCRIPTIONS, TOOL_INPUTS, TOOL_OUTPUT, context_from_json


def reward_model(config: Config) -> TextModel:
    """Outcome scoring under ``config.reward`` with the configured domains' databases."""
    from nemo_orch.reward.builders import build_scorer

    scorer = build_scorer(config)
    if not isinstance(scorer, OutcomeScorer):
        raise ConfigError(
            "reward.endpoint is set: this server would forward to another reward "
            "server; unset it here"
        )

    def parse(item: dict[str, str]) -> tuple:
        try:
            return parse_reward_item(item)
        except ValueError as error:
            raise BadRequest(str(error)) from None

    async def run(items: list[tuple]) -> list[dict[str, Any]]:
        results = await asyncio.gather(
            *(scorer.score(task, answer, calls) for task, answer, calls in items)
        )
        return [
            {
                "score": float(result.correct),
                "correct": result.correct,
                "method": result.method,
                "detail": result.detail,
            }
            for result in results
        ]

    return TextModel(REWARD_MODEL, REWARD_INPUTS, REWARD_OUTPUTS, parse, run, REWARD_DESCRIPTIONS)


def _json_object(item: dict[str, str], name: str) -> dict[str, Any]:
    try:
        value = json.loads(item[name])
    except ValueError as error:
        raise BadRequest(f"'{name}' is not JSON: {error}") from None
    except RecursionError:
        raise BadRequest(f"'{name}' nests too deeply") from None
    if not isinstance(value, dict):
        raise BadRequest(f"'{name}' must be a JSON object")
    return value


def tool_model(toolbox: Toolbox, name: str) -> TextModel:
    """The tool ``name`` of ``toolbox`` as a Triton model."""

    def parse(item: dict[str, str]) -> tuple:
        arguments, context = _json_object(item, "arguments"), _json_object(item, "context")
        try:
            return arguments, context_from_json(context)
        except (TypeError, ValueError) as error:
            raise BadRequest(f"'context' is malformed: {error}") from None

    async def run(items: list[tuple]) -> list[dict[str, Any]]:
        results = await asyncio.gather(
            *(toolbox.call(name, arguments, context) for arguments, context in items)
        )
        return [
            {TOOL_OUTPUT: json.dumps(result.to_json(), ensure_ascii=False)} for result in results
        ]

    description = {"model": " ".join(toolbox.specs[name].description.split())}
    return TextModel(
        name, TOOL_INPUTS, {TOOL_OUTPUT: bytes}, parse, run, TOOL_DESCRIPTIONS | description
    )


def tool_models(
    config: Config, names: Sequence[str]
) -> tuple[list[TextModel], list[AbstractAsyncContextManager]]:
    """The configured tools ``names`` as Triton models, and their toolbox (to be started by the
    server: sandbox workers, indexes)."""
    from nemo_orch.rollout.builders import build_toolbox

    if not names:
        raise ConfigError("name at least one tool to serve")
    toolbox = build_toolbox(config.tools).subset(names)
    return [tool_model(toolbox, name) for name in names], [toolbox]
