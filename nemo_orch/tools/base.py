"""The tool seam: a :class:`ToolSpec` (data) and an implementation with one async ``call``.

A spec is what the policy sees (an OpenAI function schema, exactly what Qwen3 chat templates take)
plus what the runner needs to price, bound and cache calls. An implementation never raises for a
bad call: it returns a :class:`ToolResult` with ``error`` set and its
:class:`~nemo_orch.call_kinds.CallKind`, which becomes the observation.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from nemo_orch.call_kinds import OBSERVATION_PREFIX, CallKind, kind_of
from nemo_orch.tools.schema import ToolSchemaError, check_parameters

if TYPE_CHECKING:
    from nemo_orch.config import RetrievalConfig
    from nemo_orch.data.tasks import Task


class ToolError(ValueError):
    """A tool declaration or option that cannot work (raised at load time, never during calls)."""


@dataclass(frozen=True)
class BuildSettings:
    """What a job sets for the tools it builds from declarations, beside their declared options
    (a tool whose constructor takes ``build`` is handed it): ``prices``, model -> [input,
    output] USD per million tokens over the list prices (``tools.prices``); ``endpoints``, an
    expert alias -> the base URL that serves it over the declared one (``tools.endpoints``:
    servers a launch started on nodes it learns only when the job runs); ``retrieval``, what
    ``search``'s document retrieval runs under (an environment's ``env.retrieval``; None: the
    defaults, web search only)."""

    prices: Mapping[str, Sequence[float]] = field(default_factory=dict)
    endpoints: Mapping[str, str] = field(default_factory=dict)
    retrieval: RetrievalConfig | None = None


@dataclass(frozen=True)
class Pricing:
    """USD per call, per token in and out, and per second of tool time."""

    per_call: float = 0.0
    per_input_token: float = 0.0
    per_output_token: float = 0.0
    per_second: float = 0.0

    def __post_init__(self) -> None:
        for name in ("per_call", "per_input_token", "per_output_token", "per_second"):
            if getattr(self, name) < 0:
                raise ToolError(f"pricing.{name} must be >= 0")

    @classmethod
    def per_million_tokens(cls, input_usd: float, output_usd: float) -> Pricing:
        """Pricing from the usual list price: USD per million input / output tokens."""
        return cls(per_input_token=input_usd / 1e6, per_output_token=output_usd / 1e6)

    def cost(self, usage: Usage, seconds: float) -> float:
        return (
            self.per_call
            + self.per_input_token * usage.input_tokens
            + self.per_output_token * usage.output_tokens
            + self.per_second * seconds
        )

    @property
    def usd_per_million_tokens(self) -> list[float]:
        """The list price, [input, output] USD per million tokens (as the policy is shown it)."""
        return [round(self.per_input_token * 1e6, 6), round(self.per_output_token * 1e6, 6)]


@dataclass(frozen=True)
class Usage:
    """Tokens an expert model read and wrote on behalf of one tool call; of the output tokens,
    ``reasoning_tokens`` were spent reasoning (priced as output, as OpenAI bills them)."""

    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.reasoning_tokens + other.reasoning_tokens,
        )


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the policy sees it (``name``, ``description``, JSON-schema ``parameters``) and
    as the runner treats it (price, expected latency, cacheability, concurrency, timeout)."""

    name: str
    description: str
    parameters: dict[str, Any]
    pricing: Pricing = field(default_factory=Pricing)
    latency_hint_s: float = 0.0
    # Same arguments, same output: results may be cached.
    deterministic: bool = False
    max_concurrency: int = 8
    timeout_s: float = 60.0
    # The runner refuses a call its schema rejects (:func:`~nemo_orch.tools.schema.
    # argument_errors`). False: the tool gets every call and answers a bad one itself, as a
    # benchmark whose own dispatch records and scores the call as it ran (tau2's tools).
    strict_arguments: bool = True

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ToolError(f"tool name {self.name!r} must be an identifier")
        if self.parameters.get("type") != "object":
            raise ToolError(f"tool {self.name!r}: parameters must be a JSON schema of type object")
        try:
            check_parameters(self.parameters)
        except ToolSchemaError as error:
            raise ToolError(f"tool {self.name!r}: parameters are {error}") from None
        if self.max_concurrency < 1 or self.timeout_s <= 0 or self.latency_hint_s < 0:
            raise ToolError(
                f"tool {self.name!r}: max_concurrency must be >= 1, timeout_s > 0 "
                "and latency_hint_s >= 0"
            )

    def schema(
        self, prices: Mapping[str, Pricing] | None = None, call_fee: bool = False
    ) -> dict[str, Any]:
        """The OpenAI function-calling form, as listed to the policy. With ``prices`` (by model
        alias), the choices of a ``model``-like argument show theirs, as ToolOrchestra's tool
        descriptions do: ``prices`` ([input, output] USD per million tokens by alias) beside the
        argument's ``enum`` (which the compact chat format lists too), their unit in the
        description. With ``call_fee``, the description ends with the tool's fee per call, if
        it has one (a web search's, an MCP tool's)."""
        description, parameters = self.description, self.parameters
        priced = (
            {
                name: [alias for alias in schema.get("enum", []) if alias in prices]
                for name, schema in parameters.get("properties", {}).items()
            }
            if prices
            else {}
        )
        priced = {name: aliases for name, aliases in priced.items() if aliases}
        if priced:
            properties = dict(parameters["properties"])
            for name, aliases in priced.items():
                properties[name] = {
                    **properties[name],
                    "prices": {alias: prices[alias].usd_per_million_tokens for alias in aliases},
                }
                description += f" The {name} prices: USD per million input/output tokens."
            parameters = {**parameters, "properties": properties}
        if call_fee and self.pricing.per_call:
            description += f" Each call costs USD {self.pricing.per_call:g}."
        return {
            "type": "function",
            "function": {"name": self.name, "description": description, "parameters": parameters},
        }


@dataclass(frozen=True)
class ToolResult:
    """What one call produced. ``output`` is the observation text; ``error`` (when set) says
    what failed, and ``kind`` how (:class:`~nemo_orch.call_kinds.CallKind`; left out: ``ok``
    without an error, ``tool_error`` with one); the observation then introduces the error by
    its kind, and a ``truncated`` call's ``output`` is what came back before the cut. ``answer``
    is set by tools that end the episode with a final answer. ``trajectory``: the episode
    another orchestrator ran to answer the call (its ``messages`` and ``ledger``, see
    :mod:`nemo_orch.tools.orchestrator`), kept with the caller's for inspection; its cost is
    already in ``cost_usd``."""

    output: str = ""
    error: str | None = None
    usage: Usage = field(default_factory=Usage)
    cost_usd: float = 0.0
    latency_s: float = 0.0
    cached: bool = False
    answer: str | None = None
    trajectory: dict[str, Any] | None = None
    kind: CallKind | None = None
    # Answered from the call store (calls.mode replay|replay_or_call): ``cost_usd`` is what the
    # recorded call cost, not what this run spent.
    replayed: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", kind_of(self.kind, self.error))

    @property
    def observation(self) -> str:
        if self.error is None:
            return self.output
        text = f"{OBSERVATION_PREFIX[self.kind]}: {self.error}"
        if self.kind == CallKind.TRUNCATED and self.output:
            text += f"\nWhat came back before the cut:\n{self.output}"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "error": self.error,
            "kind": self.kind,
            "cost_usd": self.cost_usd,
            "latency_s": self.latency_s,
            "cached": self.cached,
            "replayed": self.replayed,
            "answer": self.answer,
            "usage": dataclasses.asdict(self.usage),
            "trajectory": self.trajectory,
        }


@dataclass(frozen=True)
class ToolContext:
    """Per-call facts a tool may use: which task/episode is calling, the documents it may see
    (None: all), and a seed for tools that sample. ``task`` is the whole task, for tools that
    act on its environment (a domain database) or, for the simulated expert only, its
    reference answer. ``observations`` are what the episode's earlier calls returned: the
    context an expert is handed with the task, as ToolOrchestra's experts are. ``turn`` is the
    caller's message the call belongs to (the calls of one message share it) and ``message``
    the text the caller wrote beside its calls, which a transcript keeps (tau2's does).
    ``modeled_time``: bill the call by the tool's model of its time, not the clock (the toolbox
    sets it under ``tools.timing=modeled``; see :func:`billed_seconds`)."""

    task_id: str = ""
    episode_id: str = ""
    allowed_documents: frozenset[str] | None = None
    seed: int = 0
    task: Task | None = None
    observations: tuple[str, ...] = ()
    turn: int = 0
    message: str | None = None
    modeled_time: bool = False


def billed_seconds(spec: ToolSpec, measured_s: float, context: ToolContext) -> float:
    """A call's seconds as its cost and the reward count them: the ``measured_s`` of wall-clock
    time, or under modeled time the tool's declared ``latency_hint_s``, which does not depend on
    the machine's load (a simulated expert models its own: its tokens over its speed)."""
    return spec.latency_hint_s if context.modeled_time else measured_s


def seconds_since(spec: ToolSpec, started: float, context: ToolContext) -> float:
    """The :func:`billed_seconds` of a call that started at ``started`` (``time.perf_counter``)."""
    return billed_seconds(spec, time.perf_counter() - started, context)


def billed_result(
    spec: ToolSpec,
    started: float,
    context: ToolContext,
    output: str = "",
    error: str | None = None,
    kind: CallKind | None = None,
    took: float | None = None,
) -> ToolResult:
    """The result of a call that started at ``started``, billed for its seconds
    (:func:`seconds_since`; ``took``: the seconds it took when recorded, for a call the call
    store answered) at ``spec.pricing``."""
    seconds = (
        seconds_since(spec, started, context)
        if took is None
        else billed_seconds(spec, took, context)
    )
    return ToolResult(
        output=output,
        error=error,
        latency_s=seconds,
        cost_usd=spec.pricing.cost(Usage(), seconds),
        kind=kind,
    )


@runtime_checkable
class Tool(Protocol):
    """A tool implementation. ``start`` warms pooled resources; ``close`` releases them."""

    spec: ToolSpec

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class ToolSource(Protocol):
    """Tools whose list may change while the toolbox runs (an MCP server's): ``tools`` as last
    listed, ``changed`` once the source said its list changed, until :meth:`relist` lists it
    again."""

    name: str
    tools: list[Tool]

    @property
    def changed(self) -> bool: ...

    async def relist(self) -> None: ...


@runtime_checkable
class PricedModels(Protocol):
    """A tool whose ``model`` argument chooses among priced models (an LLM expert, a simulated
    one, a composite over either): its prices by alias, shown to the policy
    (:meth:`ToolSpec.schema`)."""

    @property
    def pricing(self) -> dict[str, Pricing]: ...


class BaseTool:
    """Convenience base: holds the spec; no resources to start or close."""

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None
