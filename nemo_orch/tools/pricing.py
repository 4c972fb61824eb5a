"""List prices of the models an orchestrator calls, USD per million tokens (input, output).

One table for expert tools, simulated experts and the orchestrator's own tokens. (The reference
implementation priced gpt-5 input at 0.125, ten times too low; OpenAI's list price is 1.25.)

A job's ``tools.prices`` change entries for the tools it builds
(:class:`~nemo_orch.tools.base.BuildSettings`): a price table is swapped at evaluation time
without touching the declarations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nemo_orch.tools.base import Pricing, ToolError

USD_PER_MILLION_TOKENS: dict[str, tuple[float, float]] = {
    "gpt-5": (1.25, 10.0),
    "gpt-5-mini": (0.25, 2.0),
    "Qwen3-32B": (0.8, 0.8),
    "Qwen2.5-Coder-32B-Instruct": (0.8, 0.8),
    "Qwen2.5-Math-72B-Instruct": (0.9, 0.9),
    "Qwen2.5-Math-7B-Instruct": (0.2, 0.2),
    "Llama-3.3-70B-Instruct": (0.9, 0.9),
    # The reference's unseen experts (generalization: the same roles, models never trained with).
    "OpenMath-Llama-2-70b": (0.9, 0.9),
    "deepseek-math-7b-instruct": (0.2, 0.2),
    "Codestral-22B-v0.1": (0.3, 0.9),
    "claude-sonnet-4": (3.0, 15.0),
    "gemma-3-27b-it": (0.8, 0.8),
    "orchestrator": (0.2, 0.2),
}


def model_pricing(model: str, prices: Mapping[str, Sequence[float]] | None = None) -> Pricing:
    """Token pricing of ``model``: an exact entry, else the entry its name ends with (so
    "Qwen/Qwen3-32B" finds "Qwen3-32B"), in the built-in table with ``prices`` over it."""
    table = {**USD_PER_MILLION_TOKENS, **(prices or {})}
    if model in table:
        return Pricing.per_million_tokens(*table[model])
    for name, prices in table.items():
        if model.endswith("/" + name):
            return Pricing.per_million_tokens(*prices)
    raise ToolError(
        f"no price for model {model!r}; known: {sorted(table)} (add it to the "
        "tool's `prices` option)"
    )
