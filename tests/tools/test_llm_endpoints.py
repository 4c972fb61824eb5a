"""``tools.endpoints``: a launch hands the expert servers' URLs to the LLM tools by alias."""

import asyncio

from nemo_orch.tools.base import BuildSettings, ToolSpec
from nemo_orch.tools.llm import LLMTool

SPEC = ToolSpec("call_expert", "Ask an expert model.", {"type": "object", "properties": {}})
MODELS = {
    "math": {"base_url": "http://127.0.0.1:8001/v1", "model": "Qwen/Qwen3-32B"},
    "coder": {"base_url": "http://127.0.0.1:8002/v1", "model": "Qwen/Qwen3-32B"},
}


def built(endpoints=None) -> dict[str, str]:
    tool = LLMTool(SPEC, MODELS, build=BuildSettings(endpoints=endpoints or {}))
    asyncio.run(tool.close())
    return {alias: endpoint.base_url for alias, endpoint in tool.endpoints.items()}


def test_endpoints_replace_the_declared_base_urls_of_their_aliases_only():
    assert built({"math": "http://node7:8001/v1", "judge": "http://node9:8004/v1"}) == {
        "math": "http://node7:8001/v1",
        "coder": "http://127.0.0.1:8002/v1",
    }
    assert built() == {"math": "http://127.0.0.1:8001/v1", "coder": "http://127.0.0.1:8002/v1"}
