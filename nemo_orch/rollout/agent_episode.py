"""What an agent loop gets of an episode of the training endpoint
(:mod:`nemo_orch.rollout.external`, ``rollout.agent=external``), and how a loop in a process of
its own asks for the next one. Imports nothing heavy: an agent loop's process needs only this
(and ``httpx``, which the ``openai`` SDK brings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STOPPED = 503  # what a request gets once the rollouts have ended


@dataclass(frozen=True)
class AgentEpisode:
    """An episode as an agent loop gets it: ``base_url`` is its OpenAI base URL (pass it to the
    client; the model is ``model``), ``messages`` and ``tools`` its first messages and tools as
    the built-in loop would offer them (the loop may offer others), ``task_id`` the task's."""

    id: str
    url: str
    model: str
    task_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]

    @property
    def base_url(self) -> str:
        return f"{self.url}/sessions/{self.id}/v1"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AgentEpisode:
        return cls(**{key: data[key] for key in cls.__dataclass_fields__})

    def call_tool(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Run the policy's call ``name(arguments)`` with the environment's tool: its
        ``output`` (the observation, an error's included), ``error``, ``kind``, ``answer``
        (not null: the episode ended with it) and ``cost_usd``."""
        return _post(f"{self.url}/sessions/{self.id}/tools/{name}", {"arguments": arguments})

    def end(self, answer: str | None = None, correct: bool | None = None) -> str:
        """Report the episode's end: the loop's final ``answer`` (where the policy's turns gave
        none) and, if it scored the answer itself, ``correct``; returns the termination."""
        body: dict[str, Any] = {} if answer is None else {"answer": answer}
        if correct is not None:
            body["correct"] = correct
        return _post(f"{self.url}/sessions/{self.id}/end", body)["termination"]


class EndpointStopped(ConnectionError):
    """The training endpoint is gone: the rollouts ended (training finished or stopped)."""


def next_episode(url: str, wait_s: float = 30.0) -> AgentEpisode | None:
    """The next episode the endpoint at ``url`` hands out, waiting at most ``wait_s`` seconds
    for one (None: none came yet); :class:`EndpointStopped` once the rollouts have ended."""
    episode = _post(f"{url}/v1/episodes/next", {"wait_s": wait_s}, timeout_s=wait_s + 30)
    return None if episode["episode"] is None else AgentEpisode.from_json(episode["episode"])


def _post(url: str, body: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    import httpx  # the agent loop's side: imported there only

    try:
        response = httpx.post(url, json=body, timeout=timeout_s)
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as error:
        raise EndpointStopped(f"POST {url}: {error}") from None  # closed, or closing
    if response.status_code == STOPPED:
        raise EndpointStopped(f"POST {url}: {response.text[:500]}")
    if response.status_code != 200:
        raise RuntimeError(f"POST {url}: {response.status_code} {response.text[:500]}")
    return response.json()
