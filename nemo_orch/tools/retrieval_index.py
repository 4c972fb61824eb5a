"""The retriever's corpus and index: hybrid dense (FAISS) + sparse (BM25) search over a local
JSONL corpus, built, imported, saved and loaded.

Dense vectors catch paraphrase, BM25 catches rare exact terms; the two ranked lists are fused by
reciprocal rank fusion (RRF), which needs no score calibration between them. The tool that
searches an index (:class:`~nemo_orch.tools.retriever.Retriever`) and the batching of concurrent
searches live in :mod:`nemo_orch.tools.retriever`.

An index is a directory written by :func:`build_index` (or :func:`import_index`, from an existing
FAISS index and its corpus)::

    manifest.json   format, encoder description, dim, number of docs, corpus checksum, BM25 params
                    (``"sparse": false``: a dense-only index, no BM25 side)
    dense.faiss     inner-product FAISS index over L2-normalised embeddings (row i = doc i)
    sparse/         the bm25s index
    docs.jsonl      id, text, title of doc i on line i

The encoder is pluggable (:mod:`nemo_orch.tools.encoders`). An index only answers queries encoded
the way its documents were, so loading it with another encoder is an error.
:meth:`RetrievalIndex.search_many` answers a batch of queries with one encoder call and one FAISS
search.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import bm25s
import faiss
import numpy as np

from nemo_orch.data.jsonl import read_jsonl
from nemo_orch.tools.encoders import Encoder, RetrievalError, make_encoder, tokenize

# bm25s sets its logger to DEBUG on import; its per-build messages are noise here.
logging.getLogger("bm25s").setLevel(logging.WARNING)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DENSE_FILE = "dense.faiss"
SPARSE_DIR = "sparse"
DOCS_FILE = "docs.jsonl"

# BM25 parameters: the Lucene variant with the usual k1/b.
_BM25_PARAMS = {"method": "lucene", "k1": 1.5, "b": 0.75}
_ENCODE_BATCH = 256

Mode = Literal["hybrid", "dense", "sparse"]
MODES: tuple[str, ...] = get_args(Mode)
EncoderChoice = str | Path | Mapping[str, Any] | Encoder


# ----------------------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    title: str | None = None

    @property
    def indexed_text(self) -> str:
        return f"{self.title}\n{self.text}" if self.title else self.text


def read_corpus(path: str | Path) -> list[Document]:
    """Parse a JSONL corpus (``{"id": str, "text": str, "title"?: str, ...}`` per line; blank lines
    skipped); every problem is reported as ``file:line``. Existing corpora's spellings are read
    too: an integer id (kept as its decimal string) and ``contents`` in place of ``text``."""
    docs: list[Document] = []
    first_seen: dict[str, str] = {}
    for where, record in read_jsonl(path, "corpus document", RetrievalError):
        if not isinstance(record, dict):
            raise RetrievalError(f"{where}: a document must be a JSON object")
        doc_id, title = record.get("id"), record.get("title")
        text = record.get("text", record.get("contents"))
        if isinstance(doc_id, int) and not isinstance(doc_id, bool):
            doc_id = str(doc_id)
        if not isinstance(doc_id, str) or not doc_id:
            raise RetrievalError(f"{where}: 'id' must be a non-empty string or an integer")
        if not isinstance(text, str):
            raise RetrievalError(f"{where}: 'text' (or 'contents') must be a string")
        if title is not None and not isinstance(title, str):
            raise RetrievalError(f"{where}: 'title' must be a string")
        if doc_id in first_seen:
            raise RetrievalError(
                f"{where}: duplicate id {doc_id!r} (first at {first_seen[doc_id]})"
            )
        first_seen[doc_id] = where
        docs.append(Document(doc_id, text, title or None))
    return docs


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------ index


@dataclass(frozen=True)
class Hit:
    """One result. ``score`` is the fused RRF score (or the component's own score in a
    single-component search); ranks are 1-based, None where that component did not return it."""

    id: str
    text: str
    score: float
    title: str | None = None
    dense_rank: int | None = None
    dense_score: float | None = None
    sparse_rank: int | None = None
    sparse_score: float | None = None


def check_search(mode: str, score_threshold: float | None, has_sparse: bool = True) -> None:
    """A search ``mode`` and ``score_threshold`` that can go together on an index with (or
    without) a BM25 side. The threshold is on the dense score (the cosine of normalised
    vectors); fused RRF ranks have no scale a threshold could mean."""
    if mode not in MODES:
        raise RetrievalError(f"unknown search mode {mode!r} ({', '.join(MODES)})")
    if score_threshold is not None and mode != "dense":
        raise RetrievalError(
            f"a score threshold applies to the dense cosine score: search with "
            f"mode dense, not {mode} (its scores are fused ranks or BM25's)"
        )
    if mode != "dense" and not has_sparse:
        raise RetrievalError(
            f"the index is dense-only (no BM25 side): search with mode dense, "
            f"not {mode}, or import it with a BM25 side (index import --bm25)"
        )


class RetrievalIndex:
    """Documents with their FAISS and (optional) BM25 indexes; thread-safe for concurrent
    searches.

    ``rrf_k`` is RRF's rank offset (60 as in Cormack et al.); ``candidates`` is how deep each
    component's list goes before fusion.
    """

    def __init__(
        self,
        docs: list[Document],
        dense: faiss.Index,
        sparse: bm25s.BM25 | None,
        encoder: Encoder,
        manifest: dict[str, Any],
        rrf_k: float = 60.0,
        candidates: int = 100,
    ) -> None:
        if rrf_k <= 0 or candidates < 1:
            raise RetrievalError("rrf_k must be > 0 and candidates >= 1")
        self.docs, self.dense, self.sparse = docs, dense, sparse
        self.encoder, self.manifest = encoder, manifest
        self.rrf_k, self.candidates = rrf_k, candidates
        self._row = {doc.id: row for row, doc in enumerate(docs)}
        self._gpu_index: faiss.Index | None = None
        self._gpu_checked = False
        self._gpu_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.docs)

    @property
    def has_sparse(self) -> bool:
        return self.sparse is not None

    @staticmethod
    def _manifest(
        docs: list[Document], encoder: Encoder, corpus_sha256: str, sparse: bool
    ) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "encoder": encoder.describe(),
            "dim": encoder.dim,
            "num_docs": len(docs),
            "corpus_sha256": corpus_sha256,
            "sparse": sparse,
            **({"bm25": dict(_BM25_PARAMS)} if sparse else {}),
        }

    @staticmethod
    def _bm25(docs: list[Document]) -> bm25s.BM25:
        sparse = bm25s.BM25(**_BM25_PARAMS)
        sparse.index([tokenize(doc.indexed_text) for doc in docs], show_progress=False)
        return sparse

    @classmethod
    def build(
        cls, docs: list[Document], encoder: Encoder, corpus_sha256: str = "", **options: Any
    ) -> RetrievalIndex:
        """Embed and index ``docs`` in memory."""
        texts = [doc.indexed_text for doc in docs]
        dense = faiss.IndexFlatIP(encoder.dim)
        for start in range(0, len(texts), _ENCODE_BATCH):
            vectors = np.ascontiguousarray(
                encoder.encode(texts[start : start + _ENCODE_BATCH]), dtype=np.float32
            )
            if vectors.shape != (min(_ENCODE_BATCH, len(texts) - start), encoder.dim):
                raise RetrievalError(
                    f"encoder {encoder.name} returned shape {vectors.shape}, "
                    f"expected (batch, {encoder.dim})"
                )
            dense.add(vectors)
        return cls(
            docs,
            dense,
            cls._bm25(docs),
            encoder,
            cls._manifest(docs, encoder, corpus_sha256, sparse=True),
            **options,
        )

    def save(self, out_dir: str | Path) -> Path:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        # The manifest goes last: until it is rewritten, a half-overwritten index won't load.
        (out_dir / MANIFEST).unlink(missing_ok=True)
        faiss.write_index(self.dense, str(out_dir / DENSE_FILE))
        if self.sparse is not None:
            self.sparse.save(str(out_dir / SPARSE_DIR), show_progress=False)
        _write_docs(self.docs, out_dir / DOCS_FILE)
        (out_dir / MANIFEST).write_text(json.dumps(self.manifest, indent=2, sort_keys=True) + "\n")
        return out_dir

    @classmethod
    def load(
        cls, directory: str | Path, encoder: EncoderChoice = "hashing", **options: Any
    ) -> RetrievalIndex:
        directory = Path(directory)
        try:
            manifest = json.loads((directory / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise RetrievalError(
                f"{directory}: not a retrieval index (cannot read {MANIFEST}: {error})"
            ) from None
        if manifest.get("format_version") != FORMAT_VERSION:
            raise RetrievalError(
                f"{directory}: index format {manifest.get('format_version')!r}, "
                f"this version reads {FORMAT_VERSION}; rebuild the index"
            )
        encoder = make_encoder(encoder)
        if manifest.get("encoder") != encoder.describe():
            raise RetrievalError(
                f"{directory}: the index was built with encoder {manifest.get('encoder')}, but "
                f"the configured encoder is {encoder.describe()}; use that encoder or rebuild "
                "the index"
            )
        try:
            dense = faiss.read_index(str(directory / DENSE_FILE))
            sparse = (
                bm25s.BM25.load(str(directory / SPARSE_DIR), show_progress=False)
                if manifest.get("sparse", True)
                else None
            )
            with (directory / DOCS_FILE).open(encoding="utf-8") as handle:
                docs = [
                    Document(r["id"], r["text"], r.get("title")) for r in map(json.loads, handle)
                ]
        except (OSError, RuntimeError, ValueError, KeyError) as error:
            raise RetrievalError(f"{directory}: damaged index: {error}") from None
        if not len(docs) == dense.ntotal == manifest.get("num_docs"):
            raise RetrievalError(
                f"{directory}: damaged index: {len(docs)} docs, {dense.ntotal} "
                f"vectors, manifest says {manifest.get('num_docs')}"
            )
        return cls(docs, dense, sparse, encoder, manifest, **options)

    # -- search

    def _rows(self, allowed_ids: Iterable[str] | None) -> np.ndarray | None:
        if allowed_ids is None:
            return None
        return np.array(
            sorted({self._row[i] for i in allowed_ids if i in self._row}), dtype=np.int64
        )

    def _gpu(self) -> faiss.Index | None:
        """A GPU copy of the dense index, made on first use when faiss-gpu sees a GPU."""
        with self._gpu_lock:
            if not self._gpu_checked:
                self._gpu_checked = True
                if faiss.get_num_gpus() > 0:
                    self._gpu_index = faiss.index_cpu_to_all_gpus(self.dense)
            return self._gpu_index

    def _dense_search(
        self, vectors: np.ndarray, depth: int, rows: np.ndarray | None
    ) -> list[list[tuple[int, float]]]:
        """The ``depth`` best rows of each vector: one FAISS search for the whole batch."""
        if rows is None:
            gpu = self._gpu() if depth <= 2048 else None  # the GPU flat index's k limit
            if gpu is not None:
                with self._gpu_lock:
                    scores, labels = gpu.search(vectors, depth)
            else:
                scores, labels = self.dense.search(vectors, depth)
        else:
            # Exact restriction on the CPU index: only whitelisted rows are scored, so k allowed
            # hits come back whenever k allowed docs exist.
            # faiss's SWIG constructor sets any field by keyword; its generated types list none.
            params = faiss.SearchParameters(sel=faiss.IDSelectorBatch(rows))  # type: ignore[call-arg]
            scores, labels = self.dense.search(vectors, depth, params=params)
        return [
            [
                (int(label), float(score))
                for label, score in zip(row_labels, row_scores)
                if label >= 0
            ]
            for row_labels, row_scores in zip(labels, scores)
        ]

    def _sparse_search(
        self, query: str, depth: int, rows: np.ndarray | None
    ) -> list[tuple[int, float]]:
        assert self.sparse is not None  # checked by check_search
        token_ids = self.sparse.get_tokens_ids(tokenize(query))
        if not token_ids:
            return []
        scores = self.sparse.get_scores_from_ids(token_ids)
        if rows is not None:
            # Every doc is scored, so filtering first still leaves the best allowed ones.
            candidates = rows[scores[rows] > 0]
        else:
            candidates = np.flatnonzero(scores > 0)
        if len(candidates) > depth:
            candidates = candidates[np.argpartition(-scores[candidates], depth - 1)[:depth]]
        order = sorted(candidates.tolist(), key=lambda row: (-scores[row], row))
        return [(row, float(scores[row])) for row in order]

    def search(
        self,
        query: str,
        k: int = 5,
        allowed_ids: Iterable[str] | None = None,
        mode: Mode = "hybrid",
        score_threshold: float | None = None,
    ) -> list[Hit]:
        """The ``k`` best documents for ``query``, restricted to ``allowed_ids`` when given
        (unknown ids are ignored). ``mode`` picks one component alone; ``score_threshold``
        (dense mode only) keeps hits whose cosine score is above it."""
        return self.search_many([query], k, [allowed_ids], mode, score_threshold)[0]

    def search_many(
        self,
        queries: Sequence[str],
        k: int = 5,
        allowed_ids: Sequence[Iterable[str] | None] | None = None,
        mode: Mode = "hybrid",
        score_threshold: float | None = None,
    ) -> list[list[Hit]]:
        """:meth:`search` for a batch: the queries are encoded in one call, and those searching
        the whole index share one FAISS search (a restricted one is searched on its own rows).
        ``allowed_ids``: one whitelist (or None) per query; None: no query is restricted."""
        check_search(mode, score_threshold, self.has_sparse)
        restrictions = [None] * len(queries) if allowed_ids is None else list(allowed_ids)
        if len(restrictions) != len(queries):
            raise ValueError(f"{len(queries)} queries but {len(restrictions)} whitelists")
        rows = [self._rows(allowed) for allowed in restrictions]
        pools = [len(self.docs) if restricted is None else len(restricted) for restricted in rows]
        depths = [min(pool, max(k, self.candidates) if mode == "hybrid" else k) for pool in pools]
        dense: list[list[tuple[int, float]]] = [[] for _ in queries]
        if mode != "sparse" and queries:
            vectors = np.ascontiguousarray(
                self.encoder.encode(list(queries), query=True), dtype=np.float32
            )
            open_ones = [i for i, restricted in enumerate(rows) if restricted is None]
            if open_ones and depths[open_ones[0]] > 0:
                found = self._dense_search(vectors[open_ones], depths[open_ones[0]], None)
                for i, ranked in zip(open_ones, found):
                    dense[i] = ranked
            for i, restricted in enumerate(rows):
                if restricted is not None and depths[i] > 0:
                    dense[i] = self._dense_search(vectors[i : i + 1], depths[i], restricted)[0]
        results = []
        for i, query in enumerate(queries):
            if k < 1 or depths[i] == 0:
                results.append([])
                continue
            sparse = self._sparse_search(query, depths[i], rows[i]) if mode != "dense" else []
            ranked = (
                dense[i]
                if score_threshold is None
                else [(row, score) for row, score in dense[i] if score > score_threshold]
            )
            results.append(self._fuse(ranked, sparse, k, mode))
        return results

    def _fuse(
        self, dense: list[tuple[int, float]], sparse: list[tuple[int, float]], k: int, mode: str
    ) -> list[Hit]:
        found: dict[int, dict[str, Any]] = {}
        for component, ranked in (("dense", dense), ("sparse", sparse)):
            for rank, (row, score) in enumerate(ranked, start=1):
                entry = found.setdefault(row, {"fused": 0.0})
                entry[f"{component}_rank"], entry[f"{component}_score"] = rank, score
                entry["fused"] += 1.0 / (self.rrf_k + rank)
        if mode != "hybrid":
            for entry in found.values():
                entry["fused"] = entry[f"{mode}_score"]
        best = sorted(found.items(), key=lambda item: (-item[1]["fused"], item[0]))[:k]
        hits = []
        for row, entry in best:
            doc = self.docs[row]
            fused = entry.pop("fused")
            hits.append(Hit(doc.id, doc.text, fused, doc.title, **entry))
        return hits


def _write_docs(docs: Sequence[Document], path: Path) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for doc in docs:
            record = {"id": doc.id, "text": doc.text}
            if doc.title:
                record["title"] = doc.title
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def index_corpus(
    corpus_path: str | Path, encoder: EncoderChoice = "hashing", **options: Any
) -> RetrievalIndex:
    """A JSONL corpus indexed in memory, its checksum in the manifest; ``options`` as
    :class:`RetrievalIndex` takes them (``rrf_k``, ``candidates``)."""
    corpus_path = Path(corpus_path)
    docs = read_corpus(corpus_path)
    return RetrievalIndex.build(
        docs, make_encoder(encoder), corpus_sha256=_sha256(corpus_path), **options
    )


def build_index(
    corpus_path: str | Path, out_dir: str | Path, encoder: EncoderChoice = "hashing"
) -> Path:
    """Build a retrieval index from a JSONL corpus and write it to ``out_dir`` (returned)."""
    return index_corpus(corpus_path, encoder).save(out_dir)


def import_index(
    faiss_path: str | Path,
    corpus_path: str | Path,
    out_dir: str | Path,
    encoder: EncoderChoice,
    bm25: bool = False,
) -> Path:
    """An existing FAISS index (row i embeds line i of its JSONL corpus, e.g. the reference's
    wiki or HLE index) as an index of ours in ``out_dir``: the FAISS file is linked (copied
    across file systems), the corpus rewritten as ``docs.jsonl``, the manifest names
    ``encoder``, the one the index was built with. Dense-only unless ``bm25`` (then BM25 is
    built from the corpus). The FAISS index must score by inner product; its dimension must be
    the encoder's and its size the corpus's: a mismatch is an error naming both."""
    faiss_path, corpus_path, out_dir = Path(faiss_path), Path(corpus_path), Path(out_dir)
    try:
        dense = faiss.read_index(str(faiss_path))
    except RuntimeError as error:
        raise RetrievalError(f"{faiss_path}: not a FAISS index: {error}") from None
    if dense.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise RetrievalError(
            f"{faiss_path}: the index scores by FAISS metric "
            f"{dense.metric_type}, not inner product (METRIC_INNER_PRODUCT = "
            f"{faiss.METRIC_INNER_PRODUCT}); retrieval ranks by cosine"
        )
    model = make_encoder(encoder)
    if dense.d != model.dim:
        raise RetrievalError(
            f"dimension mismatch: {faiss_path} holds {dense.d}-dimensional "
            f"vectors, the encoder {model.describe()['type']} writes {model.dim}"
        )
    docs = read_corpus(corpus_path)
    if dense.ntotal != len(docs):
        raise RetrievalError(
            f"size mismatch: {faiss_path} holds {dense.ntotal} vectors, "
            f"{corpus_path} {len(docs)} documents"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)
    target = out_dir / DENSE_FILE
    target.unlink(missing_ok=True)
    try:
        os.link(faiss_path, target)
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(faiss_path, target)
    if bm25:
        RetrievalIndex._bm25(docs).save(str(out_dir / SPARSE_DIR), show_progress=False)
    _write_docs(docs, out_dir / DOCS_FILE)
    manifest = RetrievalIndex._manifest(docs, model, _sha256(corpus_path), sparse=bm25)
    manifest["imported_from"] = {"faiss": faiss_path.name, "corpus": corpus_path.name}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return out_dir


def load_index(
    directory: str | Path,
    encoder: EncoderChoice = "hashing",
    rrf_k: float = 60.0,
    candidates: int = 100,
) -> RetrievalIndex:
    """Load an index written by :func:`build_index` or :func:`import_index`; ``encoder`` must be
    the one it was built with (compared by ``describe()``)."""
    return RetrievalIndex.load(directory, encoder, rrf_k=rrf_k, candidates=candidates)
