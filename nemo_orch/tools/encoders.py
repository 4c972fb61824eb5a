"""Text encoders of the retriever: texts to L2-normalised float32 vectors.

* :class:`HashingEncoder` needs no model, so an index can be built anywhere offline (the default);
* :class:`HFEncoder` runs a local Hugging Face encoder with a pooling choice (``mean``,
  ``last_token``, ``cls``) and prefixes for queries and documents. Retrieval encoders are trained
  with them, and an index only answers queries encoded as its documents were meant to be:
  Qwen3-Embedding (the reference's encoder) pools the last token and puts an instruction before
  queries only; E5 prefixes both sides; BGE prefixes queries and pools the first token. Those
  settings are named presets (:data:`ENCODER_PRESETS`).

An encoder's ``describe()`` goes into an index's manifest; loading the index with an encoder
that describes itself otherwise is an error (see :mod:`nemo_orch.tools.retrieval_index`).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
from bm25s.stopwords import STOPWORDS_EN

from nemo_orch.tools.base import ToolError


class RetrievalError(ToolError):
    """A corpus, index or encoder that cannot be used (raised at build/load time)."""


_WORD_RE = re.compile(r"\w+")
_STOPWORDS = frozenset(STOPWORDS_EN)


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens without English stopwords: BM25's terms and the hashing
    encoder's words, so both sides of an index agree on what a term is."""
    return [word for word in _WORD_RE.findall(text.lower()) if word not in _STOPWORDS]


@runtime_checkable
class Encoder(Protocol):
    """Texts to L2-normalised float32 vectors of size ``dim``; ``query=True`` encodes search
    queries (which some encoders prefix), else documents. ``describe()`` identifies the encoder
    in an index's manifest: two encoders with equal descriptions embed alike."""

    name: str
    dim: int

    def encode(self, texts: Sequence[str], query: bool = False) -> np.ndarray: ...

    def describe(self) -> dict[str, Any]: ...


def normalise(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)


class HashingEncoder:
    """Signed feature hashing of words and their character n-grams (fastText-style subwords).

    Needs no model, so an index can be built anywhere offline; n-grams make morphological variants
    ("volcanic" / "volcano") land near each other, which BM25 without a stemmer misses. Buckets
    come from BLAKE2b, not Python's per-process salted ``hash()``, so vectors are identical across
    processes and machines. Queries and documents are encoded alike.
    """

    name = "hashing"
    _VERSION = 1

    def __init__(
        self, dim: int = 384, ngram_range: tuple[int, int] = (3, 5), cache_size: int = 1 << 18
    ) -> None:
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
        return {
            "type": self.name,
            "version": self._VERSION,
            "dim": self.dim,
            "ngram_range": list(self.ngram_range),
        }

    def _bucket(self, feature: str) -> tuple[int, float]:
        value = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "little")
        return value % self.dim, 1.0 if value >> 63 else -1.0

    def _features(self, word: str) -> tuple[np.ndarray, np.ndarray]:
        padded = f"<{word}>"
        low, high = self.ngram_range
        grams = [
            padded[i : i + n] for n in range(low, high + 1) for i in range(len(padded) - n + 1)
        ]
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

    def encode(self, texts: Sequence[str], query: bool = False) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return normalise(np.stack([self._encode_one(text) for text in texts]))


POOLINGS = ("mean", "last_token", "cls")


@dataclass(frozen=True)
class EncoderSettings:
    """How an HF encoder turns hidden states into a vector (``pooling``) and what is written
    before each query and each document it encodes."""

    pooling: str = "mean"
    query_prefix: str = ""
    document_prefix: str = ""

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise RetrievalError(
                f"encoder pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}"
            )


# The settings retrieval encoders were trained with. Qwen3-Embedding's query instruction is the
# one ToolOrchestra's retrieval service writes (its model card's format, "Instruct: ...\nQuery:").
ENCODER_PRESETS: dict[str, EncoderSettings] = {
    "qwen3-embedding": EncoderSettings(
        "last_token", "Instruct: Given a search query, retrieve relevant passages\nQuery:"
    ),
    "e5": EncoderSettings("mean", "query: ", "passage: "),
    "bge": EncoderSettings("cls", "Represent this sentence for searching relevant passages: "),
}


def encoder_settings(preset: str | None = None, **overrides: Any) -> EncoderSettings:
    """A preset's settings (None: mean pooling, no prefixes) with ``overrides`` (None values
    are not overrides)."""
    if preset is not None and preset not in ENCODER_PRESETS:
        raise RetrievalError(
            f"unknown encoder preset {preset!r}; presets: {', '.join(ENCODER_PRESETS)}"
        )
    base = asdict(ENCODER_PRESETS[preset]) if preset else {}
    return EncoderSettings(**{**base, **{k: v for k, v in overrides.items() if v is not None}})


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
    """A local Hugging Face encoder (BERT, E5, BGE, Qwen3-Embedding ...) pooled as ``settings``
    say, its queries and documents prefixed as they say.

    Loaded with ``local_files_only=True``: nothing is downloaded at run time. Runs on CUDA when
    available. Last-token pooling reads each row's last real token, wherever the tokenizer pads.
    """

    name = "hf"

    def __init__(
        self,
        model_dir: str | Path,
        settings: EncoderSettings = EncoderSettings(),
        max_length: int = 512,
        batch_size: int = 32,
    ) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise RetrievalError(
                f"{self.model_dir}: not a Hugging Face model directory (no config.json)"
            )
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
            self.model = AutoModel.from_pretrained(self.model_dir, local_files_only=True)
        except (OSError, ValueError) as error:
            raise RetrievalError(f"{self.model_dir}: cannot load the encoder: {error}") from None
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self._torch = torch
        self.settings = settings
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model.to(self.device).eval()
        config = self.model.config
        self.dim = int(config.hidden_size)
        self.max_length = min(max_length, getattr(config, "max_position_embeddings", max_length))
        self.batch_size = batch_size
        self._fingerprint = _fingerprint(self.model_dir)

    def describe(self) -> dict[str, Any]:
        # Empty prefixes are left out, so a mean-pooled index built before prefixes existed
        # still loads.
        settings = {key: value for key, value in asdict(self.settings).items() if value != ""}
        return {
            "type": self.name,
            "model_type": self.model.config.model_type,
            "dim": self.dim,
            **settings,
            "max_length": self.max_length,
            "fingerprint": self._fingerprint,
        }

    def _pool(self, hidden: Any, mask: Any) -> Any:
        torch = self._torch
        if self.settings.pooling == "cls":
            return hidden[:, 0]
        if self.settings.pooling == "last_token":
            # The last position whose mask is 1: right padding puts it before the pads, left
            # padding at the end.
            positions = torch.arange(mask.shape[1], device=mask.device)
            last = (mask * positions).argmax(dim=1)
            return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)

    def encode(self, texts: Sequence[str], query: bool = False) -> np.ndarray:
        torch = self._torch
        prefix = self.settings.query_prefix if query else self.settings.document_prefix
        chunks = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    [prefix + text for text in texts[start : start + self.batch_size]],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                )
                mask = batch["attention_mask"].to(self.device)
                hidden = self.model(
                    input_ids=batch["input_ids"].to(self.device), attention_mask=mask
                ).last_hidden_state
                chunks.append(self._pool(hidden, mask).float().cpu().numpy())
        if not chunks:
            return np.zeros((0, self.dim), dtype=np.float32)
        return normalise(np.concatenate(chunks))


def make_encoder(encoder: str | Path | Mapping[str, Any] | Encoder) -> Encoder:
    """``"hashing"`` (the offline default), a local HF model directory (mean pooling, no
    prefixes), a mapping ``{model_dir, preset?, pooling?, query_prefix?, document_prefix?,
    max_length?, batch_size?}``, or an :class:`Encoder`."""
    if isinstance(encoder, Encoder):
        return encoder
    if isinstance(encoder, Mapping):
        options = dict(encoder)
        unknown = options.keys() - {
            "model_dir",
            "preset",
            "pooling",
            "query_prefix",
            "document_prefix",
            "max_length",
            "batch_size",
        }
        if unknown or "model_dir" not in options:
            raise RetrievalError(
                f"encoder options need model_dir and take preset, pooling, "
                f"query_prefix, document_prefix, max_length, batch_size; got "
                f"{sorted(options)}"
            )
        settings = encoder_settings(
            options.pop("preset", None),
            **{
                key: options.pop(key, None)
                for key in ("pooling", "query_prefix", "document_prefix")
            },
        )
        return HFEncoder(options.pop("model_dir"), settings, **options)
    if str(encoder) == "hashing":
        return HashingEncoder()
    if Path(encoder).is_dir():
        return HFEncoder(encoder)
    raise RetrievalError(
        f"encoder {str(encoder)!r} is neither 'hashing' nor a local Hugging Face model directory"
    )
