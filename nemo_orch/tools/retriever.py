"""The ``retriever`` tool: search over a retrieval index (:mod:`nemo_orch.tools.retrieval_index`),
the searches of concurrent calls gathered into batches.

ToolOrchestra's basic tools include a local retriever over a fixed corpus (e.g. the documents of an
HLE or FRAMES task). :meth:`~nemo_orch.tools.retrieval_index.RetrievalIndex.search_many` answers a
batch of queries with one encoder call and one FAISS search; the tools gather the searches of
concurrent calls into such batches (:class:`SearchBatcher`), so a served retriever's Triton batch
and a rollout's concurrent episodes search together.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_orch.tools.base import (
    BaseTool,
    ToolContext,
    ToolResult,
    ToolSpec,
    billed_result,
    seconds_since,
)
from nemo_orch.tools.encoders import RetrievalError
from nemo_orch.tools.retrieval_index import (
    EncoderChoice,
    Hit,
    Mode,
    RetrievalIndex,
    check_search,
    index_corpus,
    load_index,
)
from nemo_orch.tools.schema import argument_errors


@dataclass
class _Search:
    query: str
    k: int
    allowed: frozenset[str] | None
    mode: str
    score_threshold: float | None
    future: asyncio.Future[list[Hit]]


class SearchBatcher:
    """Gathers the searches of concurrent callers on one event loop into batches: while one
    batch runs (:meth:`RetrievalIndex.search_many` in a worker thread), the searches that arrive
    wait, then go together. Calls of one Triton batch, or of a rollout's concurrent episodes,
    so share one encoder call and one FAISS search. At most ``max_batch`` searches per call."""

    def __init__(self, index: RetrievalIndex, max_batch: int = 256) -> None:
        if max_batch < 1:
            raise RetrievalError(f"max_batch must be >= 1, got {max_batch}")
        self.index, self.max_batch = index, max_batch
        # Futures belong to one event loop; a tool may be called from several (one at a time).
        self._waiting: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[_Search]] = (
            weakref.WeakKeyDictionary()
        )
        self._drains: set[asyncio.Task[None]] = set()
        self.batches = self.searches = 0  # how well batching works, for benchmarks

    async def search(
        self,
        query: str,
        k: int,
        allowed: frozenset[str] | None = None,
        mode: Mode = "hybrid",
        score_threshold: float | None = None,
    ) -> list[Hit]:
        loop = asyncio.get_running_loop()
        waiting = self._waiting.setdefault(loop, [])
        request = _Search(query, k, allowed, mode, score_threshold, loop.create_future())
        waiting.append(request)
        if len(waiting) == 1:  # no drain is scheduled on this loop: start one
            drain = loop.create_task(self._drain(waiting))
            self._drains.add(drain)  # the loop keeps only a weak reference to a task
            drain.add_done_callback(self._drains.discard)
        return await request.future

    async def _drain(self, waiting: list[_Search]) -> None:
        while waiting:
            batch = waiting[: self.max_batch]
            groups: dict[tuple, list[_Search]] = {}
            for request in batch:
                groups.setdefault((request.k, request.mode, request.score_threshold), []).append(
                    request
                )
            for (k, mode, threshold), requests in groups.items():
                try:
                    found = await asyncio.to_thread(
                        self.index.search_many,
                        [r.query for r in requests],
                        k,
                        [r.allowed for r in requests],
                        mode,
                        threshold,
                    )
                except Exception as error:  # each caller gets the failure, the drain goes on
                    for request in requests:
                        if not request.future.done():
                            request.future.set_exception(error)
                    continue
                self.batches += 1
                self.searches += len(requests)
                for request, hits in zip(requests, found):
                    if not request.future.done():  # a caller may have been cancelled
                        request.future.set_result(hits)
            # Removed only once searched, so callers arriving meanwhile see a non-empty list
            # and leave the scheduling to this drain.
            del waiting[: len(batch)]


def format_hits(hits: Sequence[Hit], max_chars_per_doc: int) -> str:
    """Passages as the policy or an expert reads them: ``[doc-id] title: text`` per line, each
    cut at ``max_chars_per_doc`` characters."""
    lines = []
    for hit in hits:
        text = " ".join(hit.text.split())
        if hit.title:
            text = f"{hit.title}: {text}"
        if len(text) > max_chars_per_doc:
            text = text[:max_chars_per_doc].rstrip() + "..."
        lines.append(f"[{hit.id}] {text}")
    return "\n".join(lines) if lines else "No documents found."


def default_spec() -> ToolSpec:
    """The retriever as the policy sees it; deterministic, so the toolbox may cache results."""
    return ToolSpec(
        name="retriever",
        description=(
            "Search the local document collection. Returns the most relevant passages, "
            "each as '[doc-id] text'."
        ),
        parameters={
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to search for."},
                "top_k": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 20,
                    "description": "How many passages to return (default 5).",
                },
            },
            "required": ["query"],
        },
        latency_hint_s=0.05,
        deterministic=True,
        timeout_s=30.0,
    )


class Retriever(BaseTool):
    """Search over a prebuilt index (``index_dir``) or a corpus indexed in memory at
    construction (``corpus``): hybrid by default, or one component alone (``mode``: ``sparse``
    suits made-up names, which only exact terms find). Honours the per-task whitelist
    ``context.allowed_documents``. With ``question_as_query``, a call without a query searches
    for the task's question (declare ``query`` optional then): the tool is handed the task, as
    an expert is. Concurrent calls search in batches of up to ``max_batch``
    (:class:`SearchBatcher`; 1: one search at a time)."""

    def __init__(
        self,
        spec: ToolSpec | None = None,
        *,
        index_dir: str | Path | None = None,
        corpus: str | Path | None = None,
        encoder: EncoderChoice = "hashing",
        top_k: int = 5,
        max_top_k: int = 20,
        max_chars_per_doc: int = 400,
        rrf_k: float = 60.0,
        candidates: int = 100,
        mode: Mode = "hybrid",
        question_as_query: bool = False,
        max_batch: int = 256,
    ) -> None:
        super().__init__(spec or default_spec())
        if (index_dir is None) == (corpus is None):
            raise RetrievalError("retriever: give exactly one of index_dir or corpus")
        check_search(mode, None)
        self.mode, self.question_as_query = mode, question_as_query
        if not 1 <= top_k <= max_top_k or max_chars_per_doc < 1:
            raise RetrievalError(
                "retriever: need 1 <= top_k <= max_top_k and max_chars_per_doc >= 1"
            )
        self.top_k, self.max_top_k, self.max_chars_per_doc = top_k, max_top_k, max_chars_per_doc
        if index_dir is not None:
            self.index = load_index(index_dir, encoder, rrf_k=rrf_k, candidates=candidates)
        else:
            self.index = index_corpus(corpus, encoder, rrf_k=rrf_k, candidates=candidates)
        check_search(mode, None, self.index.has_sparse)
        self.batcher = SearchBatcher(self.index, max_batch)

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        start = time.perf_counter()
        errors = argument_errors(self.spec.parameters, arguments)
        query = arguments.get("query")
        if query is None and self.question_as_query and context.task is not None:
            query = context.task.question
        top_k = arguments.get("top_k", self.top_k)
        if not errors and (not isinstance(query, str) or not query.strip()):
            errors.append("argument 'query' must be a non-empty string")
        if not errors and (
            isinstance(top_k, bool)
            or not isinstance(top_k, int)
            or not 1 <= top_k <= self.max_top_k
        ):
            errors.append(f"argument 'top_k' must be an integer in [1, {self.max_top_k}]")
        if errors:
            return ToolResult(
                error="; ".join(errors), latency_s=seconds_since(self.spec, start, context)
            )
        hits = await self.batcher.search(query, top_k, context.allowed_documents, self.mode)
        return billed_result(self.spec, start, context, format_hits(hits, self.max_chars_per_doc))
