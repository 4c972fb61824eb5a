"""What ``search(model)``'s query brings its expert, under a benchmark's retrieval setting.

The reference's ``search`` tool has its expert write a query, then retrieves for it: on HLE,
1,000 hits from a dense index, those on the question's whitelist, cosine score above 0.1, up to
50, with web search when fewer than 3 remain; on FRAMES, the dense top 150 of a Wikipedia index.
:class:`DocumentSearch` is that retrieval, a part of the ``search`` composite (its executor):
the setting is ``env.retrieval`` (:class:`~nemo_orch.config.env.RetrievalConfig`), handed to
the tools an environment builds in their :class:`~nemo_orch.tools.base.BuildSettings`, as the
price and endpoint overrides are; the question's whitelist or own documents arrive as the task's
``allowed_documents``. Without a local index (``env.retrieval.index`` null) the query goes to the
fallback web search, as the reference's web-only ``search`` does.

The index loads when the toolbox starts, not when it is built (a reference index is tens of GB,
and building a toolbox to list its schemas must stay cheap).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from nemo_orch.config import RetrievalConfig, resolve_conf_path
from nemo_orch.tools.base import (
    BaseTool,
    BuildSettings,
    Tool,
    ToolContext,
    ToolError,
    ToolResult,
    ToolSpec,
)
from nemo_orch.tools.retrieval_index import Hit, load_index
from nemo_orch.tools.retriever import SearchBatcher, format_hits


class DocumentSearch(BaseTool):
    """Arguments: ``query``. Retrieves under the job's setting (``build.retrieval``; none: the
    defaults, web search only); options: ``fallback``, the name of a web-search tool (a part)
    run when fewer than ``fallback_below`` documents pass (its results then follow theirs) or
    when there is no index."""

    def __init__(
        self,
        spec: ToolSpec,
        resolve: Callable[[str], Tool],
        fallback: str | None = None,
        build: BuildSettings = BuildSettings(),
    ) -> None:
        super().__init__(spec)
        self.setting = build.retrieval or RetrievalConfig()
        self.fallback = None if fallback is None else resolve(fallback)
        if self.setting.index is None and self.setting.scope != "open":
            raise ToolError(
                f"{spec.name}: retrieval scope {self.setting.scope} filters a local "
                "index: set env.retrieval.index"
            )
        if self.setting.index is None and self.fallback is None:
            raise ToolError(
                f"{spec.name}: no local index (env.retrieval.index) and no fallback "
                "web search: nothing could run a query"
            )
        self._batcher: SearchBatcher | None = None  # over the index, once loaded
        self._loading = asyncio.Lock()

    async def start(self) -> None:
        async with self._loading:
            if self.setting.index is not None and self._batcher is None:
                self._batcher = SearchBatcher(
                    await asyncio.to_thread(
                        load_index,
                        resolve_conf_path(self.setting.index),
                        self.setting.encoder.options(),
                    )
                )

    async def _hits(self, query: str, allowed: frozenset[str] | None) -> list[Hit]:
        setting = self.setting
        if self._batcher is None:  # a toolbox used without being started
            await self.start()
        assert self._batcher is not None
        # oracle: the question's own documents, searched exactly; whitelist: the whole index's
        # best, then those listed (the reference's order: a listed document outside the depth
        # is not found).
        restrict = allowed if setting.scope == "oracle" else None
        hits = await self._batcher.search(
            query, setting.depth, restrict, setting.mode, setting.score_threshold
        )
        if setting.scope == "whitelist" and allowed is not None:
            hits = [hit for hit in hits if hit.id in allowed]
        return hits[: setting.top_k]

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        start = time.perf_counter()
        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            return ToolResult(error="argument 'query' must be a non-empty string")
        setting = self.setting
        hits = [] if setting.index is None else await self._hits(query, context.allowed_documents)
        if self.fallback is None or (
            setting.index is not None and len(hits) >= setting.fallback_below
        ):
            return ToolResult(
                output=format_hits(hits, setting.max_chars_per_doc),
                latency_s=time.perf_counter() - start,
            )
        # Too few documents passed: the web's results follow those that did.
        web = await self.fallback.call({"query": query}, context)
        if not hits:
            return ToolResult(
                output=web.output,
                error=web.error,
                kind=web.kind,
                usage=web.usage,
                cost_usd=web.cost_usd,
                latency_s=time.perf_counter() - start,
            )
        return ToolResult(
            output=f"{format_hits(hits, setting.max_chars_per_doc)}\n"
            f"Web search:\n{web.observation}",
            usage=web.usage,
            cost_usd=web.cost_usd,
            latency_s=time.perf_counter() - start,
        )
