"""ToolOrchestra's interface on real experts (``tools=reference``, conf/tools/reference/) served
end to end: ``nemo-orch serve orchestrator``'s ``POST /v1/orchestrate`` runs a scripted policy
that calls ``search(model=search-2)``, ``enhance_reasoning(model=reasoner-3)`` and
``answer(model=answer-1)``; the composites' LLM experts are local scripted OpenAI-compatible
servers (one per served model name, every alias pointed at its server with
``+tools.endpoints.<alias>=URL``), the search executor is a SIMULATED Tavily endpoint and the
program runs in the real sandbox. It shows that the reference declarations build through the
project's own config path, that each alias reaches its model, that every call is billed at its
model's list price plus its executor's fee, that the offered schemas list those prices, and
that API keys never reach the response."""

from __future__ import annotations

import re
import shutil
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
import yaml
from support.scripted_plans import follow_plan, with_plan
from support.simulated_tavily import SimulatedTavily

from nemo_orch import config as config_lib
from nemo_orch.config import RolloutConfig, ServeConfig, resolve_conf_path
from nemo_orch.data.tasks import Task
from nemo_orch.rollout.builders import build_toolbox
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.serve.openai_server import start_server
from nemo_orch.serve.orchestrator import serve_orchestrator
from nemo_orch.tools.base import Usage
from nemo_orch.tools.pricing import model_pricing
from nemo_orch.tools.registry import load_declarations

OPENAI_SENTINEL = "sk-SENTINEL-openai-0123456789"
TAVILY_SENTINEL = "tvly-SENTINEL-0123456789"
# The aliases' models, as ToolOrchestra's tool descriptions list them.
ALIAS_MODELS = {
    "search": {"search-1": "gpt-5", "search-2": "gpt-5-mini", "search-3": "Qwen/Qwen3-32B"},
    "enhance_reasoning": {
        "reasoner-1": "gpt-5",
        "reasoner-2": "gpt-5-mini",
        "reasoner-3": "Qwen/Qwen2.5-Coder-32B-Instruct",
    },
    "answer": {
        "answer-1": "gpt-5",
        "answer-2": "gpt-5-mini",
        "answer-3": "meta-llama/Llama-3.3-70B-Instruct",
        "answer-4": "Qwen/Qwen3-32B",
        "answer-math-1": "Qwen/Qwen2.5-Math-72B-Instruct",
        "answer-math-2": "Qwen/Qwen2.5-Math-7B-Instruct",
    },
}
QUESTION = "How high is Mount Kelu, in meters? Give twice that number."
PLAN = [
    ("search", {"model": "search-2"}),
    ("enhance_reasoning", {"model": "reasoner-3"}),
    ("answer", {"model": "answer-1"}),
]
FACT = "Mount Kelu is 4200 meters high."
SETTINGS = RolloutConfig(max_context_tokens=4096, max_turns=4, temperature=0.0)


def expert_reply(prompt: str) -> str:
    """What an expert writes for a composite's prompt: a query line, a ```python block or an
    ``<answer>``, read from the question and the observations under "Context:"."""
    asked = prompt.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0]
    question = asked.rsplit("Question: ", 1)[-1]
    context = asked.split("Context:\n", 1)[1] if "Context:\n" in asked else ""
    if "search query" in asked:
        entity = re.search(r"How high is ([\w ]+?),", question)[1]
        return f'"height of {entity}"\nThat should find it.'
    if "Python program" in asked:
        meters = re.search(r"(\d+) meters", context)[1]
        return f"Double the height found:\n```python\nprint({meters} * 2)\n```"
    results = re.findall(r"Result:\n(.*)", context)  # the program's output, the last result
    return f"The program computed it. <answer>{results[-1].strip()}</answer>"


def tavily_results(query: str) -> dict[str, Any]:
    """The SIMULATED web: a query about Mount Kelu finds one made-up page; any other nothing."""
    found = (
        [
            {
                "title": "Mount Kelu",
                "url": "https://example.org/kelu",
                "content": FACT,
                "score": 0.9,
                "raw_content": None,
            }
        ]
        if "Mount Kelu" in query
        else []
    )
    return {"query": query, "answer": None, "results": found, "response_time": 0.01}


def llm_models() -> dict[str, dict[str, Any]]:
    """Every LLM expert alias of the reference declarations and its endpoint options."""
    return {
        alias: options
        for declaration in load_declarations([resolve_conf_path("tools/reference")])
        if declaration.class_path == "nemo_orch.tools.llm.LLMTool"
        for alias, options in declaration.options["models"].items()
    }


def test_reference_interface_through_the_orchestrator(tiny_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", OPENAI_SENTINEL)
    monkeypatch.setenv("TAVILY_API_KEY", TAVILY_SENTINEL)
    models = llm_models()
    assert {alias: options["model"] for alias, options in models.items()} == {
        alias: model for aliases in ALIAS_MODELS.values() for alias, model in aliases.items()
    }
    # web_search's base_url is a tool option, not an LLM alias (tools.endpoints cannot set it):
    # the reference declarations are copied with it pointed at the simulated endpoint.
    declarations = tmp_path / "reference"
    shutil.copytree(resolve_conf_path("tools/reference"), declarations)
    asked: list[tuple[str, str]] = []  # (served model, prompt) in order
    with ExitStack() as stack:
        tavily = SimulatedTavily(TAVILY_SENTINEL, tavily_results)
        stack.callback(tavily.stop)
        web_search = yaml.safe_load((declarations / "web_search.yaml").read_text())
        web_search["options"]["base_url"] = tavily.url
        (declarations / "web_search.yaml").write_text(yaml.safe_dump(web_search))
        servers = {}
        for model in sorted({options["model"] for options in models.values()}):
            # OpenAI's models check the key the tool sends; the open ones take none.
            key = OPENAI_SENTINEL if model.startswith("gpt-") else None
            servers[model] = stack.enter_context(
                start_server(
                    ScriptedEngine(
                        tiny_tokenizer,
                        lambda prompt, model=model: (
                            asked.append((model, prompt)) or expert_reply(prompt)
                        ),
                    ),
                    tiny_tokenizer,
                    model,
                    api_key=key,
                )
            )
        config = config_lib.load(
            [
                "tools=reference",
                f"tools.declarations=['{declarations}']",
                *(
                    f"+tools.endpoints.{alias}='{servers[options['model']].url}'"
                    for alias, options in models.items()
                ),
            ]
        )
        toolbox = build_toolbox(config.tools)
        orchestrator = stack.enter_context(
            serve_orchestrator(
                ScriptedEngine(tiny_tokenizer, follow_plan),
                tiny_tokenizer,
                toolbox,
                SETTINGS,
                ServeConfig(http_port=0, metrics_port=None),
                "orchestrator",
            )
        )
        task = with_plan(Task("kelu", QUESTION), PLAN, "the policy never answers itself")
        response = httpx.post(
            f"{orchestrator.url}/orchestrate",
            json={"question": task.question, "id": "kelu", "system": "Use tools."},
            timeout=60,
        )
        schemas = toolbox.schemas()

    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["finish_reason"], body["answer"], body["turns"]) == ("answer", "8400", 3)
    assert [model for model, _ in asked] == [
        "gpt-5-mini",
        "Qwen/Qwen2.5-Coder-32B-Instruct",
        "gpt-5",
    ]
    assert [request["body"]["query"] for request in tavily.requests] == ["height of Mount Kelu"]
    calls = body["ledger"]["calls"]
    assert [(c["tool"], c["arguments"], c["error"]) for c in calls] == [
        (name, arguments, None) for name, arguments in PLAN
    ]
    assert "Query:\nheight of Mount Kelu" in body["messages"][3]["content"]
    assert FACT in body["messages"][3]["content"]
    assert "Result:\n8400" in body["messages"][5]["content"]

    def token_cost(call: dict, alias: str) -> float:
        assert call["input_tokens"] > 0 and call["output_tokens"] > 0
        model = ALIAS_MODELS[call["tool"]][alias]
        return model_pricing(model).cost(Usage(call["input_tokens"], call["output_tokens"]), 0.0)

    searched, computed, answered = calls
    tavily_fee = web_search["pricing"]["per_call"]
    assert searched["cost_usd"] == pytest.approx(token_cost(searched, "search-2") + tavily_fee)
    # The sandbox bills its own seconds (per_second), a part of the call's.
    per_second = yaml.safe_load((declarations / "sandbox.yaml").read_text())["pricing"][
        "per_second"
    ]
    coder = token_cost(computed, "reasoner-3")
    assert coder < computed["cost_usd"] <= coder + per_second * computed["latency_s"] + 1e-12
    assert answered["cost_usd"] == pytest.approx(token_cost(answered, "answer-1"))
    assert body["ledger"]["cost_usd"] == pytest.approx(
        sum(c["cost_usd"] for c in calls) + body["ledger"]["orchestrator_cost_usd"]
    )

    # The offered tools: ToolOrchestra's three, each alias listed with its model's price.
    assert sorted(s["function"]["name"] for s in schemas) == sorted(ALIAS_MODELS)
    for schema in schemas:
        aliases = ALIAS_MODELS[schema["function"]["name"]]
        model = schema["function"]["parameters"]["properties"]["model"]
        assert model["enum"] == list(aliases)
        assert model["prices"] == {
            alias: model_pricing(name).usd_per_million_tokens for alias, name in aliases.items()
        }
        assert "prices: USD per million input/output tokens" in schema["function"]["description"]

    # The keys reached their servers (the gpt-5 ones and Tavily answered) but not the client.
    for secret in (OPENAI_SENTINEL, TAVILY_SENTINEL):
        assert secret not in response.text


def test_reference_offers_the_offline_interface():
    """tools=reference offers what tools=offline does (names, descriptions, aliases): a policy
    trained on the simulated experts calls the real ones the same way."""

    def offered(directory: str) -> dict[str, tuple[str, dict]]:
        return {
            d.spec.name: (d.spec.description, d.spec.parameters)
            for d in load_declarations([resolve_conf_path(directory)])
            if not d.part
        }

    assert offered("tools/reference") == offered("tools/orchestra")
