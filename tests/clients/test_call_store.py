"""The call store (:mod:`nemo_orch.clients.call_store`): keys by what determines an answer and
never by a secret; eight processes writing at once lose nothing; past its bound the least
recently used calls go first; exchanges recorded with a real server replay with it down; a real
MCP server's calls and the sandbox's runs replay too."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import sys
from pathlib import Path

import pytest

from nemo_orch.call_kinds import CallKind
from nemo_orch.clients import call_store
from nemo_orch.clients.call_store import CallStore, call_key
from nemo_orch.clients.openai import OpenAIClient, OpenAIError
from nemo_orch.config import CallsConfig, McpServerConfig
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.serve.openai_server import start_server
from nemo_orch.tools.base import ToolResult
from nemo_orch.tools.mcp import mcp_source
from nemo_orch.tools.registry import Toolbox
from nemo_orch.tools.sandbox import PythonSandbox, default_spec

MCP_SERVER = str(Path(__file__).resolve().parents[1] / "support" / "mcp_server.py")

CHAT = {
    "model": "gpt-5",
    "messages": [{"role": "user", "content": "What is 2 + 2?"}],
    "temperature": 0.0,
    "seed": 7,
}


def test_a_call_is_keyed_by_what_decides_its_answer_and_no_secret_is_kept(tmp_path):
    url = "http://127.0.0.1:9/v1/chat/completions"
    key = call_key("POST", url, CHAT)
    assert key == call_key("post", url, dict(reversed(CHAT.items())))  # order aside
    assert key != call_key("POST", url, {**CHAT, "seed": 8})
    assert key == call_key("POST", url.replace(":9", ":10"), CHAT)  # a local server's port aside
    remote = "https://api.example.com/v1/chat/completions"
    assert call_key("POST", remote, CHAT) != call_key("POST", remote.replace("api", "eu"), CHAT)
    assert key != call_key("POST", url.replace("chat/completions", "completions"), CHAT)
    with_key = {**CHAT, "api_key": "sk-secret", "options": {"Access-Token": "t0ken"}}
    assert call_key("POST", url, with_key) == call_key("POST", url, {**CHAT, "options": {}})
    store = CallStore(tmp_path / "calls.db")
    assert store.put(key, url, with_key, {"answer": "4"}, 0.5)
    assert not store.put(key, url, with_key, {"answer": "5"}, 0.1)  # the first answer stays
    stored = store.get(key)
    assert stored.response == {"answer": "4"} and stored.seconds == 0.5
    assert "sk-secret" not in (tmp_path / "calls.db").read_bytes().decode("latin-1")
    assert "t0ken" not in (tmp_path / "calls.db").read_bytes().decode("latin-1")
    assert stored.request == {**CHAT, "options": {}}
    assert store.get(call_key("POST", url, {**CHAT, "seed": 8})) is None


def _write(path: Path, writer: int, calls: int) -> None:
    store = CallStore(path)
    for index in range(calls):
        request = {**CHAT, "seed": writer * 1000 + index}
        store.put(call_key("POST", "u", request), "u", request, {"writer": writer}, 0.0)
        shared = {**CHAT, "seed": -1}  # every writer records this one too: one answer stays
        store.put(call_key("POST", "u", shared), "u", shared, {"writer": writer}, 0.0)


def test_eight_writers_at_once_lose_nothing(tmp_path):
    path = tmp_path / "calls.db"
    CallStore(path)
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write, args=(path, w, 40)) for w in range(8)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(timeout=120)
        assert process.exitcode == 0
    store = CallStore(path)
    assert store.stats()["calls"] == 8 * 40 + 1
    for writer in range(8):
        for index in range(40):
            request = {**CHAT, "seed": writer * 1000 + index}
            assert store.get(call_key("POST", "u", request)).response == {"writer": writer}


def test_past_its_bound_the_least_recently_used_calls_are_evicted(tmp_path):
    store = CallStore(tmp_path / "calls.db", max_mb=16 / 1024)  # 16 KiB
    keys = []
    for index in range(12):
        request = {**CHAT, "seed": index}
        keys.append(call_key("POST", "u", request))
        store.put(keys[-1], "u", request, {"text": "x" * 2000}, 0.0)
        if index == 6:  # before the first eviction
            assert store.get(keys[0]) is not None  # read: the most recently used now
    stats = store.stats()
    assert stats["bytes"] <= 16 * 1024 and stats["evicted"] >= 1
    assert store.get(keys[0]) is not None and store.get(keys[-1]) is not None
    assert store.get(keys[1]) is None  # the least recently used went first


def test_exchanges_with_a_real_server_replay_with_the_server_down(tmp_path, tiny_tokenizer):
    """``nemo-orch``'s OpenAI-compatible server (real HTTP, a scripted engine behind it)
    answers an ``OpenAIClient`` while the store records; with the server gone, replay gives
    the same replies (usage included, which the ledger prices), a call the store does not hold
    fails as an infrastructure error, and ``replay_or_call`` tries the network for it."""
    config = CallsConfig(mode="record", store=str(tmp_path / "calls.db"))
    questions = ["What is 2 + 2?", "Name a prime.", "Stream me a word."]

    async def ask(client: OpenAIClient, question: str):
        return await client.chat([{"role": "user", "content": question}], max_tokens=16, seed=3)

    async def asked(url: str, mode: str, items: list[str]):
        client = OpenAIClient(url, "policy", max_retries=0, timeout_s=5)
        with call_store.recording(dataclasses.replace(config, mode=mode)) as recording:
            async with client:
                replies = [await ask(client, question) for question in items]
            return replies, recording.counts()

    engine = ScriptedEngine(tiny_tokenizer, lambda prompt: f"reply {len(prompt)}")
    with start_server(engine, tiny_tokenizer, "policy") as server:
        live, recorded = asyncio.run(asked(server.url, "record", questions))
    assert recorded == {"replayed": 0, "recorded": 3, "missed": 0}
    replayed, counts = asyncio.run(asked(server.url, "replay", questions))
    assert counts == {"replayed": 3, "recorded": 0, "missed": 0}

    def seen(replies):
        return [(r.text, r.input_tokens, r.output_tokens, r.finish_reason) for r in replies]

    assert seen(replayed) == seen(live)
    for mode in ("replay", "replay_or_call"):
        with pytest.raises(OpenAIError) as missed:
            asyncio.run(asked(server.url, mode, ["Something never asked."]))
        assert missed.value.kind == CallKind.INFRA_ERROR
    assert "not in the call store" in str(
        pytest.raises(OpenAIError, asyncio.run, asked(server.url, "replay", ["Again?"])).value
    )


def test_an_mcp_servers_calls_and_the_sandboxs_runs_are_recorded_and_replayed(
    tmp_path, monkeypatch
):
    """Calls outside HTTP: a real MCP server's (stdio; its answer read from its environment,
    which the replay changes, and an image part) and the sandbox's runs (a random number):
    replayed, each is the recorded answer, marked, billed its recorded seconds; a run the store
    does not hold is an infrastructure error, not a run."""
    server = McpServerConfig(
        name="fx",
        command=sys.executable,
        args=[MCP_SERVER, "stdio"],
        allow=["whoami", "captioned"],
        env=["FIXTURE_SECRET"],
    )
    draw = "import random, time; time.sleep(0.3); print(random.random())"

    async def calls(mode: str, code: str) -> tuple[list[ToolResult], dict[str, int]]:
        toolbox = Toolbox(
            [PythonSandbox(default_spec(), timeout_s=5.0, memory_mb=256)],
            sources=[mcp_source(server)],
        )
        with call_store.recording(CallsConfig(mode, str(tmp_path / "calls.db"))) as recording:
            async with toolbox:
                results = [
                    await toolbox.call("fx_whoami", {}),
                    await toolbox.call("fx_captioned", {}),
                    await toolbox.call("python_sandbox", {"code": code}),
                ]
            return results, recording.counts()

    monkeypatch.setenv("FIXTURE_SECRET", "the recorded run")
    recorded, counts = asyncio.run(calls("record", draw))
    assert counts == {"replayed": 0, "recorded": 3, "missed": 0}
    assert recorded[0].output == "the recorded run" and "image" in recorded[1].output
    monkeypatch.setenv("FIXTURE_SECRET", "another run")
    replayed, counts = asyncio.run(calls("replay", draw))
    assert counts == {"replayed": 3, "recorded": 0, "missed": 0}
    assert [r.output for r in replayed] == [r.output for r in recorded]
    assert all(r.replayed and r.kind == "ok" for r in replayed)
    assert not any(r.replayed for r in recorded)
    assert replayed[2].latency_s >= 0.3  # the run's recorded seconds
    missed, _ = asyncio.run(calls("replay", "print('never run')"))
    assert missed[2].kind == "infra_error" and "not in the call store" in missed[2].error
