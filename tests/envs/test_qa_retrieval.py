"""``env.retrieval`` on the qa environment: what each question may retrieve under each scope, the
HLE and FRAMES presets' reference settings, the setting in every report, and the environment's
toolbox retrieving under it, down to ``search`` on ``tools=reference`` with its web fallback."""

from __future__ import annotations

import asyncio
import json
import shutil
from contextlib import ExitStack

import pytest
import yaml
from support.retrieval_corpus import make_corpus
from support.simulated_tavily import SimulatedTavily

from nemo_orch import config as config_lib
from nemo_orch.config import resolve_conf_path
from nemo_orch.data.jsonl import DataError
from nemo_orch.envs import build_environment
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.serve.openai_server import start_server
from nemo_orch.tools.base import ToolContext
from nemo_orch.tools.document_search import DocumentSearch
from nemo_orch.tools.retrieval_index import build_index

FRAMES_ROWS = [
    {
        "Unnamed: 0": 0,
        "Prompt": "Who printed with movable type?",
        "Answer": "Gutenberg",
        "wiki_links": "['printing', 'everest']",
    },
    {
        "Unnamed: 0": 1,
        "Prompt": "When was penicillin found?",
        "Answer": "1928",
        "wiki_links": "['penicillin']",
    },
]
HLE_ROWS = [
    {"id": "q1", "question": "Who printed with movable type?", "answer": "Gutenberg", "image": ""},
    {"id": "q2", "question": "When was penicillin found?", "answer": "1928", "image": ""},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qa_retrieval")
    return build_index(make_corpus(directory / "docs.jsonl", fillers=50), directory / "idx")


def environment(*overrides: str):
    return build_environment(config_lib.load(list(overrides)))


def test_frames_by_default_searches_the_whole_index_not_its_wiki_links(tmp_path):
    frames = write_jsonl(tmp_path / "frames.jsonl", FRAMES_ROWS)
    config = config_lib.load(["env=frames", f"env.path={frames}"])
    retrieval = config.env.retrieval
    assert (retrieval.scope, retrieval.mode, retrieval.depth, retrieval.top_k) == (
        "open",
        "dense",
        150,
        150,
    )
    env = build_environment(config)
    assert [task.allowed_documents for task in env.tasks("test", None, 0)] == [None, None]
    assert "oracle" not in env.notes["retrieval"].lower()

    oracle = environment("env=frames", f"env.path={frames}", "env.retrieval.scope=oracle")
    assert [task.allowed_documents for task in oracle.tasks("test", None, 0)] == [
        {"printing", "everest"},
        {"penicillin"},
    ]
    assert "ORACLE" in oracle.notes["retrieval"]
    assert "not comparable with the reference" in oracle.notes["retrieval"]


def test_hle_follows_the_reference_whitelist_setting(tmp_path, index_dir):
    hle = write_jsonl(tmp_path / "hle.jsonl", HLE_ROWS)
    whitelist = tmp_path / "examples.json"
    whitelist.write_text(
        json.dumps({"q1": ["printing", "rome"], "q2": ["penicillin"], "q9": [1, 2]})
    )
    env = environment(
        "env=hle",
        f"env.path={hle}",
        f"env.retrieval.whitelist={whitelist}",
        f"env.retrieval.index={index_dir}",
        "tools=reference",
    )
    assert [task.allowed_documents for task in env.tasks("test", None, 0)] == [
        {"printing", "rome"},
        {"penicillin"},
    ]
    assert env.notes["retrieval"] == (
        f"whitelist: the question's whitelist ({whitelist}); dense top 1000, cosine > 0.1 -> "
        "50 documents to the expert, web search below 3 documents"
    )

    # `search`'s retrieval part runs under the environment's setting, on each task's list.
    toolbox = env.toolbox()
    (part,) = [tool for tool in toolbox.parts if isinstance(tool, DocumentSearch)]
    assert part.setting == env.retrieval
    task = env.tasks("test", None, 0)[0]

    async def search():
        async with toolbox:
            return await part._hits("Gutenberg movable type printing press", task.allowed_documents)

    hits = asyncio.run(search())
    assert [hit.id for hit in hits] == ["printing"]  # rome is listed but scores below 0.1
    assert all(hit.dense_score > 0.1 for hit in hits)


def test_whitelist_problems_name_the_file(tmp_path):
    hle = write_jsonl(tmp_path / "hle.jsonl", HLE_ROWS)
    whitelist = tmp_path / "examples.json"
    base = ["env=hle", f"env.path={hle}", f"env.retrieval.whitelist={whitelist}"]
    whitelist.write_text(json.dumps({"q1": ["a"]}))
    with pytest.raises(
        DataError,
        match=r"examples.json: no whitelist entry for 1 of 2 "
        r"questions .*\['q2'\]",
    ):
        environment(*base)
    whitelist.write_text(json.dumps({"q1": ["a"], "q2": "b"}))
    with pytest.raises(
        DataError,
        match=r"examples.json: question 'q2': the documents must be "
        "a list of ids",
    ):
        environment(*base)
    whitelist.write_text("[1, 2")
    with pytest.raises(DataError, match="examples.json: cannot read the whitelist"):
        environment(*base)


def test_retrieval_settings_are_checked_when_loaded(tmp_path):
    hle = write_jsonl(tmp_path / "hle.jsonl", HLE_ROWS)
    cases = [
        (
            ["env=hle", f"env.path={hle}"],
            "env.retrieval.whitelist: scope whitelist needs a JSON file",
        ),
        (
            ["env=hle", f"env.path={hle}", "env.retrieval.scope=oracle"],
            "scope=oracle reads each row's own documents",
        ),
        (
            ["env=hle", f"env.path={hle}", "env.retrieval.scope=open", "env.retrieval.mode=hybrid"],
            "score_threshold applies to the dense cosine score",
        ),
        (["env=frames", f"env.path={hle}", "env.retrieval.top_k=151"], "1 <= top_k <= depth"),
        (
            ["env=frames", f"env.path={hle}", "env.retrieval.encoder.model=no/such/dir"],
            "env.retrieval.encoder.model: neither 'hashing' nor",
        ),
        (
            ["env=frames", f"env.path={hle}", "env.retrieval.encoder.preset=e5"],
            "the hashing encoder takes no preset",
        ),
        (["env.retrieval.depth=10"], "a offline environment has no option retrieval"),
    ]
    for overrides, message in cases:
        with pytest.raises(config_lib.ConfigError, match=message):
            config_lib.load(overrides)


def test_search_on_hle_retrieves_under_the_setting_and_falls_back_to_the_web(
    tmp_path, index_dir, tiny_tokenizer, monkeypatch
):
    """The whole path on tools=reference: the environment's toolbox, `search(model=search-2)`,
    its query writer (a scripted OpenAI-compatible server on 127.0.0.1), the whitelisted dense
    retrieval with the threshold, and below 3 documents the web search (a SIMULATED Tavily on
    127.0.0.1) after the documents that passed."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("TAVILY_API_KEY", "tvly-test")
    hle = write_jsonl(tmp_path / "hle.jsonl", HLE_ROWS)
    whitelist = tmp_path / "examples.json"
    whitelist.write_text(json.dumps({"q1": ["printing", "rome"], "q2": ["penicillin"]}))
    declarations = tmp_path / "reference"
    shutil.copytree(resolve_conf_path("tools/reference"), declarations)
    queries = {
        "Who printed with movable type?": "Gutenberg movable type printing press",
        "When was penicillin found?": "Alexander Fleming discovered penicillin",
    }

    def query_writer(prompt: str) -> str:
        return next(query for question, query in queries.items() if question in prompt)

    with ExitStack() as stack:
        tavily = SimulatedTavily(
            "tvly-test",
            lambda query: {
                "query": query,
                "results": [
                    {"title": "Web", "url": "https://example.org", "content": f"web: {query}"}
                ],
            },
        )
        stack.callback(tavily.stop)
        web = yaml.safe_load((declarations / "web_search.yaml").read_text())
        web["options"]["base_url"] = tavily.url
        (declarations / "web_search.yaml").write_text(yaml.safe_dump(web))
        writer = stack.enter_context(
            start_server(ScriptedEngine(tiny_tokenizer, query_writer), tiny_tokenizer, "gpt-5-mini")
        )
        env = environment(
            "env=hle",
            f"env.path={hle}",
            f"env.retrieval.whitelist={whitelist}",
            f"env.retrieval.index={index_dir}",
            "tools=reference",
            f"tools.declarations=['{declarations}']",
            f"+tools.endpoints.search-2='{writer.url}'",
        )
        toolbox = env.toolbox()

        async def search_each():
            async with toolbox:
                return [
                    await toolbox.call(
                        "search",
                        {"model": "search-2"},
                        ToolContext(
                            task_id=task.id, task=task, allowed_documents=task.allowed_documents
                        ),
                    )
                    for task in env.tasks("test", None, 0)
                ]

        printing, penicillin = asyncio.run(search_each())
    # q1: only "printing" of its list passes the threshold: fewer than 3, so the web too.
    assert printing.error is None and "Query:\nGutenberg movable type printing press" in (
        printing.output
    )
    documents, web_results = printing.output.split("Result:\n", 1)[1].split("\nWeb search:\n")
    assert [line[1:].split("]")[0] for line in documents.splitlines()] == ["printing"]
    assert "web: Gutenberg movable type printing press" in web_results
    assert "[penicillin]" in penicillin.output
    assert [request["body"]["query"] for request in tavily.requests] == [
        "Gutenberg movable type printing press",
        "Alexander Fleming discovered penicillin",
    ]
    # The fee of each web search is billed with the query writer's tokens.
    assert printing.cost_usd > web["pricing"]["per_call"]
