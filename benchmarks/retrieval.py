"""Batched retrieval: queries/s of ``RetrievalIndex.search_many`` against one ``search`` per query.

What it measures, in one process on this machine: a synthetic corpus of ``--passages`` passages
(30 words each from a made-up vocabulary of 20,000 words, so neither encoder knows any of them)
indexed twice, with the hashing encoder (the offline default) and with a tiny Hugging Face
encoder built here (a random 2-layer BERT, hidden size 64, and a BPE tokenizer trained on the
corpus; nothing downloaded). ``--queries`` distinct queries (8 words each) are then searched one
by one and in batches of ``--batch``, dense (the reference's retrieval) and hybrid, top 10.
Build time is reported apart, not counted.

How to read the table: ``q/s`` is queries per second of wall time, ``speed-up`` the batched
rate over the one-by-one rate of the same encoder and mode; ``same top 10``: the share of
queries whose ten hits come back identical both ways (an HF encoder pads a batch, so its vectors
differ from a lone query's in the last float bits, which can swap near-ties). Batching saves the per-call
overhead of the encoder (one forward pass for the batch) and of FAISS (one search: a matrix
product instead of a vector product per query); BM25 is scored per query either way.

Run: ``python benchmarks/retrieval.py [--passages 100000 --queries 1000 --batch 64]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

from nemo_orch.tools.encoders import HashingEncoder, HFEncoder
from nemo_orch.tools.retrieval_index import Document, RetrievalIndex

SYLLABLES = (
    "ka ri to ne mu sa lo vi pe du gra sel tor mi an el os ur bes dan fi ko lu ta ven ro"
).split()


def vocabulary(size: int, rng: random.Random) -> list[str]:
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))))
    return sorted(words)


def corpus(passages: int, rng: random.Random) -> tuple[list[Document], list[str]]:
    words = vocabulary(20_000, rng)
    docs = [Document(f"p{i}", " ".join(rng.choices(words, k=30))) for i in range(passages)]
    return docs, words


def tiny_hf_encoder(docs: list[Document], directory: Path) -> HFEncoder:
    import torch
    from transformers import BertConfig, BertModel

    from nemo_orch.models.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(
        (doc.text for doc in docs[:20_000]), vocab_size=4000, min_frequency=2, out_dir=directory
    )
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    BertModel(config).save_pretrained(directory)
    return HFEncoder(directory, max_length=128, batch_size=256)


def rate(function, count: int) -> tuple[float, object]:
    started = time.perf_counter()
    result = function()
    return count / (time.perf_counter() - started), result


def measure(
    name: str, index: RetrievalIndex, queries: list[str], batch: int, build_s: float
) -> list[dict]:
    rows = []
    for mode in ("dense", "hybrid"):
        single, one_by_one = rate(
            lambda mode=mode: [index.search(q, 10, mode=mode) for q in queries], len(queries)
        )
        batched, together = rate(
            lambda mode=mode: [
                hits
                for start in range(0, len(queries), batch)
                for hits in index.search_many(queries[start : start + batch], 10, mode=mode)
            ],
            len(queries),
        )
        same = sum(
            [hit.id for hit in alone] == [hit.id for hit in batch_hits]
            for alone, batch_hits in zip(one_by_one, together)
        ) / len(queries)
        rows.append(
            {
                "encoder": name,
                "mode": mode,
                "build_s": build_s,
                "one_by_one_qps": single,
                "batched_qps": batched,
                "speedup": batched / single,
                "same_top10": same,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    rng = random.Random(0)
    docs, words = corpus(args.passages, rng)
    queries = [" ".join(rng.choices(words, k=8)) for _ in range(args.queries)]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, make in (
            ("hashing", HashingEncoder),
            ("tiny HF (BERT 2x64)", lambda: tiny_hf_encoder(docs, Path(scratch))),
        ):
            started = time.perf_counter()
            index = RetrievalIndex.build(docs, make())
            rows += measure(name, index, queries, args.batch, time.perf_counter() - started)
    print(
        f"retrieval: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{args.passages} passages, {args.queries} queries, top 10, batches of {args.batch}"
    )
    print(
        "| encoder | mode | index build s | one by one q/s | search_many q/s | speed-up | "
        "same top 10 |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['encoder']} | {row['mode']} | {row['build_s']:.0f} | "
            f"{row['one_by_one_qps']:.0f} | {row['batched_qps']:.0f} | "
            f"{row['speedup']:.2f}x | {row['same_top10']:.3f} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
