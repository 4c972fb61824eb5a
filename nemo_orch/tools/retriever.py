"""The ``retriever`` tool: hybrid dense (FAISS) + sparse (BM25) search over a local JSONL corpus.

ToolOrchestra's basic tools include a local retriever over a fixed corpus (e.g. the documents of an
HLE or FRAMES task). Dense vectors catch paraphrase, BM25 catches rare exact terms; the two ranked
lists are fused by reciprocal rank fusion (RRF), which needs no score calibration between them.

An index is a directory written by :func:`build_index`::

    manifest.json   format, encoder description, dim, number of docs, corpus checksum, BM25 params
    dense.faiss     inner-product FAISS index over L2-normalised embeddings (row i = doc i)
    sparse/         the bm25s index
    docs.jsonl      id, text, title of doc i on line i

The encoder is pluggable (:class:`Encoder`). :class:`HashingEncoder` needs no model download and is
the offline default; :class:`HFEncoder` mean-pools any local Hugging Face encoder. An index only
answers queries encoded the way its documents were, so loading it with another encoder is an error.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Protocol, get_args, runtime_checkable

import bm25s
import faiss
import numpy as np
from bm25s.stopwords import STOPWORDS_EN

from nemo_orch.data.jsonl import read_jsonl
from nemo_orch.tools.base import BaseTool, ToolContext, ToolError, ToolResult, ToolSpec, Usage
from nemo_orch.tools.schema import argument_errors

# bm25s sets its logger to DEBUG on import; its per-build messages are noise here.
logging.getLogger("bm25s").setLevel(logging.WARNING)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DENSE_FILE = "dense.faiss"
SPARSE_DIR = "sparse"
DOCS_FILE = "docs.jsonl"

_WORD_RE = re.compile(r"\w+")
_STOPWORDS = frozenset(STOPWORDS_EN)
# BM25 parameters: the Lucene variant with the usual k1/b.
_BM25_PARAMS = {"method": "lucene", "k1": 1.5, "b": 0.75}
_ENCODE_BATCH = 256

Mode = Literal["hybrid", "dense", "sparse"]
MODES: tuple[str, ...] = get_args(Mode)


class RetrievalError(ToolError):
    """A corpus, index or encoder that cannot be used (raised at build/load time)."""


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens without English stopwords: BM25's terms and the hashing
    encoder's words, so both sides of an index agree on what a term is."""
    return [word for word in _WORD_RE.findall(text.lower()) if word not in _STOPWORDS]


# --------------------------------------------------------------------------------------- encoders


@runtime_checkable
class Encoder(Protocol):
    """Texts to L2-normalised float32 vectors of size ``dim``. ``describe()`` identifies the
    encoder in an index's manifest: two encoders with equal descriptions embed alike."""

    name: str
    dim: int

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...

    def describe(self) -> dict[str, Any]: ...


def _normalise(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)


class HashingEncoder:
    """Signed feature hashing of words and their character n-grams (fastText-style subwords).

    Needs no model, so an index can be built anywhere offline; n-grams make morphological variants
    ("volcanic" / "volcano") land near each other, which BM25 without a stemmer misses. Buckets
    come from BLAKE2b, not Python's per-process salted ``hash()``, so vectors are identical across
    processes and machines.
    """

    name = "hashing"
    _VERSION = 1

    def __init__(self, dim: int = 384, ngram_range: tuple[int, int] = (3, 5),
                 cache_size: int = 1 << 18) -> None:
        if dim < 2:
            raise RetrievalError(f"hashing encoder: dim must be >= 2, got {dim}")
        low, high = ngram_range
        if not 1 <= low <= high:
            raise RetrievalError(f"hashing encoder: bad ngram_range {ngram_range}")
        self.dim = dim
        self.ngram_range = (low, high)
        # Per-word (buckets, signed weights); bounded so a huge vocabulary cannot exhaust memory.
        self._word_features = lru_cache(maxsize=cache_size)(self._features)

    def describe(self) -> dict[str, Any]:
        return {"type": self.name, "version": self._VERSION, "dim": self.dim,
                "ngram_range": list(self.ngram_range)}

    def _bucket(self, feature: str) -> tuple[int, float]:
        value = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "little")
        return value % self.dim, 1.0 if value >> 63 else -1.0

    def _features(self, word: str) -> tuple[np.ndarray, np.ndarray]:
        padded = f"<{word}>"
        low, high = self.ngram_range
        grams = [padded[i:i + n] for n in range(low, high + 1) for i in range(len(padded) - n + 1)]
        # No corpus statistics, so no IDF: word length stands in for rarity (longer words are
        # rarer, Zipf's law of abbreviation). The word and all its n-grams weigh alike.
        weight = (min(len(word), 12) / 5.0) ** 2
        features = [(f"w:{word}", weight)]
        features += [(f"c:{gram}", weight / math.sqrt(len(grams))) for gram in grams]
        buckets = np.empty(len(features), dtype=np.int64)
        weights = np.empty(len(features), dtype=np.float64)
        for i, (feature, weight) in enumerate(features):
            buckets[i], sign = self._bucket(feature)
            weights[i] = sign * weight
        return buckets, weights

    def _encode_one(self, text: str) -> np.ndarray:
        counts = Counter(tokenize(text))
        if not counts:
            return np.zeros(self.dim)
        buckets, weights = [], []
        for word, count in counts.items():
            word_buckets, word_weights = self._word_features(word)
            buckets.append(word_buckets)
            weights.append(word_weights * (1.0 + math.log(count)))
        return np.bincount(np.concatenate(buckets), np.concatenate(weights), minlength=self.dim)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return _normalise(np.stack([self._encode_one(text) for text in texts]))


def _fingerprint(model_dir: Path) -> str:
    """Identify a local model cheaply: config and tokenizer files in full, weight files by size
    and their first and last MiB (hashing multi-GB weights on every load would be slow)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
        digest.update(path.name.encode())
        if path.suffix in {".json", ".txt", ".model"}:
            digest.update(path.read_bytes())
        elif path.suffix in {".safetensors", ".bin", ".pt", ".pth"}:
            size = path.stat().st_size
            digest.update(str(size).encode())
            with path.open("rb") as handle:
                digest.update(handle.read(1 << 20))
                handle.seek(max(0, size - (1 << 20)))
                digest.update(handle.read(1 << 20))
    return digest.hexdigest()


class HFEncoder:
    """Mean-pooled last hidden states of a local Hugging Face encoder (BERT, E5, BGE, Qwen3 ...).

    Loaded with ``local_files_only=True``: nothing is downloaded at run time. Runs on CUDA when
    available.
    """

    name = "hf"

    def __init__(self, model_dir: str | Path, max_length: int = 512, batch_size: int = 32) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise RetrievalError(f"{self.model_dir}: not a Hugging Face model directory "
                                 "(no config.json)")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
            self.model = AutoModel.from_pretrained(self.model_dir, local_files_only=True)
        except (OSError, ValueError) as error:
            raise RetrievalError(f"{self.model_dir}: cannot load the encoder: {error}") from None
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self._torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model.to(self.device).eval()
        config = self.model.config
        self.dim = int(config.hidden_size)
        self.max_length = min(max_length, getattr(config, "max_position_embeddings", max_length))
        self.batch_size = batch_size
        self._fingerprint = _fingerprint(self.model_dir)

    def describe(self) -> dict[str, Any]:
        return {"type": self.name, "model_type": self.model.config.model_type, "dim": self.dim,
                "pooling": "mean", "max_length": self.max_length,
                "fingerprint": self._fingerprint}

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        torch = self._torch
        chunks = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(list(texts[start:start + self.batch_size]), padding=True,
                                       truncation=True, max_length=self.max_length,
                                       return_tensors="pt")
                mask = batch["attention_mask"].to(self.device)
                hidden = self.model(input_ids=batch["input_ids"].to(self.device),
                                    attention_mask=mask).last_hidden_state
                weights = mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)
                chunks.append(pooled.float().cpu().numpy())
        if not chunks:
            return np.zeros((0, self.dim), dtype=np.float32)
        return _normalise(np.concatenate(chunks))


def make_encoder(encoder: str | Path | Encoder) -> Encoder:
    """``"hashing"`` (the offline default), a local HF model directory, or an :class:`Encoder`."""
    if isinstance(encoder, Encoder):
        return encoder
    if str(encoder) == "hashing":
        return HashingEncoder()
    if Path(encoder).is_dir():
        return HFEncoder(encoder)
    raise RetrievalError(f"encoder {str(encoder)!r} is neither 'hashing' nor a local Hugging Face "
                         "model directory")


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
    skipped); every problem is reported as ``file:line``."""
    docs: list[Document] = []
    first_seen: dict[str, str] = {}
    for where, record in read_jsonl(path, "corpus document", RetrievalError):
        if not isinstance(record, dict):
            raise RetrievalError(f"{where}: a document must be a JSON object")
        doc_id, text, title = record.get("id"), record.get("text"), record.get("title")
        if not isinstance(doc_id, str) or not doc_id:
            raise RetrievalError(f"{where}: 'id' must be a non-empty string")
        if not isinstance(text, str):
            raise RetrievalError(f"{where}: 'text' must be a string")
        if title is not None and not isinstance(title, str):
            raise RetrievalError(f"{where}: 'title' must be a string")
        if doc_id in first_seen:
            raise RetrievalError(f"{where}: duplicate id {doc_id!r} (first at "
                                 f"{first_seen[doc_id]})")
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


class RetrievalIndex:
    """Documents with their FAISS and BM25 indexes; thread-safe for concurrent searches.

    ``rrf_k`` is RRF's rank offset (60 as in Cormack et al.); ``candidates`` is how deep each
    component's list goes before fusion.
    """

    def __init__(self, docs: list[Document], dense: faiss.Index, sparse: bm25s.BM25,
                 encoder: Encoder, manifest: dict[str, Any], rrf_k: float = 60.0,
                 candidates: int = 100) -> None:
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

    @classmethod
    def build(cls, docs: list[Document], encoder: Encoder, corpus_sha256: str = "",
              **options: Any) -> "RetrievalIndex":
        """Embed and index ``docs`` in memory."""
        texts = [doc.indexed_text for doc in docs]
        dense = faiss.IndexFlatIP(encoder.dim)
        for start in range(0, len(texts), _ENCODE_BATCH):
            vectors = np.ascontiguousarray(encoder.encode(texts[start:start + _ENCODE_BATCH]),
                                           dtype=np.float32)
            if vectors.shape != (min(_ENCODE_BATCH, len(texts) - start), encoder.dim):
                raise RetrievalError(f"encoder {encoder.name} returned shape {vectors.shape}, "
                                     f"expected (batch, {encoder.dim})")
            dense.add(vectors)
        sparse = bm25s.BM25(**_BM25_PARAMS)
        sparse.index([tokenize(text) for text in texts], show_progress=False)
        manifest = {"format_version": FORMAT_VERSION, "encoder": encoder.describe(),
                    "dim": encoder.dim, "num_docs": len(docs), "corpus_sha256": corpus_sha256,
                    "bm25": dict(_BM25_PARAMS)}
        return cls(docs, dense, sparse, encoder, manifest, **options)

    def save(self, out_dir: str | Path) -> Path:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        # The manifest goes last: until it is rewritten, a half-overwritten index won't load.
        (out_dir / MANIFEST).unlink(missing_ok=True)
        faiss.write_index(self.dense, str(out_dir / DENSE_FILE))
        self.sparse.save(str(out_dir / SPARSE_DIR), show_progress=False)
        with (out_dir / DOCS_FILE).open("w", encoding="utf-8") as handle:
            for doc in self.docs:
                record = {"id": doc.id, "text": doc.text}
                if doc.title:
                    record["title"] = doc.title
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        (out_dir / MANIFEST).write_text(json.dumps(self.manifest, indent=2, sort_keys=True) + "\n")
        return out_dir

    @classmethod
    def load(cls, directory: str | Path, encoder: str | Path | Encoder = "hashing",
             **options: Any) -> "RetrievalIndex":
        directory = Path(directory)
        try:
            manifest = json.loads((directory / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise RetrievalError(f"{directory}: not a retrieval index (cannot read {MANIFEST}: "
                                 f"{error})") from None
        if manifest.get("format_version") != FORMAT_VERSION:
            raise RetrievalError(f"{directory}: index format {manifest.get('format_version')!r}, "
                                 f"this version reads {FORMAT_VERSION}; rebuild the index")
        encoder = make_encoder(encoder)
        if manifest.get("encoder") != encoder.describe():
            raise RetrievalError(
                f"{directory}: the index was built with encoder {manifest.get('encoder')}, but "
                f"the configured encoder is {encoder.describe()}; use that encoder or rebuild "
                "the index")
        try:
            dense = faiss.read_index(str(directory / DENSE_FILE))
            sparse = bm25s.BM25.load(str(directory / SPARSE_DIR), show_progress=False)
            with (directory / DOCS_FILE).open(encoding="utf-8") as handle:
                docs = [Document(r["id"], r["text"], r.get("title"))
                        for r in map(json.loads, handle)]
        except (OSError, RuntimeError, ValueError, KeyError) as error:
            raise RetrievalError(f"{directory}: damaged index: {error}") from None
        if not len(docs) == dense.ntotal == manifest.get("num_docs"):
            raise RetrievalError(f"{directory}: damaged index: {len(docs)} docs, {dense.ntotal} "
                                 f"vectors, manifest says {manifest.get('num_docs')}")
        return cls(docs, dense, sparse, encoder, manifest, **options)

    # -- search

    def _rows(self, allowed_ids: Iterable[str] | None) -> np.ndarray | None:
        if allowed_ids is None:
            return None
        return np.array(sorted({self._row[i] for i in allowed_ids if i in self._row}),
                        dtype=np.int64)

    def _gpu(self) -> faiss.Index | None:
        """A GPU copy of the dense index, made on first use when faiss-gpu sees a GPU."""
        with self._gpu_lock:
            if not self._gpu_checked:
                self._gpu_checked = True
                if faiss.get_num_gpus() > 0:
                    self._gpu_index = faiss.index_cpu_to_all_gpus(self.dense)
            return self._gpu_index

    def _dense_search(self, query: str, depth: int,
                      rows: np.ndarray | None) -> list[tuple[int, float]]:
        vector = np.ascontiguousarray(self.encoder.encode([query]), dtype=np.float32)
        if rows is None:
            gpu = self._gpu() if depth <= 2048 else None  # the GPU flat index's k limit
            if gpu is not None:
                with self._gpu_lock:
                    scores, labels = gpu.search(vector, depth)
            else:
                scores, labels = self.dense.search(vector, depth)
        else:
            # Exact restriction on the CPU index: only whitelisted rows are scored, so k allowed
            # hits come back whenever k allowed docs exist.
            params = faiss.SearchParameters(sel=faiss.IDSelectorBatch(rows))
            scores, labels = self.dense.search(vector, depth, params=params)
        return [(int(label), float(score)) for label, score in zip(labels[0], scores[0])
                if label >= 0]

    def _sparse_search(self, query: str, depth: int,
                       rows: np.ndarray | None) -> list[tuple[int, float]]:
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

    def search(self, query: str, k: int = 5, allowed_ids: Iterable[str] | None = None,
               mode: Mode = "hybrid") -> list[Hit]:
        """The ``k`` best documents for ``query``, restricted to ``allowed_ids`` when given
        (unknown ids are ignored). ``mode`` picks one component alone (for evaluation)."""
        if mode not in MODES:
            raise ValueError(f"unknown search mode {mode!r}")
        rows = self._rows(allowed_ids)
        pool = len(self.docs) if rows is None else len(rows)
        if k < 1 or pool == 0:
            return []
        depth = min(pool, max(k, self.candidates) if mode == "hybrid" else k)
        dense = self._dense_search(query, depth, rows) if mode != "sparse" else []
        sparse = self._sparse_search(query, depth, rows) if mode != "dense" else []
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


def build_index(corpus_path: str | Path, out_dir: str | Path,
                encoder: str | Path | Encoder = "hashing") -> Path:
    """Build a retrieval index from a JSONL corpus and write it to ``out_dir`` (returned)."""
    corpus_path = Path(corpus_path)
    docs = read_corpus(corpus_path)
    index = RetrievalIndex.build(docs, make_encoder(encoder), corpus_sha256=_sha256(corpus_path))
    return index.save(out_dir)


def load_index(directory: str | Path, encoder: str | Path | Encoder = "hashing",
               rrf_k: float = 60.0, candidates: int = 100) -> RetrievalIndex:
    """Load an index written by :func:`build_index`; ``encoder`` must be the one it was built
    with (compared by ``describe()``)."""
    return RetrievalIndex.load(directory, encoder, rrf_k=rrf_k, candidates=candidates)


# ------------------------------------------------------------------------------------------- tool


def default_spec() -> ToolSpec:
    """The retriever as the policy sees it; deterministic, so the toolbox may cache results."""
    return ToolSpec(
        name="retriever",
        description=("Search the local document collection. Returns the most relevant passages, "
                     "each as '[doc-id] text'."),
        parameters={
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to search for."},
                "top_k": {"type": "integer", "minimum": 1, "maximum": 20,
                          "description": "How many passages to return (default 5)."},
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
    an expert is."""

    def __init__(self, spec: ToolSpec | None = None, *, index_dir: str | Path | None = None,
                 corpus: str | Path | None = None, encoder: str | Path | Encoder = "hashing",
                 top_k: int = 5, max_top_k: int = 20, max_chars_per_doc: int = 400,
                 rrf_k: float = 60.0, candidates: int = 100, mode: Mode = "hybrid",
                 question_as_query: bool = False) -> None:
        super().__init__(spec or default_spec())
        if (index_dir is None) == (corpus is None):
            raise RetrievalError("retriever: give exactly one of index_dir or corpus")
        if mode not in MODES:
            raise RetrievalError(f"retriever: unknown mode {mode!r} ({', '.join(MODES)})")
        self.mode, self.question_as_query = mode, question_as_query
        if not 1 <= top_k <= max_top_k or max_chars_per_doc < 1:
            raise RetrievalError("retriever: need 1 <= top_k <= max_top_k and "
                                 "max_chars_per_doc >= 1")
        self.top_k, self.max_top_k, self.max_chars_per_doc = top_k, max_top_k, max_chars_per_doc
        if index_dir is not None:
            self.index = load_index(index_dir, encoder, rrf_k=rrf_k, candidates=candidates)
        else:
            corpus = Path(corpus)
            self.index = RetrievalIndex.build(read_corpus(corpus), make_encoder(encoder),
                                              corpus_sha256=_sha256(corpus), rrf_k=rrf_k,
                                              candidates=candidates)

    def _format(self, hit: Hit) -> str:
        text = " ".join(hit.text.split())
        if hit.title:
            text = f"{hit.title}: {text}"
        if len(text) > self.max_chars_per_doc:
            text = text[:self.max_chars_per_doc].rstrip() + "..."
        return f"[{hit.id}] {text}"

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        start = time.perf_counter()
        errors = argument_errors(self.spec.parameters, arguments)
        query = arguments.get("query")
        if query is None and self.question_as_query and context.task is not None:
            query = context.task.question
        top_k = arguments.get("top_k", self.top_k)
        if not errors and (not isinstance(query, str) or not query.strip()):
            errors.append("argument 'query' must be a non-empty string")
        if not errors and (isinstance(top_k, bool) or not isinstance(top_k, int)
                           or not 1 <= top_k <= self.max_top_k):
            errors.append(f"argument 'top_k' must be an integer in [1, {self.max_top_k}]")
        if errors:
            return ToolResult(error="; ".join(errors), latency_s=time.perf_counter() - start)
        hits = await asyncio.to_thread(self.index.search, query, top_k,
                                       context.allowed_documents, self.mode)
        output = "\n".join(map(self._format, hits)) if hits else "No documents found."
        latency = time.perf_counter() - start
        return ToolResult(output=output, latency_s=latency,
                          cost_usd=self.spec.pricing.cost(Usage(), latency))
