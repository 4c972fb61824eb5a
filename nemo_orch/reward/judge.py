"""LLM-judge templates: how the judge is asked whether an answer is right, and how its reply is
read.

A template is ``conf/reward/judges/NAME.yaml`` (``reward.judge_template`` names it) with the keys
of :class:`JudgeTemplate`: a one-line ``description`` for reports, the ``system`` message (null:
none), the user ``prompt`` (a :meth:`str.format` template over exactly ``{question}``,
``{reference}`` and ``{response}``), the ``parser`` of the reply (a name in :data:`PARSERS`) and
the request's ``temperature``, ``max_tokens`` and ``response_format`` (null: not sent). Shipped:
``default`` (nemo-orch's one-word verdict), ``reference`` (ToolOrchestra's ``<correct>`` tag) and
``hle_official`` (the official HLE judge's structured output).

A parser maps the reply to ``(verdict, detail)``; a None verdict means the reply cannot be read,
which :class:`~nemo_orch.reward.outcome.OutcomeScorer` counts as a judge failure. Parsers never
raise, whatever the text.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from nemo_orch.config.base import ConfigError, resolve_conf_path
from nemo_orch.config.reward import RewardConfig

Parser = Callable[[str], tuple[bool | None, str]]

PLACEHOLDERS = frozenset({"question", "reference", "response"})
TEMPLATE_KEYS = (
    "description",
    "system",
    "prompt",
    "parser",
    "temperature",
    "max_tokens",
    "response_format",
)

_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL | re.IGNORECASE)
_VERDICT = re.compile(r"\b(incorrect|wrong|yes|no|(?:not\s+)?(?:correct|right))\b")
_POSITIVE = frozenset({"correct", "right", "yes"})
_CORRECT_TAG = re.compile(r"<correct>(.*?)</correct>", re.DOTALL)
_HLE_REQUIRED = frozenset({"extracted_final_answer", "reasoning", "correct", "confidence"})


def parse_verdict(text: str) -> bool | None:
    """The judge's verdict: the first of correct/incorrect/yes/no/right/wrong after any
    ``<think>`` block; None when there is none."""
    found = _VERDICT.search(_THINK.sub(" ", text).lower())
    return None if found is None else found[1] in _POSITIVE


def _verdict(text: str) -> tuple[bool | None, str]:
    verdict = parse_verdict(text)
    return verdict, (
        text[:200] if verdict is not None else "no correct/incorrect/yes/no/right/wrong word"
    )


def _correct_tag(text: str) -> tuple[bool | None, str]:
    """Exactly one ``<correct>True</correct>`` or ``<correct>False</correct>`` outside any
    ``<think>`` block; the value's case and the whitespace around it do not matter."""
    text = _THINK.sub(" ", text)
    tags = _CORRECT_TAG.findall(text)
    # An unclosed extra <correct> is a second, unreadable tag, not noise.
    if len(tags) != 1 or text.count("<correct>") != 1:
        return None, f"{len(tags)} <correct>...</correct> tags, not one"
    value = tags[0].strip().lower()
    if value not in ("true", "false"):
        return None, f"<correct> holds {tags[0][:50]!r}, not True or False"
    return value == "true", f"<correct>{tags[0].strip()}</correct>"


def _hle_structured(text: str) -> tuple[bool | None, str]:
    """The official HLE judge's structured output, strictly: the whole reply is one JSON object
    with exactly its fields, well typed (a model that ignored the schema is a judge failure)."""
    try:
        reply = json.loads(text.strip())
    except (ValueError, RecursionError):
        return None, "the reply is not one JSON object"
    if not isinstance(reply, dict):
        return None, "the reply is not one JSON object"
    keys = set(reply)
    if not _HLE_REQUIRED <= keys or not keys <= _HLE_REQUIRED | {"strict"}:
        return None, f"fields {sorted(keys)}, not {sorted(_HLE_REQUIRED)} (+ strict)"
    answer, confidence = reply["extracted_final_answer"], reply["confidence"]
    if not (
        isinstance(answer, str)
        and isinstance(reply["reasoning"], str)
        and reply["correct"] in ("yes", "no")
        and isinstance(confidence, int)
        and not isinstance(confidence, bool)
        and 0 <= confidence <= 100
        and reply.get("strict", True) is True
    ):
        return None, "a field has the wrong type or value"
    return reply["correct"] == "yes", (
        f"extracted_final_answer={answer[:150]!r}, confidence={confidence}"
    )


PARSERS: dict[str, Parser] = {
    "verdict": _verdict,
    "correct_tag": _correct_tag,
    "hle_structured": _hle_structured,
}


@dataclass(frozen=True)
class JudgeTemplate:
    """One judge template, validated when read (see the module docstring)."""

    name: str
    description: str
    system: str | None
    prompt: str
    parser: str
    temperature: float | None
    max_tokens: int | None
    response_format: Mapping[str, Any] | None

    def messages(self, question: str, reference: str, response: str) -> list[dict[str, str]]:
        """The chat messages asking whether ``response`` answers ``question`` as ``reference``
        does."""
        user = self.prompt.format(question=question, reference=reference, response=response)
        system = [] if self.system is None else [{"role": "system", "content": self.system}]
        return [*system, {"role": "user", "content": user}]

    def parse(self, reply: str) -> tuple[bool | None, str]:
        """The verdict in ``reply`` (None: unreadable) and what it rests on."""
        return PARSERS[self.parser](reply)


def _placeholders(prompt: str) -> set[str]:
    """The replacement fields of ``prompt`` as written (``{response!r}`` is ``response!r``, so
    only plain names pass the check)."""
    names = set()
    for _, field, spec, conversion in string.Formatter().parse(prompt):
        if field is not None:
            names.add(
                field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            )
    return names


def read_judge_template(path: Path) -> JudgeTemplate:
    """The judge template in the YAML file ``path`` (named by its stem), validated: a
    :class:`ConfigError` names the file and the key at fault."""

    def check(condition: bool, key: str, problem: str) -> None:
        if not condition:
            raise ConfigError(f"judge template {path}: {key}: {problem}")

    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError(
            f"judge template {path}: cannot read it ({error.strerror or error})"
        ) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"judge template {path}: not valid YAML ({error})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"judge template {path}: must be a mapping of {', '.join(TEMPLATE_KEYS)}")
    for key in raw:
        check(
            key in TEMPLATE_KEYS, str(key), f"unknown key (the keys are {', '.join(TEMPLATE_KEYS)})"
        )
    for key in TEMPLATE_KEYS:
        check(key in raw, key, "missing (write null for none)")
    description, system, prompt = raw["description"], raw["system"], raw["prompt"]
    check(
        isinstance(description, str)
        and bool(description.strip())
        and "\n" not in description.strip(),
        "description",
        "must be one non-empty line",
    )
    check(
        system is None or (isinstance(system, str) and bool(system.strip())),
        "system",
        "must be a non-empty string or null (no system message)",
    )
    check(isinstance(prompt, str), "prompt", "must be a string")
    try:
        names = _placeholders(prompt)
    except ValueError as error:  # an unmatched brace
        raise ConfigError(
            f"judge template {path}: prompt: not a str.format template ({error}); "
            f"write a literal brace as {{{{ or }}}}"
        ) from None
    check(
        names == PLACEHOLDERS,
        "prompt",
        f"must use exactly {{question}}, {{reference}} and {{response}}; it uses "
        f"{', '.join('{' + name + '}' for name in sorted(names)) or 'none'}",
    )
    check(
        isinstance(raw["parser"], str) and raw["parser"] in PARSERS,
        "parser",
        f"{raw['parser']!r} is not one of {', '.join(PARSERS)}",
    )
    temperature, max_tokens = raw["temperature"], raw["max_tokens"]
    check(
        temperature is None
        or (
            isinstance(temperature, (int, float))
            and not isinstance(temperature, bool)
            and temperature >= 0
        ),
        "temperature",
        "must be a number >= 0 or null (not sent)",
    )
    check(
        max_tokens is None
        or (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1),
        "max_tokens",
        "must be an integer >= 1 or null (not sent)",
    )
    response_format = raw["response_format"]
    check(
        response_format is None
        or (isinstance(response_format, dict) and isinstance(response_format.get("type"), str)),
        "response_format",
        "must be a mapping with a 'type' (the OpenAI request field) or null",
    )
    return JudgeTemplate(
        path.stem,
        description.strip(),
        system,
        prompt,
        raw["parser"],
        None if temperature is None else float(temperature),
        max_tokens,
        response_format,
    )


def load_judge_template(name: str) -> JudgeTemplate:
    """The shipped template ``conf/reward/judges/NAME.yaml`` (see :func:`read_judge_template`)."""
    return read_judge_template(resolve_conf_path(f"reward/judges/{name}.yaml"))


def judge_description(config: RewardConfig) -> str:
    """Who decides the answers exact and numeric matching do not, in words for reports."""
    if config.endpoint is not None:
        return f"on the reward server at {config.endpoint} (its reward.judge_* settings)"
    if config.judge_base_url is None:
        return "none: exact and numeric matching only (reward.judge_base_url unset)"
    template = load_judge_template(config.judge_template)
    return (
        f"{template.name} ({template.description}) by {config.judge_model} at "
        f"{config.judge_base_url}"
    )
