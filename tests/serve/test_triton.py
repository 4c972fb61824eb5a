"""Real PyTriton servers on 127.0.0.1: the reward and tool models over KServe v2 HTTP and through
the client library (gRPC), bad requests, dynamic batching and metrics; served results equal
in-process ones, down to a whole evaluation."""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from nemo_orch import config as config_lib
from nemo_orch.clients.kserve import KServeClient, KServeError
from nemo_orch.data.tasks import Task
from nemo_orch.envs.offline.world import BASIC, held_out_tasks
from nemo_orch.eval import harness
from nemo_orch.reward.builders import build_scorer
from nemo_orch.reward.remote import reward_item
from nemo_orch.rollout.builders import build_toolbox
from nemo_orch.serve.http_server import RequestError, serve_json
from nemo_orch.serve.triton import serve_models
from nemo_orch.serve.triton_models import reward_model, tool_models
from nemo_orch.tools.base import ToolContext
from nemo_orch.tools.registry import Toolbox, build_tools, load_declarations

TOOLS = ["search", "python_sandbox", "call_expert"]
MAX_BATCH = 8
MAX_ITEM_BYTES = 8192
QA = Task("qa", "What is 6 x 7?", answer="42")
CASES = [
    (QA, "42"),
    (QA, "Answer: 42.0"),
    (QA, "forty-two"),
    (QA, ""),
    (QA, None),
    (QA, "word " * 600),
    (Task("open", "Name a colour."), "red"),
]


@pytest.fixture(scope="module")
def served(make_serve_config):
    """The server and the toolbox behind its tool models."""
    config = config_lib.load(["tools=offline_basic"])
    models, toolboxes = tool_models(config, TOOLS)
    settings = make_serve_config(
        max_batch_size=MAX_BATCH, max_queue_delay_us=20_000, max_item_bytes=MAX_ITEM_BYTES
    )
    with serve_models([reward_model(config), *models], settings, toolboxes) as running:
        yield running, toolboxes[0]


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def _infer(server, model: str, inputs: list[dict], **request) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v2/models/{model}/infer", json={"inputs": inputs, **request}, timeout=30
    )


def _text_inputs(rows: list[dict[str, str]]) -> list[dict]:
    return [
        {
            "name": name,
            "datatype": "BYTES",
            "shape": [len(rows), 1],
            "data": [row[name] for row in rows],
        }
        for name in rows[0]
    ]


def test_reward_model_equals_in_process_scoring(server):
    remote = build_scorer(config_lib.load([f"reward.endpoint={server.url}"]))
    local = build_scorer(config_lib.load())

    async def score(scorer):  # concurrently: Triton merges them into batches
        return await asyncio.gather(*(scorer.score(task, answer) for task, answer in CASES))

    served = asyncio.run(score(remote))
    assert served == asyncio.run(score(local))
    assert [r.method for r in served] == [
        "exact",
        "numeric",
        "no_match",
        "empty",
        "empty",
        "too_long",
        "no_match",
    ]


def test_answers_scored_together_go_in_batched_requests(server):
    """A gather of 20 answers (what score_groups does) in requests of at most
    reward.endpoint_batch_size answers; each answer gets its own result."""
    remote = build_scorer(
        config_lib.load(
            [f"reward.endpoint={server.url}", f"reward.endpoint_batch_size={MAX_BATCH}"]
        )
    )
    local = build_scorer(config_lib.load())
    sizes = []
    infer = remote.client.infer

    async def counted(rows):
        sizes.append(len(rows))
        return await infer(rows)

    remote.client.infer = counted
    cases = [(QA, str(40 + i)) for i in range(20)]

    async def score(scorer):
        return await asyncio.gather(*(scorer.score(task, answer) for task, answer in cases))

    assert asyncio.run(score(remote)) == asyncio.run(score(local))
    assert sizes == [8, 8, 4]
    assert [r.correct for r in asyncio.run(score(remote))] == [i == 2 for i in range(20)]
    # More answers per request than the server takes: every answer of it gets the refusal.
    too_big = build_scorer(
        config_lib.load(
            [
                f"reward.endpoint={server.url}",
                f"reward.endpoint_batch_size={MAX_BATCH + 1}",
                "reward.endpoint_max_retries=0",
            ]
        )
    )

    async def refused():
        return await asyncio.gather(
            *(too_big.score(task, answer) for task, answer in cases[:9]), return_exceptions=True
        )

    failures = asyncio.run(refused())
    assert len(failures) == 9 and all("batch-size must be <= 8" in str(f) for f in failures)


def test_reward_model_over_plain_http_and_the_client_library(server):
    from pytriton.client import ModelClient

    rows = [reward_item(QA, "42"), reward_item(QA, "41")]
    answer = _infer(server, "reward", _text_inputs(rows))
    assert answer.status_code == 200, answer.text
    outputs = {o["name"]: o["data"] for o in answer.json()["outputs"]}
    assert outputs["score"] == [1.0, 0.0] and outputs["correct"] == [True, False]
    assert outputs["method"] == ["exact", "no_match"] and outputs["error"] == ["", ""]

    with ModelClient(server.grpc_url, "reward", init_timeout_s=30) as client:
        result = client.infer_batch(
            **{
                name: np.array([[row[name].encode()] for row in rows], dtype=object)
                for name in rows[0]
            }
        )
    assert result["correct"].reshape(-1).tolist() == [True, False]
    assert result["method"].reshape(-1).tolist() == [b"exact", b"no_match"]


def test_the_repository_index_lists_the_served_models(server):
    """What a client that discovers models reads: tritonclient's repository index, over HTTP
    and gRPC, lists every served model, ready (not PyTriton's workspace)."""
    import tritonclient.grpc as grpc_client
    import tritonclient.http as http_client

    served = {"reward", *TOOLS}
    http_index = http_client.InferenceServerClient(
        server.url.removeprefix("http://")
    ).get_model_repository_index()
    assert {(m["name"], m["state"]) for m in http_index} == {(n, "READY") for n in served}
    grpc_index = grpc_client.InferenceServerClient(
        server.grpc_url.removeprefix("grpc://")
    ).get_model_repository_index(as_json=True)
    assert {m["name"] for m in grpc_index["models"]} == served


def test_the_served_configuration_describes_inputs_and_outputs(server):
    """What a client reads to learn the protocol: each model's configuration (tritonclient,
    HTTP and gRPC) describes the model, every input and output in its parameters."""
    import tritonclient.grpc as grpc_client
    import tritonclient.http as http_client

    http = http_client.InferenceServerClient(server.url.removeprefix("http://"))
    grpc = grpc_client.InferenceServerClient(server.grpc_url.removeprefix("grpc://"))
    for name in ("reward", "search"):
        config = http.get_model_config(name)
        described = {key: value["string_value"] for key, value in config["parameters"].items()}
        tensors = [f"input.{t['name']}" for t in config["input"]] + [
            f"output.{t['name']}" for t in config["output"]
        ]
        assert set(tensors) <= set(described) and all(described[key] for key in tensors)
        assert described["description"]
        grpc_config = grpc.get_model_config(name, as_json=True)["config"]
        assert {
            key: value["string_value"] for key, value in grpc_config["parameters"].items()
        } == described
    reward = http.get_model_config("reward")["parameters"]
    assert "id (string, required)" in reward["input.metadata"]["string_value"]
    assert (
        "search"
        in http.get_model_config("search")["parameters"]["description"]["string_value"].lower()
    )


def test_a_model_must_describe_every_input_and_output():
    from nemo_orch.serve.triton import TextModel

    with pytest.raises(ValueError, match="no description of answer"):
        TextModel("m", ("question",), {"answer": bytes}, dict, None, {"question": "text"})
    with pytest.raises(ValueError, match="unknown tensors typo"):
        TextModel(
            "m",
            ("question",),
            {"answer": bytes},
            dict,
            None,
            {"question": "text", "answer": "text", "typo": "text"},
        )


def _binary_request(value: bytes) -> tuple[bytes, dict[str, str]]:
    """A KServe v2 request whose every input is ``value``, sent with the binary extension."""
    blob = struct.pack("<I", len(value)) + value
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "datatype": "BYTES",
                    "shape": [1, 1],
                    "parameters": {"binary_data_size": len(blob)},
                }
                for name in reward_item(QA, "")
            ]
        }
    ).encode()
    return header + blob * 4, {"Inference-Header-Content-Length": str(len(header))}


GOOD = reward_item(QA, "42")
BAD_REQUESTS = {
    "wrong dtype": (
        [
            {
                "name": n,
                "datatype": "INT64" if n == "problem" else "BYTES",
                "shape": [1, 1],
                "data": [1 if n == "problem" else v],
            }
            for n, v in GOOD.items()
        ],
        "data-type is 'INT64'",
    ),
    "wrong shape": (
        [
            {"name": n, "datatype": "BYTES", "shape": [1, 2], "data": [v, v]}
            for n, v in GOOD.items()
        ],
        "unexpected shape",
    ),
    "missing input": (
        _text_inputs([{k: v for k, v in GOOD.items() if k != "metadata"}]),
        "expected 4 inputs",
    ),
    "unknown input": (
        _text_inputs([{**{k: v for k, v in GOOD.items() if k != "metadata"}, "extra": "x"}]),
        "unexpected inference input 'extra'",
    ),
    "too many items": (_text_inputs([GOOD] * (MAX_BATCH + 1)), f"must be <= {MAX_BATCH}"),
    "oversized item": (
        _text_inputs([{**GOOD, "prediction": "x" * (MAX_ITEM_BYTES + 1)}]),
        "max_item_bytes",
    ),
    "metadata not JSON": (_text_inputs([{**GOOD, "metadata": "{oops"}]), "metadata is not JSON"),
    "metadata without id": (_text_inputs([{**GOOD, "metadata": "{}"}]), "string 'id'"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_malformed_requests_get_a_400_of_one_line_and_the_server_stays_up(server, name):
    inputs, message = BAD_REQUESTS[name]
    answer = _infer(server, "reward", inputs)
    error = answer.json()["error"]
    assert answer.status_code == 400 and message in error, answer.text
    assert "\n" not in error and "Traceback" not in error and ".py" not in error, error
    assert _infer(server, "reward", _text_inputs([GOOD])).status_code == 200


def test_bad_metadata_is_answered_with_its_reason_alone(server):
    answer = _infer(server, "reward", _text_inputs([{**GOOD, "metadata": "{}"}]))
    assert (answer.status_code, answer.json()) == (
        400,
        {"error": "metadata must be a JSON object with a string 'id'"},
    )


def test_refusals_and_failures_are_told_apart_in_one_line(make_serve_config):
    """A request the model refuses and a model that fails: one line each, with the gRPC status
    a client branches on (Triton 2.4x's HTTP server answers every inference error with 400).
    The failure's traceback goes to the server's log, not to the client; the model serves on."""
    import tritonclient.grpc as grpc_client

    from nemo_orch.serve.triton import BadRequest, TextModel

    def parse(row: dict[str, str]) -> str:
        if row["text"] == "bad":
            raise BadRequest("bad text")
        return row["text"]

    async def run(items: list[str]) -> list[dict]:
        if "fail" in items:
            raise RuntimeError("the model broke")
        return [{"upper": item.upper()} for item in items]

    model = TextModel(
        "fragile",
        ("text",),
        {"upper": bytes},
        parse,
        run,
        {"text": "any text", "upper": "the text in capitals"},
    )
    with serve_models([model], make_serve_config()) as running:
        client = grpc_client.InferenceServerClient(running.grpc_url.removeprefix("grpc://"))
        answers = {}
        for text in ("bad", "fail"):
            http = _infer(running, "fragile", _text_inputs([{"text": text}]))
            tensor = grpc_client.InferInput("text", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
            with pytest.raises(grpc_client.InferenceServerException) as grpc:
                client.infer("fragile", [tensor])
            answers[text] = (
                http.status_code,
                http.json()["error"],
                grpc.value.status(),
                grpc.value.message(),
            )
        assert answers == {
            "bad": (400, "bad text", "StatusCode.INVALID_ARGUMENT", "bad text"),
            "fail": (
                400,
                "RuntimeError: the model broke",
                "StatusCode.INTERNAL",
                "RuntimeError: the model broke",
            ),
        }
        served = _infer(running, "fragile", _text_inputs([{"text": "ok"}]))
        assert served.status_code == 200
        assert {o["name"]: o["data"] for o in served.json()["outputs"]}["upper"] == ["OK"]


def test_undecodable_bodies_get_a_400(server):
    url = f"{server.url}/v2/models/reward/infer"
    not_json = httpx.post(url, content=b"{not json", timeout=30)
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]
    body, headers = _binary_request(b"\xff\xfe not utf-8")
    invalid = httpx.post(url, content=body, headers=headers, timeout=30)
    assert invalid.status_code == 400 and "not valid UTF-8" in invalid.json()["error"]
    unknown = _infer(server, "no-such-model", _text_inputs([GOOD]))
    assert unknown.status_code in (400, 404) and "no-such-model" in unknown.json()["error"]


def test_a_model_still_loading_is_retried_and_a_bad_request_is_not():
    # A restarting Triton is up before its models are: it refuses with HTTP 400 (these words)
    # until they are loaded. That refusal is retried; a request the model rejects is not.
    refusals = [
        "Request for unknown model: 'reward' is not found",
        "Request for unknown model: 'reward' has no available versions",
    ]
    calls = []

    def infer(body: dict) -> dict:
        calls.append(body)
        if len(calls) <= len(refusals):
            raise RequestError(refusals[len(calls) - 1], 400)
        if len(calls) == 3:
            return {
                "outputs": [{"name": "score", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]
            }
        raise RequestError("metadata must be a JSON object", 400)

    with serve_json({("POST", "/v2/models/reward/infer"): infer}) as stub:
        client = KServeClient(stub.url, "reward", max_retries=3)
        client.client.backoff_s = 0.01
        assert asyncio.run(client.infer([GOOD])) == [{"score": 1.0}]
        with pytest.raises(KServeError, match="failed with HTTP 400: metadata must be"):
            asyncio.run(client.infer([GOOD]))
    assert len(calls) == 4


def test_a_bad_request_merged_with_good_ones_fails_alone(server):
    client = KServeClient(server.url, "reward", max_retries=0)
    bad = {**GOOD, "metadata": "[1, 2]"}

    async def send():
        return await asyncio.gather(
            *(client.infer([row]) for row in [GOOD] * 6 + [bad]), return_exceptions=True
        )

    results = asyncio.run(send())
    assert all(r[0]["correct"] is True for r in results[:6]), results
    assert isinstance(results[6], KServeError) and "must be a JSON object" in str(results[6])
    # Triton merged concurrent requests into batches.
    metrics = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics").text
    buckets = _samples(metrics, "nemo_orch_serve_batch_requests_bucket", 'model="reward"')
    assert buckets['le="1.0"'] < buckets['le="+Inf"']


def _samples(metrics: str, name: str, label: str) -> dict[str, float]:
    """The samples ``name`` of the reward model (``label``), by their other label (``""``: none),
    read with prometheus_client's own parser."""
    key, value = label.split("=")
    found = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == name and sample.labels.get(key) == value.strip('"'):
                other = [f'{k}="{v}"' for k, v in sample.labels.items() if k != key]
                found[",".join(other)] = sample.value
    return found


def test_metrics_count_requests_errors_latency_and_batches(server):
    before = _samples(
        httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics").text,
        "nemo_orch_serve_requests_total",
        'model="reward"',
    )
    assert _infer(server, "reward", _text_inputs([GOOD, GOOD])).status_code == 200
    assert _infer(server, "reward", _text_inputs([{**GOOD, "metadata": "x"}])).status_code == 400
    metrics = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics").text
    after = _samples(metrics, "nemo_orch_serve_requests_total", 'model="reward"')
    assert after['status="ok"'] == before.get('status="ok"', 0) + 1
    assert after['status="bad_request"'] == before.get('status="bad_request"', 0) + 1
    assert (
        _samples(metrics, "nemo_orch_serve_errors_total", 'model="reward"')['reason="bad_content"']
        >= 1
    )
    assert _samples(metrics, "nemo_orch_serve_request_seconds_count", 'model="reward"')[""] >= 2
    assert _samples(metrics, "nemo_orch_serve_batch_items_sum", 'model="reward"')[""] >= 3


OFFLINE_TOOLS = config_lib.CONF_DIR / "tools" / "offline"


def _endpoint_declarations(directory: Path, url: str, names: list[str] = TOOLS) -> Path:
    """The offline tools ``names`` declared by ``endpoint:`` (served at ``url``), in
    ``directory``."""
    directory.mkdir()
    for name in names:
        path = OFFLINE_TOOLS / f"{name}.yaml"
        declaration = yaml.safe_load(path.read_text())
        declaration.pop("class"), declaration.pop("options", None)
        declaration["endpoint"] = url
        (directory / path.name).write_text(yaml.safe_dump(declaration))
    return directory


def test_served_tools_answer_as_in_process_ones(server, tmp_path):
    remote = Toolbox(
        build_tools(load_declarations([_endpoint_declarations(tmp_path / "decl", server.url)]))
    )
    local = build_toolbox(config_lib.load(["tools=offline_basic"]).tools)
    task = held_out_tasks(1, BASIC)[0]
    context = ToolContext(
        task_id=task.id,
        episode_id="e",
        seed=1,
        task=task,
        allowed_documents=task.allowed_documents,
        observations=("seen",),
    )
    calls = [
        ("search", {}),
        ("python_sandbox", {"code": "print(6 * 7)"}),
        ("python_sandbox", {"code": "raise SystemExit(3)"}),
        ("call_expert", {"model": "math-large", "question": task.question}),
        ("call_expert", {"model": "no-such-alias"}),
    ]

    async def run(toolbox):
        async with toolbox:
            return [await toolbox.call(name, arguments, context) for name, arguments in calls]

    served, in_process = asyncio.run(run(remote)), asyncio.run(run(local))
    for name, (got, expected) in zip([c[0] for c in calls], zip(served, in_process)):
        assert (got.output, got.error, got.answer, got.usage) == (
            expected.output,
            expected.error,
            expected.answer,
            expected.usage,
        ), name
    assert "42" in served[1].output and served[0].output.startswith("[")


def test_the_items_of_a_batch_search_together(served):
    server, toolbox = served
    batcher = toolbox.tools["search"].batcher
    queries = ["Mount Kelu", "Vel Anor", "Ostrel river", "made-up name", "height", "author"]
    before = (batcher.batches, batcher.searches)
    answer = _infer(
        server,
        "search",
        _text_inputs(
            [{"arguments": json.dumps({"query": query}), "context": "{}"} for query in queries]
        ),
    )
    assert answer.status_code == 200, answer.text
    # One request of six items: six searches in one search_many call.
    assert (batcher.batches - before[0], batcher.searches - before[1]) == (1, len(queries))


def test_tool_model_refuses_malformed_arguments(server):
    answer = _infer(server, "python_sandbox", _text_inputs([{"arguments": "[]", "context": "{}"}]))
    assert (answer.status_code, answer.json()) == (
        400,
        {"error": "'arguments' must be a JSON object"},
    )
    answer = _infer(
        server,
        "python_sandbox",
        _text_inputs([{"arguments": '{"code": "print(1)"}', "context": '{"seed": "x"}'}]),
    )
    error = answer.json()["error"]
    assert answer.status_code == 400 and error.startswith("'context' is malformed"), error
    assert "\n" not in error and "Traceback" not in error


def _outcomes(out: Path, agent: str) -> list[tuple]:
    lines = (out / "episodes" / f"{agent.replace(':', '-')}.jsonl").read_text().splitlines()
    records = sorted((json.loads(line) for line in lines[1:]), key=lambda r: r["index"])
    return [
        (
            r["task_id"],
            r["result"]["correct"],
            r["result"]["usd"],
            r["episode"]["answer"],
            [
                (c["tool"], c["arguments"], c["error"], c["cost_usd"])
                for turn in r["episode"]["ledger"]
                for c in turn["calls"]
            ],
        )
        for r in records
    ]


def test_an_evaluation_with_served_reward_and_tools_equals_in_process(
    server, tmp_path, tiny_tokenizer_dir
):
    # The monolith searches the served retriever; the routers need the expert tool's price
    # table, which only an in-process declaration has.
    agents = ["monolith", "fixed:strongest"]
    common = [
        f"run.output_dir={tmp_path}",
        f"tokenizer.path={tiny_tokenizer_dir}",
        "model.vocab_size=1024",
        "eval.tasks=8",
        "eval.monolith.time_scale=0",
        "tools=offline_basic",
    ]
    served_tools = _endpoint_declarations(
        tmp_path / "decl", server.url, ["search", "python_sandbox"]
    )
    served = config_lib.load(
        [
            *common,
            f"eval.out_dir={tmp_path / 'served'}",
            f"reward.endpoint={server.url}",
            f"tools.declarations=[{served_tools},{OFFLINE_TOOLS / 'call_expert.yaml'}]",
        ]
    )
    local = config_lib.load([*common, f"eval.out_dir={tmp_path / 'local'}"])
    harness.run(served, agents)
    harness.run(local, agents)
    for agent in agents:
        assert _outcomes(tmp_path / "served", agent) == _outcomes(tmp_path / "local", agent)
    searches = [
        call
        for outcome in _outcomes(tmp_path / "served", "monolith")
        for call in outcome[4]
        if call[0] == "search"
    ]
    assert searches and all(call[2] is None for call in searches)
