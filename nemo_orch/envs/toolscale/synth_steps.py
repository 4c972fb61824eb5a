"""How a ToolScale synthesis step is run: one LLM call whose reply is parsed as JSON and checked,
sent back with the error up to ``max_retries`` times, cached on disk and counted against the
budget.

The pipeline (:mod:`.synth`) says which steps run in which order and the checks of each reply
live in :mod:`.synth_checks`; this is the machinery every step shares: the prompts, the cache
keyed by a hash of the request, the retries, ``max_llm_calls`` / ``max_usd`` and the usage.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from string import Template
from typing import Any, NoReturn, TypeVar

from nemo_orch.clients.openai import OpenAIClient
from nemo_orch.clients.openai_replies import ChatResult
from nemo_orch.config import SynthConfig
from nemo_orch.data.jsonl import DataError

log = logging.getLogger(__name__)

PROMPTS = Path(__file__).with_name("prompts")
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)
_THINKING = re.compile(r"\A\s*<think>.*?</think>", re.DOTALL)

T = TypeVar("T")


class SynthError(DataError):
    """A step whose replies never validated; the message names the step."""


class InvalidOutput(ValueError):
    """A reply that does not parse or check; the message is what the model is told."""


class BudgetExhausted(Exception):
    """No request may be sent any more (``synth.max_llm_calls`` or ``synth.max_usd``)."""


@dataclass
class Usage:
    """This run's LLM requests (retries included), steps answered from the cache, tokens and
    USD; a rerun counts only what it sends."""

    calls: int = 0
    retries: int = 0
    cached: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    usd: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "usd": round(self.usd, 6)}


# ---------------------------------------------------------------------- replies and prompts
def parse_json(text: str) -> Any:
    """The JSON value of a reply: the whole text or, when it does not start as an object, the
    inside of its ```json fence (after a leading ``<think>`` block, which reasoning models
    served without a reasoning parser emit)."""
    text = _THINKING.sub("", text).strip()
    fenced = None if text.startswith("{") else _FENCE.search(text)
    try:
        return json.loads(fenced.group(1) if fenced else text)
    except json.JSONDecodeError as error:
        raise InvalidOutput(
            f"not valid JSON ({error.msg} at line {error.lineno} column {error.colno})"
        ) from None


def render(name: str, /, **inputs: Any) -> str:
    """The prompt ``prompts/<name>.txt`` with its ``$inputs`` (non-strings as JSON)."""
    template = Template((PROMPTS / f"{name}.txt").read_text(encoding="utf-8"))
    return template.substitute(
        {
            key: value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            for key, value in inputs.items()
        }
    )


def _read_entry(path: Path) -> dict[str, Any] | None:
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        log.warning("%s: unreadable cache entry (%s); asking again", path, error)
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("raw"), str) else None


def _write_entry(path: Path, entry: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(entry, ensure_ascii=False, indent=1), encoding="utf-8")
    os.replace(partial, path)  # a kill leaves the entry whole or absent, never half written


class Steps:
    """Runs steps: the cache, retries with the error sent back, the budget and the usage."""

    def __init__(self, config: SynthConfig, client: OpenAIClient, cache_dir: Path) -> None:
        self.config, self.client, self.cache_dir = config, client, cache_dir
        self.usage = Usage()
        self.stopped: str | None = None
        self._slots = asyncio.Semaphore(config.concurrency)

    def _key(self, step: str, messages: list[dict[str, str]]) -> str:
        request = {
            "step": step,
            "model": self.config.model,
            "messages": messages,
            "temperature": self.config.temperature,
            "max_tokens": self.config.max_tokens,
        }
        canonical = json.dumps(request, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(canonical.encode()).hexdigest()[:24]

    async def run(self, step: str, where: str, check: Callable[[Any], T], **inputs: Any) -> T:
        """The checked reply to ``step``'s prompt with ``inputs``: from the cache, or asked
        for (again with the error, at most ``max_retries`` times). ``check`` returns the
        result as JSON, which is cached beside the raw reply."""
        messages = [
            {"role": "system", "content": render("system")},
            {"role": "user", "content": render(step, **inputs)},
        ]
        path = self.cache_dir / step / f"{self._key(step, messages)}.json"
        entry = _read_entry(path)
        if entry is not None:
            try:
                result = check(parse_json(entry["raw"]))
            except (InvalidOutput, DataError) as error:
                log.warning(
                    "synth %s (%s): the cached reply no longer checks (%s); asking again",
                    step,
                    where,
                    error,
                )
            else:
                self.usage.cached += 1
                return result
        rejected: list[dict[str, str]] = []
        for attempt in range(self.config.max_retries + 1):
            reply = await self._ask(messages, retry=attempt > 0)
            try:
                result = check(parse_json(reply.text))
            except (InvalidOutput, DataError) as error:
                rejected.append({"raw": reply.text, "error": str(error)})
                messages = [
                    *messages,
                    {"role": "assistant", "content": reply.text},
                    {"role": "user", "content": render("retry", error=str(error))},
                ]
                continue
            _write_entry(
                path,
                {
                    "step": step,
                    "where": where,
                    "model": self.config.model,
                    "raw": reply.text,
                    "result": result,
                    "rejected": rejected,
                },
            )
            log.info("synth %s (%s): done in %d request(s)", step, where, attempt + 1)
            return result
        raise SynthError(
            f"synth step {step!r} ({where}): no valid output in {len(rejected)} "
            f"attempts (synth.max_retries={self.config.max_retries}); last error: "
            f"{rejected[-1]['error']}"
        )

    async def _ask(self, messages: list[dict[str, str]], retry: bool) -> ChatResult:
        config, usage = self.config, self.usage
        async with self._slots:
            # Requests are counted when sent (exact under concurrency); USD when answered, so
            # the requests in flight may overshoot max_usd.
            if config.max_llm_calls is not None and usage.calls >= config.max_llm_calls:
                self._stop(f"synth.max_llm_calls={config.max_llm_calls} reached")
            if config.max_usd is not None and usage.usd >= config.max_usd:
                self._stop(f"synth.max_usd={config.max_usd:g} reached (${usage.usd:.4f} spent)")
            usage.calls += 1
            usage.retries += retry
            reply = await self.client.chat(
                messages, temperature=config.temperature, max_tokens=config.max_tokens
            )
        usage.input_tokens += reply.input_tokens
        usage.output_tokens += reply.output_tokens
        usage.usd += (
            reply.input_tokens * config.input_usd_per_million
            + reply.output_tokens * config.output_usd_per_million
        ) / 1e6
        return reply

    def _stop(self, reason: str) -> NoReturn:
        self.stopped = self.stopped or reason
        raise BudgetExhausted(reason)


async def gather_within_budget(work: Sequence[Awaitable[T]]) -> list[T]:
    """The results of ``work`` run together, in order, less those the budget stopped; another
    failure is raised once all are done (what finished is cached for the rerun)."""
    results = await asyncio.gather(*work, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, BudgetExhausted):
            raise result
    return [result for result in results if not isinstance(result, BudgetExhausted)]
