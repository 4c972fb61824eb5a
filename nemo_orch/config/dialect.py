"""How an OpenAI-compatible endpoint is asked: its *dialect*.

Servers that speak OpenAI's chat API differ in what a request may carry. OpenAI's reasoning
models (gpt-5, gpt-5-mini, the o-series) refuse ``max_tokens`` (they take
``max_completion_tokens``) and every sampling parameter but the default; vLLM, ``trtllm-serve``,
NIM, SGLang and nemo-orch's own server take ``max_tokens`` and sampling parameters. Every
endpoint the project calls (experts, tau2's user, the judge, the policy, the monolith, the
ToolScale synthesizer) declares its dialect, as a preset's name or a mapping of
:class:`Dialect`'s fields over a preset::

    dialect: openai-reasoning
    dialect: {preset: openai-reasoning, reasoning_effort: high}
    dialect: {preset: vllm, extra_body: {chat_template_kwargs: {enable_thinking: false}}}
    dialect: {preset: vllm, stream: true}     # a model or proxy that only streams

An endpoint that still refuses a parameter stops the run with the parameter and the endpoint
named (:class:`nemo_orch.clients.openai.EndpointRefusal`), rather than turning every call into
an error observation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from nemo_orch.config.base import ConfigError

OUTPUT_CAPS = ("max_tokens", "max_completion_tokens")
# What a dialect without sampling leaves out of its requests: of the parameters nemo-orch
# sends, those OpenAI's reasoning models refuse (any but the default value). ``seed`` is kept:
# they take it, and simulated endpoints reply by it.
SAMPLING_PARAMETERS = ("temperature", "top_p", "stop")
# Fields every request sets itself; extra_body may not replace them.
_REQUEST_FIELDS = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "tools",
        "stream",
        "stream_options",
        "seed",
        "reasoning_effort",
        *OUTPUT_CAPS,
        *SAMPLING_PARAMETERS,
    }
)


@dataclass(frozen=True)
class Dialect:
    """``output_cap``: the request field that caps the reply's tokens; ``sampling``: whether
    sampling parameters (:data:`SAMPLING_PARAMETERS`) may be sent (when not, they are left out
    whatever the caller asks); ``reasoning_effort``: sent as is (null: the server's default);
    ``extra_body``: more fields merged into every request; ``stream``: ask for the reply as
    server-sent events (``stream: true``, with the usage in the last chunk), for models and
    proxies that only stream. A streamed reply is read whole either way, asked for or not."""

    output_cap: str = "max_tokens"
    sampling: bool = True
    reasoning_effort: str | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    stream: bool = False

    def __post_init__(self) -> None:
        if self.output_cap not in OUTPUT_CAPS:
            raise ConfigError(
                f"output_cap must be one of {'|'.join(OUTPUT_CAPS)}, got {self.output_cap!r}"
            )
        for name in ("sampling", "stream"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.reasoning_effort is not None and not (
            isinstance(self.reasoning_effort, str) and self.reasoning_effort
        ):
            raise ConfigError(
                f"reasoning_effort must be a name (e.g. low, medium, high), got "
                f"{self.reasoning_effort!r}"
            )
        if not isinstance(self.extra_body, Mapping):
            raise ConfigError(f"extra_body must be a mapping, got {self.extra_body!r}")
        taken = sorted(_REQUEST_FIELDS & set(self.extra_body))
        if taken:
            raise ConfigError(
                f"extra_body may not set {', '.join(taken)}: the request sets them "
                "(the cap is output_cap, sampling parameters follow sampling, "
                "streaming is stream)"
            )


DIALECT_PRESETS: dict[str, Dialect] = {
    # vLLM, trtllm-serve, NIM, SGLang, nemo-orch's own server: what nemo-orch always sent.
    "vllm": Dialect(),
    # OpenAI's chat models (gpt-4.1, gpt-4o): max_tokens is deprecated there.
    "openai-chat": Dialect(output_cap="max_completion_tokens"),
    # OpenAI's reasoning models (gpt-5, gpt-5-mini, o3, o4-mini): no sampling parameters.
    "openai-reasoning": Dialect(output_cap="max_completion_tokens", sampling=False),
}
DEFAULT_DIALECT = "vllm"


def parse_dialect(declared: Any, where: str) -> Dialect:
    """The dialect ``declared`` at ``where`` (named in errors): a preset's name, a mapping of
    :class:`Dialect`'s fields over ``preset`` (default :data:`DEFAULT_DIALECT`), or a
    :class:`Dialect`."""
    if isinstance(declared, Dialect):
        return declared
    if isinstance(declared, str):
        declared = {"preset": declared}
    if not isinstance(declared, Mapping):
        raise ConfigError(
            f"{where}: a dialect is a preset's name ({'|'.join(DIALECT_PRESETS)}) "
            f"or a mapping of {_field_names()} over a preset, got {declared!r}"
        )
    options = dict(declared)
    preset = options.pop("preset", DEFAULT_DIALECT)
    if preset not in DIALECT_PRESETS:
        raise ConfigError(
            f"{where}: unknown dialect preset {preset!r}; one of {'|'.join(DIALECT_PRESETS)}"
        )
    unknown = sorted(set(options) - {f.name for f in fields(Dialect)})
    if unknown:
        raise ConfigError(
            f"{where}: unknown dialect field(s) {', '.join(unknown)}; a dialect "
            f"takes preset, {_field_names()}"
        )
    base = DIALECT_PRESETS[preset]
    try:
        return Dialect(
            **{f.name: options.get(f.name, getattr(base, f.name)) for f in fields(Dialect)}
        )
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def _field_names() -> str:
    return ", ".join(f.name for f in fields(Dialect))
