"""Tool declarations (one YAML/JSON file per tool) and the :class:`Toolbox` that runs calls.

A declaration is the spec plus how to build the implementation::

    name: python_sandbox
    description: Run Python code and return what it prints.
    parameters: {type: object, properties: {code: {type: string}}, required: [code]}
    pricing: {per_second: 0.0001}
    latency_hint_s: 0.05
    deterministic: false
    max_concurrency: 4
    timeout_s: 15
    class: nemo_orch.tools.sandbox.PythonSandbox    # or `endpoint: http://host:port/...`
    options: {memory_mb: 1024}

Adding a tool is adding such a file. An option written ``file:<path>`` is a path relative to the
declaration's own directory, so a tool can ship with its data. A declaration with ``part: true``
is a part of composite tools (the retriever behind ``search``, the sandbox behind
``enhance_reasoning``): built, started and closed with the toolbox, never offered to the policy.

The toolbox owns everything around a call that must hold for
every tool: argument validation, a per-tool concurrency bound, the timeout, turning exceptions into
error results, and the cache of deterministic tools. It never raises from :meth:`Toolbox.call`.
A call of an unknown tool or with invalid arguments is the policy's ``tool_error``; a tool that
timed out, raised or answered with something other than a result is an ``infra_error``
(:mod:`nemo_orch.call_kinds`): the tool, not the call, failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from nemo_orch.call_kinds import CallKind
from nemo_orch.clients import call_store
from nemo_orch.clients.openai import EndpointRefusal
from nemo_orch.tools.base import (
    BuildSettings,
    PricedModels,
    Pricing,
    Tool,
    ToolContext,
    ToolError,
    ToolResult,
    ToolSource,
    ToolSpec,
    billed_result,
    seconds_since,
)
from nemo_orch.tools.schema import argument_errors, integral

logger = logging.getLogger(__name__)

_SPEC_KEYS = {
    "name",
    "description",
    "parameters",
    "pricing",
    "latency_hint_s",
    "deterministic",
    "max_concurrency",
    "timeout_s",
}
_BUILD_KEYS = {"class", "endpoint", "options", "part"}
DECLARATION_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class ToolDeclaration:
    """A parsed declaration file: the spec and how to build its implementation."""

    spec: ToolSpec
    class_path: str | None
    endpoint: str | None
    options: dict[str, Any]
    source: Path
    part: bool = False


def load_declaration(path: str | Path) -> ToolDeclaration:
    """Parse and check one declaration file; errors name the file and the key."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ToolError(f"{path}: cannot read the tool declaration: {error}") from None
    if not isinstance(raw, dict):
        raise ToolError(f"{path}: a tool declaration must be a mapping")
    unknown = raw.keys() - _SPEC_KEYS - _BUILD_KEYS
    if unknown:
        raise ToolError(f"{path}: unknown keys {sorted(unknown)}")
    missing = {"name", "description", "parameters"} - raw.keys()
    if missing:
        raise ToolError(f"{path}: missing keys {sorted(missing)}")
    if ("class" in raw) == ("endpoint" in raw):
        raise ToolError(f"{path}: give exactly one of `class` (an import path) or `endpoint`")
    fields = {key: raw[key] for key in _SPEC_KEYS if key in raw}
    try:
        fields["pricing"] = Pricing(**(fields.get("pricing") or {}))
        spec = ToolSpec(**fields)
    except (TypeError, ToolError) as error:
        raise ToolError(f"{path}: {error}") from None
    options = raw.get("options") or {}
    if not isinstance(options, dict):
        raise ToolError(f"{path}: options must be a mapping")
    part = raw.get("part", False)
    if not isinstance(part, bool):
        raise ToolError(f"{path}: part must be true or false")
    return ToolDeclaration(spec, raw.get("class"), raw.get("endpoint"), options, path, part)


def declaration_files(paths: Iterable[str | Path]) -> list[Path]:
    """Files named directly, and every declaration file (sorted) in directories named."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files.extend(sorted(p for p in path.iterdir() if p.suffix in DECLARATION_SUFFIXES))
        elif path.is_file():
            files.append(path)
        else:
            raise ToolError(f"{path}: no such tool declaration file or directory")
    return files


def load_declarations(paths: Iterable[str | Path]) -> list[ToolDeclaration]:
    declarations: dict[str, ToolDeclaration] = {}
    for file in declaration_files(paths):
        declaration = load_declaration(file)
        name = declaration.spec.name
        if name in declarations:
            raise ToolError(
                f"tool {name!r} is declared twice: {declarations[name].source} and {file}"
            )
        declarations[name] = declaration
    return list(declarations.values())


def _import(class_path: str, source: Path) -> type:
    module_name, _, attribute = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        raise ToolError(f"{source}: cannot import {class_path!r}: {error}") from None


def build_tools(
    declarations: Sequence[ToolDeclaration], build: BuildSettings = BuildSettings()
) -> list[Tool]:
    """Instantiate every declared tool. A class whose constructor takes ``resolve`` gets a
    function from a tool name to its built instance (how composite tools reach their parts);
    one that takes ``build`` gets the job's ``build`` settings (prices, endpoints, retrieval)."""
    by_name = {d.spec.name: d for d in declarations}
    built: dict[str, Tool] = {}
    building: list[str] = []

    def resolve(name: str) -> Tool:
        if name in built:
            return built[name]
        if name not in by_name:
            raise ToolError(f"tool {building[-1]!r} needs tool {name!r}, which is not declared")
        if name in building:
            raise ToolError(f"tools depend on each other in a cycle: {' -> '.join(building)}")
        building.append(name)
        built[name] = _build(by_name[name], resolve, build)
        building.pop()
        return built[name]

    return [resolve(d.spec.name) for d in declarations]


def _build(
    declaration: ToolDeclaration, resolve: Callable[[str], Tool], build: BuildSettings
) -> Tool:
    if declaration.endpoint is not None:
        from nemo_orch.tools.remote import RemoteTool

        return RemoteTool(declaration.spec, declaration.endpoint, **declaration.options)
    cls = _import(declaration.class_path, declaration.source)
    options = {
        key: _resolve_file(value, declaration.source.parent)
        for key, value in declaration.options.items()
    }
    parameters = inspect.signature(cls).parameters
    if "resolve" in parameters:
        options["resolve"] = resolve
    if "build" in parameters:
        options["build"] = build
    try:
        tool = cls(declaration.spec, **options)
    except (TypeError, ValueError) as error:
        raise ToolError(
            f"{declaration.source}: cannot build {declaration.class_path}: {error}"
        ) from None
    if not isinstance(tool, Tool):
        raise ToolError(
            f"{declaration.source}: {declaration.class_path} is not a Tool "
            "(needs spec, async call/start/close)"
        )
    return tool


def _resolve_file(value: Any, directory: Path) -> Any:
    if isinstance(value, str) and value.startswith("file:"):
        return str(directory / value.removeprefix("file:"))
    return value


def canonical_arguments(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class ResultCache:
    """LRU of deterministic tools' results, bounded in entries and in stored output bytes."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[tuple, ToolResult] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    @staticmethod
    def _size(result: ToolResult) -> int:
        return len(result.output.encode())

    def get(self, key: tuple) -> ToolResult | None:
        result = self._entries.get(key)
        if result is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return result

    def put(self, key: tuple, result: ToolResult) -> None:
        size = self._size(result)
        if self.max_entries == 0 or size > self.max_bytes:
            return
        if key in self._entries:
            self._bytes -= self._size(self._entries.pop(key))
        self._entries[key] = result
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= self._size(evicted)

    def __len__(self) -> int:
        return len(self._entries)


class Toolbox:
    """The tools an episode may call, and the one place a call is validated, bounded and cached.

    Per tool, at most ``spec.max_concurrency`` calls run at once and each gets ``spec.timeout_s``;
    a slow or dead tool only delays the calls made to it. ``parts`` are what composite tools
    call inside: started and closed with the toolbox, not offered and not callable by name.
    With ``show_prices``, the schemas offered list the prices of the models a tool chooses
    among (:class:`~nemo_orch.tools.base.PricedModels`). ``simulated_latency_s``: every call
    that runs waits this long first (``tools.simulated_latency_s``). ``modeled_time``: calls are
    billed by each tool's model of its time, not the clock (``tools.timing=modeled``;
    :func:`~nemo_orch.tools.base.billed_seconds`).

    ``sources`` (MCP servers) offer tools after ``tools``; started and closed with the toolbox,
    they may change their lists meanwhile. :meth:`refresh` takes such changes in, and only it:
    the tools on offer change between episodes, never during one (an episode keeps the
    :meth:`subset` it started with).
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        cache_entries: int = 4096,
        cache_bytes: int = 64 << 20,
        parts: Sequence[Tool] = (),
        show_prices: bool = True,
        simulated_latency_s: float = 0.0,
        modeled_time: bool = False,
        sources: Sequence[ToolSource] = (),
    ) -> None:
        self.fixed, self.sources = list(tools), list(sources)
        # The source each tool a source offers came from, by tool name.
        self.source_of: dict[str, str] = {}
        self.tools = self._offered()
        self.parts = list(parts)
        self.show_prices, self.simulated_latency_s = show_prices, simulated_latency_s
        self.modeled_time = modeled_time
        self.cache = ResultCache(cache_entries, cache_bytes)
        self._limits: dict[str, asyncio.Semaphore] = {}

    def _offered(self) -> dict[str, Tool]:
        offered: dict[str, Tool] = {}
        for tool in [*self.fixed, *(tool for source in self.sources for tool in source.tools)]:
            if tool.spec.name in offered:
                raise ToolError(f"two tools are named {tool.spec.name!r}")
            offered[tool.spec.name] = tool
        self.source_of = {
            tool.spec.name: source.name for source in self.sources for tool in source.tools
        }
        return offered

    async def refresh(self) -> None:
        """List again the sources that said their tools changed: tools they list now are
        offered, tools they dropped are not. A source that cannot be listed keeps its last list
        (and is tried again by the next refresh); a new name that clashes with another tool's
        keeps every list as it was. Either is a warning, never an error of a call."""
        changed = [source for source in self.sources if source.changed]
        for source in changed:
            try:
                await source.relist()
            except Exception as error:  # the old list stays on offer
                logger.warning(
                    "tool source %s: its tools changed but cannot be listed again: %s: %s",
                    source.name,
                    type(error).__name__,
                    error,
                )
        if changed:
            try:
                self.tools = self._offered()
            except ToolError as error:
                logger.warning("tool sources listed again, but not taken: %s", error)

    @property
    def specs(self) -> dict[str, ToolSpec]:
        return {name: tool.spec for name, tool in self.tools.items()}

    def schemas(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """OpenAI function schemas, in declaration order (or the order of ``names``)."""
        chosen = [self.tools[name] for name in (self.tools if names is None else names)]
        return [
            tool.spec.schema(
                tool.pricing if self.show_prices and isinstance(tool, PricedModels) else None,
                call_fee=self.show_prices,
            )
            for tool in chosen
        ]

    def lenient(self) -> frozenset[str]:
        """The tools that get every call and answer a bad one themselves
        (``ToolSpec.strict_arguments`` False)."""
        return frozenset(
            name for name, tool in self.tools.items() if not tool.spec.strict_arguments
        )

    def subset(self, names: Iterable[str]) -> Toolbox:
        """A toolbox over some of these tools that shares their instances and the cache: the
        tools on offer now, whatever a later :meth:`refresh` changes."""
        names = list(names)
        unknown = [n for n in names if n not in self.tools]
        if unknown:
            raise ToolError(f"unknown tools {unknown}; declared: {sorted(self.tools)}")
        subset = Toolbox(
            [self.tools[n] for n in names],
            parts=self.parts,
            show_prices=self.show_prices,
            simulated_latency_s=self.simulated_latency_s,
            modeled_time=self.modeled_time,
        )
        subset.cache, subset._limits = self.cache, self._limits
        subset.source_of = {name: self.source_of[name] for name in names if name in self.source_of}
        return subset

    async def start(self) -> None:
        """Warm up pooled tools (sandbox workers, indexes) and connect the sources before the
        first episode."""
        await asyncio.gather(*(tool.start() for tool in [*self.fixed, *self.parts, *self.sources]))

    async def close(self) -> None:
        await asyncio.gather(
            *(tool.close() for tool in [*self.fixed, *self.parts, *self.sources]),
            return_exceptions=True,
        )

    async def __aenter__(self) -> Toolbox:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _limit(self, name: str) -> asyncio.Semaphore:
        if name not in self._limits:
            self._limits[name] = asyncio.Semaphore(self.tools[name].spec.max_concurrency)
        return self._limits[name]

    async def call(
        self, name: str, arguments: dict[str, Any], context: ToolContext = ToolContext()
    ) -> ToolResult:
        """Run one call. Every failure (unknown tool, invalid arguments, timeout, exception
        inside the tool) comes back as a result with ``error`` set, but an endpoint refusing
        what it was declared to take (:class:`EndpointRefusal`), which stops the run."""
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(error=f"unknown tool {name!r}; available: {', '.join(self.tools)}")
        if self.modeled_time:
            context = dataclasses.replace(context, modeled_time=True)
        if tool.spec.strict_arguments:
            problems = argument_errors(tool.spec.parameters, arguments)
            if problems:
                return ToolResult(error=f"invalid arguments for {name}: {'; '.join(problems)}")
            arguments = integral(tool.spec.parameters, arguments)
        key = None
        if tool.spec.deterministic:
            allowed = (
                None
                if context.allowed_documents is None
                else tuple(sorted(context.allowed_documents))
            )
            key = (name, canonical_arguments(arguments), allowed)
            hit = self.cache.get(key)
            if hit is not None:
                # The ledger still shows the call, at no marginal cost or time.
                return dataclasses.replace(hit, cost_usd=0.0, latency_s=0.0, cached=True)
        result = await self._run(tool, arguments, context)
        if key is not None and result.error is None:
            self.cache.put(key, result)
        return result

    async def _run(self, tool: Tool, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        spec = tool.spec
        async with self._limit(spec.name):
            start = time.perf_counter()
            if self.simulated_latency_s:
                await asyncio.sleep(self.simulated_latency_s)
            try:
                with call_store.noting_calls() as noted:
                    result = await asyncio.wait_for(tool.call(arguments, context), spec.timeout_s)
                if any(call.replayed for call in noted) and isinstance(result, ToolResult):
                    result = dataclasses.replace(result, replayed=True)
            except TimeoutError:
                return billed_result(
                    spec,
                    start,
                    context,
                    error=f"{spec.name} timed out after {spec.timeout_s:g} s",
                    kind=CallKind.INFRA_ERROR,
                )
            except EndpointRefusal:
                raise  # every call would fail alike: the configuration's error, not the call's
            except Exception as error:  # a broken tool must not end the episode
                logger.exception("tool %s raised", spec.name)
                return ToolResult(
                    error=f"{spec.name} failed: {type(error).__name__}: {error}",
                    latency_s=seconds_since(spec, start, context),
                    kind=CallKind.INFRA_ERROR,
                )
        if not isinstance(result, ToolResult):
            return ToolResult(
                error=f"{spec.name} returned {type(result).__name__}, not a ToolResult",
                kind=CallKind.INFRA_ERROR,
            )
        if result.latency_s == 0.0:
            result = dataclasses.replace(result, latency_s=seconds_since(spec, start, context))
        return result


def offered_and_parts(
    declarations: Sequence[ToolDeclaration], build: BuildSettings = BuildSettings()
) -> tuple[list[Tool], list[Tool]]:
    """The declared tools built (with the job's ``build`` settings), split into those offered
    to the policy and composites' parts."""
    built = build_tools(declarations, build)
    return (
        [tool for tool, d in zip(built, declarations) if not d.part],
        [tool for tool, d in zip(built, declarations) if d.part],
    )


def load_toolbox(
    paths: Iterable[str | Path], cache_entries: int = 4096, cache_bytes: int = 64 << 20
) -> Toolbox:
    """Declarations -> built tools -> a toolbox (not started)."""
    offered, parts = offered_and_parts(load_declarations(paths))
    return Toolbox(offered, cache_entries, cache_bytes, parts)
