"""Load on the PyTriton servers: ``--requests`` KServe v2 requests at ``--concurrency`` in flight.

What it measures: for each target, a real ``nemo-orch serve`` process on 127.0.0.1 (started here,
stopped with SIGTERM afterwards) answering single-item requests from ``--concurrency`` client
threads over HTTP keep-alive connections:

* **reward**: ``nemo-orch serve reward``, outcome scoring of varied answers (exact, numeric and
  wrong ones; no judge, so this is the server's own overhead plus the matching rules);
* **retriever**: ``nemo-orch serve tool search``, the offline retriever (BM25 over the demo
  corpus, the task's question as the query);
* **reward, GRPO client**: the same server, scored the way GRPO scores (``score_groups`` over
  :class:`~nemo_orch.reward.remote.RemoteOutcomeScorer`, ``reward.endpoint_batch_size`` 64):
  ``--concurrency`` callers each scoring one group of 8 answers at a time, ``--requests``
  answers in all; ``requests`` then counts the HTTP requests the client sent, and
  ``items/request`` their mean size;
* **dense retriever**: ``nemo-orch serve tool retriever`` over a dense (hashing encoder) index of
  ``--passages`` synthetic passages (built first, not timed), a distinct 8-word query per item,
  top 10: ``one at a time`` (``max_batch: 1``, each item of a Triton batch searched alone, as
  before batching) and ``batched`` (the items of a Triton batch, and of the batches in flight,
  searched with one encoder call and one FAISS search).

How to read the table: ``errors`` counts non-200 answers, transport failures and rows whose
``error`` output is set (must be 0). p50/p99 are client-side latencies of the answered requests;
``req/s`` and ``items/s`` are over the wall time of the whole run. ``requests/batch`` is the mean
number of requests Triton merged into one batch (from the server's Prometheus metrics): dynamic
batching at work. PyTriton's Python proxy costs milliseconds per *request* (Triton's own metrics
put the compute of a merged batch far above the model's time), so items per request
(``--items``) raise items/s much more than concurrency does. Client and server share the
machine's cores, so on a 2-core machine the client's own cost is part of what is measured.

Run: ``python benchmarks/serve_load.py [--requests 10000 --concurrency 64 --items 1
--target reward --passages 100000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from retrieval import corpus  # benchmarks/retrieval.py: the synthetic passages

from nemo_orch import config as config_lib
from nemo_orch.envs.offline.world import BASIC, held_out_tasks
from nemo_orch.reward.builders import build_scorer
from nemo_orch.reward.remote import reward_item
from nemo_orch.reward.scoring import by_answer, score_groups
from nemo_orch.rollout.trajectory import Trajectory, TurnRecord
from nemo_orch.tools.base import ToolContext
from nemo_orch.tools.remote import context_to_json
from nemo_orch.tools.retrieval_index import build_index

# target -> (serve command, Triton model, max_batch of the dense retriever or None)
TARGETS = {
    "reward": ("reward", "reward", None),
    "reward, GRPO client": ("reward", "reward", None),
    "retriever": ("tool search", "search", None),
    "dense retriever, one at a time": ("tool retriever", "retriever", 1),
    "dense retriever, batched": ("tool retriever", "retriever", 256),
}


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def _dense_index(directory: Path, passages: int) -> tuple[Path, list[str]]:
    """An index of synthetic passages (:mod:`retrieval`'s, searched dense here) and their
    words, built once per run in ``directory``."""
    docs, words = corpus(passages, random.Random(0))
    if not (directory / "idx").exists():
        (directory / "docs.jsonl").write_text(
            "".join(json.dumps({"id": doc.id, "text": doc.text}) + "\n" for doc in docs)
        )
        build_index(directory / "docs.jsonl", directory / "idx")
    return directory / "idx", words


def _dense_declaration(directory: Path, index: Path, max_batch: int) -> Path:
    """The served retriever: dense, top 10, 64 calls at once, not cached (every query is new
    anyway; the cache must not stand in for the search)."""
    path = directory / f"retriever_{max_batch}.yaml"
    path.write_text(
        json.dumps(
            {
                "name": "retriever",
                "description": "Searches the passages.",
                "parameters": {
                    "type": "object",
                    "required": ["query"],
                    "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}},
                },
                "deterministic": False,
                "max_concurrency": 64,
                "class": "nemo_orch.tools.retriever.Retriever",
                "options": {
                    "index_dir": str(index),
                    "mode": "dense",
                    "max_batch": max_batch,
                    "top_k": 10,
                },
            }
        )
    )
    return path


def _answers(task, index: int) -> list[str]:
    """Varied answers to ``task``: right, right with a prefix, and two wrong ones."""
    return [task.answer, f"Answer: {task.answer}", "not it", str(index)]


def _rows(target: str, count: int, words: list[str]) -> list[dict[str, str]]:
    """The items to send: a new query each for the dense retriever (``count`` of them), else
    varied answers or tasks of the offline world, cycled over."""
    if TARGETS[target][2] is not None:
        rng = random.Random(1)
        context = json.dumps(context_to_json(ToolContext()))
        return [
            {
                "arguments": json.dumps({"query": " ".join(rng.choices(words, k=8))}),
                "context": context,
            }
            for _ in range(count)
        ]
    rows = []
    for i, task in enumerate(held_out_tasks(50, BASIC)):
        if target == "reward":
            rows += [reward_item(task, answer) for answer in _answers(task, i)]
        else:
            context = ToolContext(task_id=task.id, task=task, seed=i)
            rows.append({"arguments": "{}", "context": json.dumps(context_to_json(context))})
    return rows


def _bodies(target: str, count: int, items: int, words: list[str]) -> list[dict]:
    """``count`` request bodies of ``items`` items each, cycling over varied inputs."""
    rows = _rows(target, count * items, words)
    bodies = []
    for i in range(count):
        chosen = [rows[(i * items + j) % len(rows)] for j in range(items)]
        bodies.append(
            {
                "inputs": [
                    {
                        "name": name,
                        "datatype": "BYTES",
                        "shape": [items, 1],
                        "data": [row[name] for row in chosen],
                    }
                    for name in chosen[0]
                ]
            }
        )
    return bodies


def _load(
    port: int, path: str, bodies: list[dict], concurrency: int
) -> tuple[list[float], int, float]:
    """Send ``bodies`` from ``concurrency`` threads, each over its own keep-alive connection
    (the standard library's client: an asyncio client costs more CPU per request than the
    server on a 2-core machine)."""
    encoded = iter([json.dumps(body).encode() for body in bodies])
    lock = threading.Lock()
    latencies: list[float] = []
    errors = 0

    def worker() -> None:
        nonlocal errors
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while True:
            with lock:
                body = next(encoded, None)
            if body is None:
                break
            started = time.perf_counter()
            try:
                connection.request("POST", path, body, {"Content-Type": "application/json"})
                answer = connection.getresponse()
                outputs = {o["name"]: o["data"] for o in json.loads(answer.read())["outputs"]}
                failed = answer.status != 200 or any(outputs["error"])
            except (OSError, http.client.HTTPException, KeyError, ValueError):
                failed = True
                connection.close()  # reconnects at the next request
            with lock:
                if failed:
                    errors += 1
                else:
                    latencies.append(time.perf_counter() - started)
        connection.close()

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, errors, time.perf_counter() - started


GROUP = 8  # answers per group, a GRPO step's samples of one prompt


def _group(task, index: int) -> list[Trajectory]:
    """Eight episodes of ``task``: right, right with a prefix, and wrong answers."""
    answers = _answers(task, index)
    answers *= GROUP // len(answers)
    turn = TurnRecord(
        turn=0,
        input_tokens=10,
        output_tokens=5,
        generation_seconds=0.1,
        orchestrator_cost_usd=1e-5,
        finish_reason="stop",
        calls=[],
    )
    return [
        Trajectory(
            task_id=task.id,
            sample=sample,
            messages=[],
            tools=[],
            token_ids=[1],
            loss_mask=[1],
            decision_mask=[1],
            logprobs=[0.0],
            prompt_length=0,
            turns=[turn],
            termination="answer",
            answer=answer,
            wall_seconds=0.1,
        )
        for sample, answer in enumerate(answers)
    ]


def _grpo_client_load(
    port: int, answers: int, concurrency: int
) -> tuple[list[float], int, float, list[int]]:
    """``concurrency`` callers scoring one group each through ``score_groups`` until
    ``answers`` are scored; the latency of each call, errors, seconds and the size of every
    HTTP request the client sent."""
    config = config_lib.load(
        [f"reward.endpoint=http://127.0.0.1:{port}", "reward.endpoint_batch_size=64"]
    )
    scorer = build_scorer(config, judge_in_flight=concurrency)
    sizes: list[int] = []
    infer = scorer.client.infer

    async def counted(rows):
        sizes.append(len(rows))
        return await infer(rows)

    scorer.client.infer = counted
    tasks = held_out_tasks(50, BASIC)
    groups = [
        (tasks[i % len(tasks)], _group(tasks[i % len(tasks)], i)) for i in range(answers // GROUP)
    ]
    latencies: list[float] = []
    errors = 0

    async def caller(queue: list) -> None:
        nonlocal errors
        while queue:
            task, group = queue.pop()
            started = time.perf_counter()
            try:
                await score_groups([task], [group], config.reward, by_answer(scorer))
                latencies.append(time.perf_counter() - started)
            except Exception:
                errors += 1

    async def run() -> float:
        started = time.perf_counter()
        queue = list(groups)
        await asyncio.gather(*(caller(queue) for _ in range(concurrency)))
        return time.perf_counter() - started

    seconds = asyncio.run(run())
    return latencies, errors, seconds, sizes


def _mean_batch(metrics: str, model: str) -> float:
    """Requests per batch of ``model``, from the server's batch-size histogram."""
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.labels.get("model") == model
    }
    return (
        values["nemo_orch_serve_batch_requests_sum"]
        / values["nemo_orch_serve_batch_requests_count"]
    )


def _run_target(
    name: str, requests: int, concurrency: int, items: int, scratch: Path, passages: int
) -> dict:
    command, model, max_batch = TARGETS[name]
    tools, words = ["tools=offline_basic"], []
    if max_batch is not None:
        index, words = _dense_index(scratch, passages)
        tools = [f"tools.declarations=[{_dense_declaration(scratch, index, max_batch)}]"]
    http_port, grpc_port, metrics_port = _free_ports(3)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nemo_orch.cli",
            "serve",
            *command.split(),
            f"serve.http_port={http_port}",
            f"serve.grpc_port={grpc_port}",
            f"serve.metrics_port={metrics_port}",
            *tools,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        banner = server.stdout.readline()
        if "serving" not in banner:
            raise RuntimeError(f"nemo-orch serve {command} did not start: {banner!r}")
        if name == "reward, GRPO client":
            latencies, errors, seconds, sizes = _grpo_client_load(http_port, requests, concurrency)
            requests, items = len(sizes), sum(sizes) / len(sizes)
        else:
            latencies, errors, seconds = _load(
                http_port,
                f"/v2/models/{model}/infer",
                _bodies(name, requests, items, words),
                concurrency,
            )
        batch = _mean_batch(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text, model)
        stopping = time.perf_counter()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        stop_s = time.perf_counter() - stopping
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    quantiles = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "target": name,
        "requests": requests,
        "items": items,
        "concurrency": concurrency,
        "errors": errors,
        "items_per_s": requests * items / seconds,
        "p50_ms": 1000 * quantiles[49],
        "p99_ms": 1000 * quantiles[98],
        "req_per_s": requests / seconds,
        "batch": batch,
        "stop_s": stop_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--items", type=int, default=1, help="items per request")
    parser.add_argument(
        "--target", choices=list(TARGETS), action="append", help="repeat for several (default: all)"
    )
    parser.add_argument(
        "--passages", type=int, default=100_000, help="the dense retriever's index size"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        rows = [
            _run_target(
                name, args.requests, args.concurrency, args.items, Path(scratch), args.passages
            )
            for name in args.target or list(TARGETS)
        ]
    print(
        f"serve load: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"PyTriton on 127.0.0.1"
    )
    print(
        "| target | requests | items/request | concurrency | errors | p50 ms | p99 ms | "
        "req/s | items/s | requests/batch | SIGTERM->exit s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['target']} | {row['requests']} | {row['items']:.3g} | {row['concurrency']} | "
            f"{row['errors']} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | "
            f"{row['req_per_s']:.0f} | {row['items_per_s']:.0f} | {row['batch']:.1f} | "
            f"{row['stop_s']:.1f} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
