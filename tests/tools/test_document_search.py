"""What ``search``'s query brings the expert under each retrieval setting, on a small local index:
the whole index, a whitelist filtered from the index's best as the reference filters, the
question's own documents, a cosine threshold, and the web search fallback, reached on a local
Tavily-compatible server (SIMULATED: Tavily itself is not reachable offline)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from support.retrieval_corpus import make_corpus
from support.simulated_tavily import SimulatedTavily

from nemo_orch.config import RetrievalConfig
from nemo_orch.tools.base import BuildSettings, ToolContext, ToolError, ToolSpec
from nemo_orch.tools.document_search import DocumentSearch
from nemo_orch.tools.retrieval_index import build_index, load_index
from nemo_orch.tools.retriever import format_hits
from nemo_orch.tools.web_search import WebSearch

KEY = "tvly-test-key"
SPEC = ToolSpec(
    "document_search",
    "Retrieves documents.",
    {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
)
QUERY = "Gutenberg movable type printing press"


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("document_search")
    return build_index(make_corpus(directory / "docs.jsonl"), directory / "idx")


@pytest.fixture(scope="module")
def index(index_dir):
    return load_index(index_dir)


@pytest.fixture
def tavily(monkeypatch):
    monkeypatch.setenv("TAVILY_API_KEY", KEY)
    server = SimulatedTavily(
        KEY,
        lambda query: {
            "query": query,
            "results": [
                {
                    "title": "Leaf chemistry",
                    "url": "https://example.org/leaf",
                    "content": f"web result for {query}",
                }
            ],
        },
    )
    yield server
    server.stop()


def document_search(setting: RetrievalConfig, tavily: SimulatedTavily | None = None):
    web = None if tavily is None else WebSearch(base_url=tavily.url, max_retries=0)
    return DocumentSearch(
        SPEC,
        {"web_search": web}.__getitem__,
        fallback=None if web is None else "web_search",
        build=BuildSettings(retrieval=setting),
    )


def search(tool: DocumentSearch, query: str = QUERY, allowed: frozenset[str] | None = None):
    return asyncio.run(tool.call({"query": query}, ToolContext(allowed_documents=allowed)))


def setting(index_dir, **fields) -> RetrievalConfig:
    return RetrievalConfig(**{"index": str(index_dir), "depth": 20, "top_k": 5, **fields})


def test_open_hands_on_the_dense_top_of_the_whole_index(index_dir, index):
    result = search(document_search(setting(index_dir)), allowed=frozenset({"jazz"}))
    # The scope, not a whitelist a task happens to carry, decides: open is the whole index.
    assert result.output == format_hits(index.search(QUERY, 5, mode="dense"), 2000)
    assert result.output.startswith("[printing]")


def test_whitelist_keeps_the_listed_documents_among_the_index_best(index_dir, index):
    ranked = [hit.id for hit in index.search(QUERY, len(index), mode="dense")]
    listed = frozenset({ranked[3], ranked[7], ranked[12], ranked[30]})  # one beyond depth 20
    result = search(
        document_search(setting(index_dir, scope="whitelist", whitelist="unused-here.json")),
        allowed=listed,
    )
    assert [line[1:].split("]")[0] for line in result.output.splitlines()] == [
        ranked[3],
        ranked[7],
        ranked[12],
    ]


def test_oracle_searches_the_question_s_own_documents_exactly(index_dir, index):
    ranked = [hit.id for hit in index.search(QUERY, len(index), mode="dense")]
    own = frozenset({ranked[40], ranked[50]})  # far beyond the depth: still found
    result = search(document_search(setting(index_dir, scope="oracle")), allowed=own)
    assert result.output == format_hits(index.search(QUERY, 20, own, "dense"), 2000)
    assert {line[1:].split("]")[0] for line in result.output.splitlines()} == own


def test_threshold_and_top_k(index_dir, index):
    scores = [hit.score for hit in index.search(QUERY, 20, mode="dense")]
    threshold = (scores[1] + scores[2]) / 2
    result = search(document_search(setting(index_dir, score_threshold=threshold)))
    assert len(result.output.splitlines()) == 2
    assert len(search(document_search(setting(index_dir, top_k=3))).output.splitlines()) == 3
    clipped = search(document_search(setting(index_dir, max_chars_per_doc=20)))
    assert all(len(line.split("] ", 1)[1]) <= 23 for line in clipped.output.splitlines())


def test_too_few_documents_fall_back_to_web_search_on_127_0_0_1(index_dir, index, tavily):
    scores = [hit.score for hit in index.search(QUERY, 20, mode="dense")]
    strict = setting(index_dir, score_threshold=(scores[0] + scores[1]) / 2, fallback_below=3)
    result = search(document_search(strict, tavily))
    assert [request["body"]["query"] for request in tavily.requests] == [QUERY]
    assert tavily.url.startswith("http://127.0.0.1:")
    documents, web = result.output.split("\nWeb search:\n")
    assert documents.startswith("[printing]") and len(documents.splitlines()) == 1
    assert f"web result for {QUERY}" in web
    assert result.cost_usd == pytest.approx(0.008)  # one Tavily credit, the retrieval is free
    # Enough documents pass: no web search.
    search(document_search(dataclasses.replace(strict, score_threshold=None), tavily))
    assert len(tavily.requests) == 1
    # Nothing passes and the web search fails: the failure is the result, never a raise.
    tavily.script.append((500, {"error": "down"}, {}))
    failed = search(document_search(dataclasses.replace(strict, score_threshold=1.0), tavily))
    assert failed.error is not None and "HTTP 500" in failed.error, failed


def test_without_an_index_the_web_answers(tavily):
    result = search(document_search(RetrievalConfig(), tavily))
    assert "web result for" in result.output and len(tavily.requests) == 1


def test_settings_that_cannot_run_are_errors_at_build(index_dir):
    with pytest.raises(ToolError, match="scope whitelist filters a local index"):
        document_search(RetrievalConfig(scope="whitelist", whitelist="w.json"))
    with pytest.raises(ToolError, match="no local index .* and no fallback"):
        document_search(RetrievalConfig())
    assert search(document_search(setting(index_dir)), query=" ").error == (
        "argument 'query' must be a non-empty string"
    )
