from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest
from support.retrieval_corpus import LABELLED, TOPICS, make_corpus

from nemo_orch import cli
from nemo_orch.tools.base import Tool, ToolContext
from nemo_orch.tools.encoders import HashingEncoder, HFEncoder, RetrievalError
from nemo_orch.tools.retrieval_index import (
    RetrievalIndex,
    build_index,
    import_index,
    load_index,
    read_corpus,
)
from nemo_orch.tools.retriever import Retriever, default_spec


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "docs.jsonl")


@pytest.fixture(scope="module")
def index_dir(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_index(corpus, tmp_path_factory.mktemp("index") / "idx", HashingEncoder())


@pytest.fixture(scope="module")
def index(index_dir: Path) -> RetrievalIndex:
    return load_index(index_dir)


def run_tool(tool: Retriever, arguments: dict, context: ToolContext = ToolContext()):
    return asyncio.run(tool.call(arguments, context))


def test_build_writes_a_complete_index_and_reload_matches_memory(corpus, index_dir, index):
    manifest = json.loads((index_dir / "manifest.json").read_text())
    assert manifest["num_docs"] == len(TOPICS) + 300
    assert manifest["dim"] == 384
    assert manifest["encoder"] == HashingEncoder().describe()
    assert manifest["corpus_sha256"] == hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert {p.name for p in index_dir.iterdir()} >= {
        "manifest.json",
        "dense.faiss",
        "sparse",
        "docs.jsonl",
    }
    in_memory = RetrievalIndex.build(read_corpus(corpus), HashingEncoder())
    for query, _ in LABELLED:
        assert index.search(query, 5) == in_memory.search(query, 5)
    filler = next(doc for doc in index.docs if doc.title)
    assert filler.title.endswith(" news")


def test_paraphrase_ranks_the_answering_doc_first(index):
    # "immunization"/"pathogens" never occur in the corpus: BM25 cannot match, the subword
    # vectors can ("immune", "pathogen").
    hits = index.search("immunization against pathogens", 3)
    assert hits[0].id == "vaccine"
    assert hits[0].sparse_rank is None and hits[0].dense_rank == 1
    hits = index.search("volcanic eruptions of magma", 3)
    assert hits[0].id == "volcano"
    assert hits[0].dense_rank == 1 and hits[0].sparse_rank == 1


def test_fused_scores_are_reciprocal_rank_sums(index):
    for hit in index.search("first ascent of the highest peak", 10):
        expected = sum(
            1.0 / (60 + rank) for rank in (hit.dense_rank, hit.sparse_rank) if rank is not None
        )
        assert hit.score == pytest.approx(expected)
    scores = [hit.score for hit in index.search("ice carving valleys", 10)]
    assert scores == sorted(scores, reverse=True)


def test_fusion_recalls_at_least_as_much_as_each_component(index):
    def ranks(mode: str) -> dict[str, int | None]:
        found = {}
        for query, gold in LABELLED:
            ids = [hit.id for hit in index.search(query, 10, mode=mode)]
            found[gold] = ids.index(gold) + 1 if gold in ids else None
        return found

    dense, sparse, hybrid = ranks("dense"), ranks("sparse"), ranks("hybrid")

    def recall(found: dict[str, int | None], k: int) -> int:
        return sum(rank is not None and rank <= k for rank in found.values())

    # The hashing encoder has no IDF, so generic words ("sea", "light") can outvote a single
    # BM25 first place (RRF rewards two middling ranks): fusion is not better at every cut-off
    # on this set, but its top 3 hold at least as many answers as either list's.
    assert recall(hybrid, 3) >= max(recall(dense, 3), recall(sparse, 3))
    assert recall(hybrid, 1) >= recall(dense, 1)
    # Both components contribute: a doc only the dense side finds, and one the dense side
    # ranks poorly that BM25 lifts into the fused top 2.
    assert sparse["vaccine"] is None and hybrid["vaccine"] == 1
    assert dense["photosynthesis"] > 3 and hybrid["photosynthesis"] <= 2


def test_single_component_scores(index):
    dense = index.search("volcanic eruptions of magma", 3, mode="dense")
    assert dense[0].score == pytest.approx(dense[0].dense_score) and dense[0].sparse_rank is None
    assert 0.0 < dense[0].score <= 1.0 + 1e-6  # cosine similarity of normalised vectors
    sparse = index.search("volcanic eruptions of magma", 3, mode="sparse")
    assert sparse[0].score == pytest.approx(sparse[0].sparse_score) and sparse[0].dense_rank is None
    with pytest.raises(ValueError, match="mode"):
        index.search("x", 3, mode="bogus")


def test_whitelist_restricts_results_and_still_fills_k(index_dir):
    shallow = load_index(index_dir, candidates=5)
    unrestricted = [hit.id for hit in shallow.search("volcanic eruptions of magma", len(shallow))]
    # The allowed docs are those ranked last overall: far below any candidate depth.
    allowed = frozenset(unrestricted[-6:]) | {"no-such-doc"}
    hits = shallow.search("volcanic eruptions of magma", 4, allowed_ids=allowed)
    assert len(hits) == 4 and {hit.id for hit in hits} <= allowed
    assert len(shallow.search("volcanic eruptions of magma", 10, allowed_ids=allowed)) == 6
    # BM25 alone: only allowed docs that share a term with the query.
    hits = shallow.search("penicillin", 3, allowed_ids={"penicillin", "volcano"}, mode="sparse")
    assert [hit.id for hit in hits] == ["penicillin"]
    assert shallow.search("penicillin", 3, allowed_ids=frozenset()) == []


def test_tool_output_whitelist_and_truncation(index_dir):
    tool = Retriever(index_dir=index_dir, max_chars_per_doc=30)
    assert isinstance(tool, Tool)
    assert tool.spec == default_spec() and tool.spec.deterministic
    result = run_tool(tool, {"query": "volcanic eruptions of magma", "top_k": 2})
    assert result.error is None
    lines = result.output.splitlines()
    assert len(lines) == 2
    assert lines[0] == "[volcano] Volcanoes erupt when molten ma..."
    context = ToolContext(task_id="t", allowed_documents=frozenset({"dna", "jazz"}))
    result = run_tool(tool, {"query": "volcanic eruptions of magma"}, context)
    assert {line.split("]")[0][1:] for line in result.output.splitlines()} == {"dna", "jazz"}
    empty = run_tool(tool, {"query": "magma"}, ToolContext(allowed_documents=frozenset()))
    assert empty.error is None and empty.output == "No documents found."


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({}, "missing argument 'query'"),
        ({"query": "   "}, "non-empty"),
        ({"query": 3}, "type string"),
        ({"query": "magma", "top_k": 0}, ">= 1"),
        ({"query": "magma", "top_k": 21}, "<= 20"),
        ({"query": "magma", "top_k": "3"}, "type integer"),
        ({"query": "magma", "top_k": True}, "type integer"),
        ({"query": "magma", "k": 3}, "undeclared argument 'k'"),
    ],
)
def test_bad_arguments_are_error_results(index_dir, arguments, message):
    result = run_tool(Retriever(index_dir=index_dir), arguments)
    assert result.error is not None and message in result.error and result.output == ""


def test_tool_builds_from_a_corpus_in_memory(corpus):
    tool = Retriever(corpus=corpus, top_k=1)
    result = run_tool(tool, {"query": "Gutenberg movable type"})
    assert result.output.startswith("[printing] Johannes Gutenberg")
    with pytest.raises(RetrievalError, match="exactly one"):
        Retriever(corpus=corpus, index_dir=corpus.parent)
    with pytest.raises(RetrievalError, match="exactly one"):
        Retriever()


def test_tool_searches_one_component_alone_when_configured(index_dir):
    query = {"query": "penicillin mold", "top_k": 3}
    sparse = run_tool(Retriever(index_dir=index_dir, mode="sparse"), query)
    expected = load_index(index_dir).search("penicillin mold", 3, mode="sparse")
    assert [line.split("]")[0][1:] for line in sparse.output.splitlines()] == [
        hit.id for hit in expected
    ]
    with pytest.raises(RetrievalError, match="unknown search mode 'bm25'"):
        Retriever(index_dir=index_dir, mode="bm25")


def test_a_call_without_query_searches_for_the_task_question(index_dir):
    from nemo_orch.data.tasks import Task

    spec = dataclasses.replace(
        default_spec(),
        parameters={"type": "object", "properties": {"query": {"type": "string"}}, "required": []},
    )
    tool = Retriever(spec, index_dir=index_dir, top_k=1, question_as_query=True)
    task = Task("t", "Who invented movable type printing, Gutenberg?")
    result = run_tool(tool, {}, ToolContext(task=task))
    assert result.output.startswith("[printing]")
    assert run_tool(tool, {"query": "penicillin"}, ToolContext(task=task)).output.startswith(
        "[penicillin]"
    )
    missing = run_tool(tool, {}, ToolContext())  # no task to take the question from
    assert missing.error is not None and "query" in missing.error
    plain = run_tool(Retriever(spec, index_dir=index_dir), {}, ToolContext(task=task))
    assert plain.error is not None and "query" in plain.error


def test_encoder_mismatch_is_a_clear_error(index_dir):
    with pytest.raises(RetrievalError, match="built with encoder .* configured encoder"):
        load_index(index_dir, HashingEncoder(dim=128))
    with pytest.raises(RetrievalError, match="built with encoder"):
        Retriever(index_dir=index_dir, encoder=HashingEncoder(ngram_range=(2, 4)))
    with pytest.raises(RetrievalError, match="not a retrieval index"):
        load_index(index_dir.parent)
    with pytest.raises(RetrievalError, match="neither 'hashing' nor"):
        load_index(index_dir, "no/such/model")


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"id": "a", "text": "x"}', '{"id": "b", "text": '], ":2: not valid JSON"),
        (['["a", "x"]'], ":1: a document must be a JSON object"),
        (['{"text": "x"}'], ":1: 'id' must be a non-empty string"),
        (['{"id": true, "text": "x"}'], ":1: 'id' must be a non-empty string or an integer"),
        (['{"id": "a", "text": null}'], ":1: 'text' \\(or 'contents'\\) must be a string"),
        (['{"id": 7, "text": "x"}', '{"id": "7", "contents": "y"}'], ":2: duplicate id '7'"),
        (['{"id": "a", "text": "x", "title": 1}'], ":1: 'title' must be a string"),
        (
            ['{"id": "a", "text": "x"}', "", '{"id": "a", "text": "y"}'],
            ":3: duplicate id 'a' \\(first at .*bad.jsonl:1\\)",
        ),
        (["", "  "], "no corpus documents"),
    ],
)
def test_malformed_corpus_names_file_and_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        RetrievalError, match=f"bad.jsonl{message}" if message[0] == ":" else message
    ):
        build_index(path, tmp_path / "idx")
    assert not (tmp_path / "idx").exists()


def test_missing_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(RetrievalError, match="cannot read the corpus"):
        read_corpus(tmp_path / "absent.jsonl")


def test_hashing_encoder_is_deterministic_across_processes():
    text = "Volcanoes erupt when molten magma rises"
    script = (
        "import sys; from nemo_orch.tools.encoders import HashingEncoder; "
        "sys.stdout.write(HashingEncoder().encode([sys.argv[1]]).tobytes().hex())"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script, text],
            check=True,
            capture_output=True,
            text=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    vector = HashingEncoder().encode([text])
    assert outputs == {vector.tobytes().hex()}
    assert vector.dtype == np.float32 and vector.shape == (1, 384)
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-6)
    assert not HashingEncoder().encode(["the of and"]).any()  # stopwords only: a zero vector


def _tiny_bert(directory: Path, tokenizer_dir: Path, seed: int) -> Path:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(directory)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, directory / file.name)
    return directory


def test_hf_encoder_from_a_local_directory(tmp_path, corpus, tiny_tokenizer_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_dir = _tiny_bert(tmp_path / "bert", tiny_tokenizer_dir, seed=0)
    encoder = HFEncoder(model_dir)
    vectors = encoder.encode(["a short text", "a much longer text " * 40])  # truncated at 64
    assert vectors.shape == (2, 32) and vectors.dtype == np.float32
    assert np.linalg.norm(vectors, axis=1) == pytest.approx([1.0, 1.0], abs=1e-5)

    out = build_index(corpus, tmp_path / "idx", encoder)
    assert json.loads((out / "manifest.json").read_text())["encoder"]["type"] == "hf"
    reloaded = load_index(out, str(model_dir))
    text = TOPICS["printing"]
    assert reloaded.search(text, 1, mode="dense")[0].id == "printing"
    with pytest.raises(RetrievalError, match="built with encoder"):
        load_index(out)  # the default hashing encoder
    other = _tiny_bert(tmp_path / "bert2", tiny_tokenizer_dir, seed=1)
    with pytest.raises(RetrievalError, match="built with encoder"):
        load_index(out, other)
    with pytest.raises(RetrievalError, match="no config.json"):
        HFEncoder(tmp_path)


@pytest.mark.parametrize("mode", ["hybrid", "dense", "sparse"])
def test_search_many_answers_as_searches_one_by_one(index, mode):
    queries = [query for query, _ in LABELLED] + ["", "zzzz qqqq"]
    whitelists = [
        None if i % 3 else {"dna", "jazz", "rome", "filler-001"} for i in range(len(queries))
    ]
    batched = index.search_many(queries, 4, whitelists, mode)
    assert batched == [
        index.search(query, 4, allowed, mode) for query, allowed in zip(queries, whitelists)
    ]
    assert [hits[0].id for hits in index.search_many(queries[:3], 1, None, mode)] == [
        index.search(query, 1, mode=mode)[0].id for query in queries[:3]
    ]
    with pytest.raises(ValueError, match="2 queries but 1 whitelists"):
        index.search_many(queries[:2], 1, [None], mode)


def test_search_many_encodes_once_and_searches_faiss_once(index, monkeypatch):
    calls = {"encode": 0, "faiss": 0}
    encode, search = index.encoder.encode, index.dense.search

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(index.encoder, "encode", counted("encode", encode))
    monkeypatch.setattr(index.dense, "search", counted("faiss", search))
    index.search_many([query for query, _ in LABELLED], 3, mode="dense")
    assert calls == {"encode": 1, "faiss": 1}


def test_score_threshold_keeps_dense_hits_above_it(index):
    query = LABELLED[0][0]
    scores = [hit.score for hit in index.search(query, 50, mode="dense")]
    threshold = (scores[2] + scores[3]) / 2  # between the third and the fourth hit
    kept = index.search(query, 50, mode="dense", score_threshold=threshold)
    assert [hit.score for hit in kept] == scores[:3]
    assert all(hit.score == hit.dense_score > threshold for hit in kept)
    for mode in ("hybrid", "sparse"):
        with pytest.raises(RetrievalError, match="threshold applies to the dense cosine"):
            index.search(query, 5, mode=mode, score_threshold=0.1)


def test_concurrent_calls_search_in_batches(index_dir):
    tool = Retriever(index_dir=index_dir, mode="dense")
    queries = [query for query, _ in LABELLED]
    allowed = frozenset({"dna", "jazz", "rome"})

    async def together():
        return await asyncio.gather(
            *(
                tool.call(
                    {"query": query, "top_k": 2},
                    ToolContext(allowed_documents=allowed if i == 0 else None),
                )
                for i, query in enumerate(queries)
            )
        )

    results = asyncio.run(together())
    # The first call starts a batch alone; the others arrive while it runs and go together.
    assert tool.batcher.searches == len(queries) and tool.batcher.batches <= 3
    one_by_one = Retriever(index_dir=index_dir, mode="dense")
    assert [r.output for r in results] == [
        run_tool(
            one_by_one,
            {"query": query, "top_k": 2},
            ToolContext(allowed_documents=allowed if i == 0 else None),
        ).output
        for i, query in enumerate(queries)
    ]
    assert one_by_one.batcher.batches == len(queries)


def _existing_index(
    tmp_path: Path, corpus: Path, dim: int = 384, metric: int = faiss.METRIC_INNER_PRODUCT
) -> tuple[Path, Path]:
    """An index built elsewhere, as the reference's are: a FAISS file and its corpus with
    integer ids and ``contents``."""
    docs = read_corpus(corpus)
    reference = tmp_path / "reference_corpus.jsonl"
    reference.write_text(
        "".join(
            json.dumps({"id": i, "contents": doc.indexed_text}) + "\n" for i, doc in enumerate(docs)
        )
    )
    vectors = HashingEncoder(dim=dim).encode([doc.indexed_text for doc in docs])
    flat = (
        faiss.IndexFlatIP(dim) if metric == faiss.METRIC_INNER_PRODUCT else faiss.IndexFlatL2(dim)
    )
    flat.add(vectors)
    faiss.write_index(flat, str(tmp_path / "e5_Flat.index"))
    return tmp_path / "e5_Flat.index", reference


def test_an_existing_faiss_index_is_imported_dense_only(tmp_path, corpus, index):
    faiss_file, reference = _existing_index(tmp_path, corpus)
    out = import_index(faiss_file, reference, tmp_path / "imported", "hashing")
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["sparse"], manifest["num_docs"], manifest["dim"]) == (False, len(index), 384)
    assert manifest["encoder"] == HashingEncoder().describe()
    assert not (out / "sparse").exists()
    imported = load_index(out)
    names = {str(i): doc.id for i, doc in enumerate(index.docs)}
    for query, _ in LABELLED:
        assert [names[hit.id] for hit in imported.search(query, 3, mode="dense")] == [
            hit.id for hit in index.search(query, 3, mode="dense")
        ]
    with pytest.raises(RetrievalError, match="dense-only"):
        imported.search("music", 3)  # hybrid needs BM25
    with pytest.raises(RetrievalError, match="dense-only"):
        Retriever(index_dir=out)
    assert run_tool(Retriever(index_dir=out, mode="dense"), {"query": "jazz"}).error is None
    hybrid = load_index(
        import_index(faiss_file, reference, tmp_path / "with_bm25", "hashing", bm25=True)
    )
    assert hybrid.has_sparse and hybrid.search("Gutenberg movable type", 1)[0].id == next(
        key for key, name in names.items() if name == "printing"
    )


def test_an_import_that_does_not_match_names_both_sides(tmp_path, corpus):
    faiss_file, reference = _existing_index(tmp_path, corpus, dim=128)
    with pytest.raises(
        RetrievalError,
        match=r"dimension mismatch: .*e5_Flat.index holds "
        r"128-dimensional vectors, the encoder hashing writes 384",
    ):
        import_index(faiss_file, reference, tmp_path / "out", "hashing")
    faiss_file, reference = _existing_index(tmp_path, corpus)
    with reference.open("a") as handle:
        handle.write(json.dumps({"id": 10_000, "contents": "one more"}) + "\n")
    with pytest.raises(
        RetrievalError,
        match=r"size mismatch: .*e5_Flat.index holds 312 "
        r"vectors, .*reference_corpus.jsonl 313 documents",
    ):
        import_index(faiss_file, reference, tmp_path / "out", "hashing")
    faiss_file, reference = _existing_index(tmp_path, corpus, metric=faiss.METRIC_L2)
    with pytest.raises(RetrievalError, match="not inner product"):
        import_index(faiss_file, reference, tmp_path / "out", "hashing")
    (tmp_path / "junk.index").write_bytes(b"not faiss")
    with pytest.raises(RetrievalError, match="junk.index: not a FAISS index"):
        import_index(tmp_path / "junk.index", reference, tmp_path / "out", "hashing")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_index_import_command(tmp_path, corpus, capsys):
    faiss_file, reference = _existing_index(tmp_path, corpus)
    out = tmp_path / "cli"
    args = [
        "index",
        "import",
        "--faiss",
        str(faiss_file),
        "--corpus",
        str(reference),
        "--out",
        str(out),
        "--encoder",
        "hashing",
    ]
    assert cli.main(args) == 0
    assert "312 documents" in capsys.readouterr().out and (out / "manifest.json").is_file()
    assert cli.main([*args[:-1], str(tmp_path / "no-such-encoder")]) == 2
    assert "neither 'hashing' nor" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(faiss.get_num_gpus() == 0, reason="needs faiss-gpu and a GPU")
def test_gpu_index_agrees_with_cpu(index_dir):
    gpu = load_index(index_dir)
    cpu = load_index(index_dir)
    cpu._gpu_checked = True  # never moves to the GPU
    for query, _ in LABELLED:
        assert gpu.search(query, 1)[0].id == cpu.search(query, 1)[0].id
    assert gpu._gpu_index is not None
    allowed = {"dna", "jazz", "rome"}
    assert {h.id for h in gpu.search("music", 3, allowed_ids=allowed)} == allowed
