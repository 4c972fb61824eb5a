"""The client of the project's Triton models: KServe v2 JSON over HTTP, under the project's rules
for external calls (:class:`~nemo_orch.clients.http.JSONClient`: timeouts, bounded retries with
backoff on connection errors and 5xx, keys from the environment, a bound on requests in flight),
and a model that is not loaded yet retried too (a restarting server).

Every model of :mod:`nemo_orch.serve.triton` takes and returns text items plus an ``error``
output; :meth:`KServeClient.infer` sends items as rows (input name -> text) and returns the
output rows, raising :class:`KServeError` for a refused request or a row with an error. The
standard clients work as well (``pytriton.client.ModelClient``, ``tritonclient``); this one fits
the project's asyncio code and its retry rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from nemo_orch.clients.breaker import GuardSettings
from nemo_orch.clients.http import HTTPError, JSONClient, error_message

# Every model of the project's Triton servers answers this output too: empty, or why the
# request was refused.
ERROR_OUTPUT = "error"


class KServeError(HTTPError):
    """A request the model refused or failed (``status``: HTTP status; None: no answer)."""


def _loading(response: httpx.Response) -> bool:
    """Whether Triton refused for a model it has not loaded yet: a server restarting answers
    HTTP 400 (``unknown model``, ``not ready``) until its models are up."""
    if response.status_code != 400:
        return False
    message = error_message(response)
    return "unknown model" in message or "is not ready" in message


class KServeClient:
    """Rows in, rows out, for one model at ``base_url`` (``http://host:port``), under the
    endpoint's ``guard`` (:mod:`nemo_orch.clients.breaker`)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        max_in_flight: int | None = None,
        api_key_env: str | None = None,
        guard: GuardSettings = GuardSettings(),
    ) -> None:
        self.model = model
        self.client = JSONClient(
            base_url,
            timeout_s=timeout_s,
            max_retries=max_retries,
            max_in_flight=max_in_flight,
            api_key_env=api_key_env,
            guard=guard,
        )
        self.client.error_type = KServeError
        self.client.retry_also = _loading

    def __repr__(self) -> str:
        return f"KServeClient({self.client.base_url!r}, {self.model!r})"

    async def infer(self, rows: Sequence[Mapping[str, str]]) -> list[dict[str, Any]]:
        """Send ``rows`` (each: input name -> text) as one request; one output row each."""
        if not rows:
            return []
        names = list(rows[0])
        inputs = [
            {
                "name": name,
                "datatype": "BYTES",
                "shape": [len(rows), 1],
                "data": [row[name] for row in rows],
            }
            for name in names
        ]
        answer = await self.client.request(
            "POST", f"/v2/models/{self.model}/infer", {"inputs": inputs}
        )
        try:
            columns = {output["name"]: output["data"] for output in answer["outputs"]}
        except (KeyError, TypeError):
            raise KServeError(f"{self.model}: the answer has no outputs") from None
        out = [dict(zip(columns, values)) for values in zip(*columns.values())]
        if len(out) != len(rows):
            raise KServeError(f"{self.model}: {len(out)} output rows for {len(rows)} inputs")
        for row in out:
            if row.get(ERROR_OUTPUT):
                raise KServeError(f"{self.model} refused the request: {row[ERROR_OUTPUT]}", 400)
        return out

    async def aclose(self) -> None:
        await self.client.aclose()
