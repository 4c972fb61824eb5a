"""Expert models behind any OpenAI-compatible chat endpoint (vLLM, ``trtllm-serve``, NIM,
OpenAI, the project's own server), chosen per call by alias and billed from the price table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nemo_orch.clients.breaker import GuardSettings
from nemo_orch.clients.openai import OpenAIClient, OpenAIError
from nemo_orch.config.dialect import DEFAULT_DIALECT
from nemo_orch.tools.base import (
    BaseTool,
    BuildSettings,
    Pricing,
    ToolContext,
    ToolError,
    ToolResult,
    ToolSpec,
    Usage,
    billed_seconds,
)
from nemo_orch.tools.composite import check_context_budget
from nemo_orch.tools.pricing import model_pricing


@dataclass(frozen=True)
class ExpertEndpoint:
    """Where an alias is served: the endpoint, the served model name, the environment variable
    holding the key (never the key itself) and, optionally, its own price (USD per million
    input / output tokens) when the table lacks the model. ``max_context_tokens`` (None: no
    budget) bounds the episode context composite tools hand this model, as ToolOrchestra gives
    each expert its own context length (see :func:`nemo_orch.tools.composite.fit_observations`).
    ``dialect`` says how the endpoint is asked (:mod:`nemo_orch.config.dialect`: e.g.
    ``openai-reasoning`` for gpt-5, which takes ``max_tokens`` as ``max_completion_tokens`` and
    no ``temperature``); reasoning tokens are billed with the output tokens."""

    base_url: str
    model: str
    api_key_env: str | None = None
    usd_per_million: tuple[float, float] | None = None
    max_tokens: int = 1024
    temperature: float = 0.0
    max_context_tokens: int | None = None
    dialect: str | Mapping[str, Any] = DEFAULT_DIALECT

    def __post_init__(self) -> None:
        check_context_budget(self.max_context_tokens)


class LLMTool(BaseTool):
    """Arguments: ``model`` (an alias of ``models``) and ``question``; the reply is the output.

    Options: ``models`` maps alias -> :class:`ExpertEndpoint` fields; ``system_prompt`` frames
    every request; ``timeout_s`` / ``max_retries`` apply per request (retries back off
    exponentially); ``guard`` sets each endpoint's circuit breaker and retry budget
    (:class:`~nemo_orch.clients.breaker.GuardSettings` fields: ``failures``, ``cooldown_s``,
    ``retry_ratio``, ``retry_reserve``).

    A reply the endpoint cut (``finish_reason`` ``length``, as a reasoning model's that spent
    its cap thinking; or ``content_filter``) is ``truncated``, with what came back; a reply with
    no text is ``empty``; both billed as the endpoint counted them. A request that failed is
    ``refused`` or ``infra_error`` (:attr:`~nemo_orch.clients.http.HTTPError.kind`).
    """

    def __init__(
        self,
        spec: ToolSpec,
        models: dict[str, dict[str, Any]],
        system_prompt: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        guard: dict[str, Any] | None = None,
        build: BuildSettings = BuildSettings(),
    ) -> None:
        super().__init__(spec)
        if not models:
            raise ToolError(f"{spec.name}: no expert models configured")
        try:
            settings = GuardSettings(**(guard or {}))
        except (TypeError, ValueError) as error:
            raise ToolError(f"{spec.name}: guard: {error}") from None
        self.system_prompt = system_prompt
        self.endpoints: dict[str, ExpertEndpoint] = {}
        self.pricing: dict[str, Pricing] = {}
        self.clients: dict[str, OpenAIClient] = {}
        for alias, options in models.items():
            if alias in build.endpoints:
                options = {**options, "base_url": build.endpoints[alias]}
            try:
                endpoint = ExpertEndpoint(**options)
            except (TypeError, ToolError) as error:
                raise ToolError(f"{spec.name}: model {alias!r}: {error}") from None
            self.endpoints[alias] = endpoint
            self.pricing[alias] = (
                Pricing.per_million_tokens(*endpoint.usd_per_million)
                if endpoint.usd_per_million
                else model_pricing(endpoint.model, build.prices)
            )
            # The key is read at the first request: a missing one fails that alias's calls only.
            self.clients[alias] = OpenAIClient(
                endpoint.base_url,
                endpoint.model,
                dialect=endpoint.dialect,
                name=f"tool {spec.name}, model {alias!r}",
                api_key_env=endpoint.api_key_env,
                timeout_s=timeout_s,
                max_retries=max_retries,
                guard=settings,
            )

    async def close(self) -> None:
        for client in self.clients.values():
            await client.aclose()

    def context_budget(self, alias: str) -> int | None:
        """The context tokens ``alias`` may be handed (None: no budget, or an alias this tool
        does not serve, whose call then fails)."""
        endpoint = self.endpoints.get(alias)
        return None if endpoint is None else endpoint.max_context_tokens

    async def ask(
        self, alias: str, question: str, context: ToolContext = ToolContext()
    ) -> ToolResult:
        """The expert's reply to ``question``, priced, timed as ``context`` says
        (:func:`billed_seconds`) and of its kind (see the class docstring)."""
        endpoint = self.endpoints.get(alias)
        if endpoint is None:
            return ToolResult(
                error=f"unknown model {alias!r}; choose one of {sorted(self.endpoints)}"
            )
        messages = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        ) + [{"role": "user", "content": question}]
        try:
            reply = await self.clients[alias].chat(
                messages, max_tokens=endpoint.max_tokens, temperature=endpoint.temperature
            )
        except OpenAIError as error:
            return ToolResult(error=f"expert {alias!r} failed: {error}", kind=error.kind)
        usage = Usage(reply.input_tokens, reply.output_tokens, reply.reasoning_tokens)
        seconds = billed_seconds(self.spec, reply.latency_s, context)
        cost = self.pricing[alias].cost(usage, 0.0) + self.spec.pricing.cost(usage, seconds)
        unusable = reply.unusable(endpoint.max_tokens)
        return ToolResult(
            output=reply.text,
            usage=usage,
            cost_usd=cost,
            latency_s=seconds,
            **(
                {}
                if unusable is None
                else {"kind": unusable[0], "error": f"expert {alias!r} {unusable[1]}"}
            ),
        )

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        return await self.ask(arguments["model"], arguments["question"], context)
