"""Prometheus metrics of a server: requests by outcome, latency and batch-size histograms, errors.

One :class:`ServeMetrics` per server, each with its own registry (so several servers in one
process, as in the tests, never share counters), exported on the metrics port as
``/metrics``. Names follow Prometheus conventions (``nemo_orch_serve_*``; the ``model`` label
is a Triton model or an HTTP route).
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics:
    """The counters and histograms of one server; ``serve`` exports them over HTTP."""

    def __init__(self, server: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"registry": self.registry}
        self.requests = Counter(
            "nemo_orch_serve_requests",
            f"Requests answered by the {server} server, by outcome "
            "(ok, bad_request: the client's fault, error: the server's)",
            ["model", "status"],
            **labels,
        )
        self.errors = Counter(
            "nemo_orch_serve_errors",
            "Requests that failed, by reason",
            ["model", "reason"],
            **labels,
        )
        self.latency = Histogram(
            "nemo_orch_serve_request_seconds",
            "Seconds from receiving a request (a batch, for Triton models) to its answer",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            **labels,
        )
        self.batch_requests = Histogram(
            "nemo_orch_serve_batch_requests",
            "Requests merged into one batch",
            ["model"],
            buckets=BATCH_BUCKETS,
            **labels,
        )
        self.batch_items = Histogram(
            "nemo_orch_serve_batch_items",
            "Items (rows) in one batch",
            ["model"],
            buckets=BATCH_BUCKETS,
            **labels,
        )
        self._http: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def observe(self, model: str, status: str, seconds: float, reason: str | None = None) -> None:
        """Count one answered request; ``reason`` (for failures) says why it failed."""
        self.requests.labels(model, status).inc()
        self.latency.labels(model).observe(seconds)
        if reason is not None:
            self.errors.labels(model, reason).inc()

    def observe_batch(self, model: str, requests: int, items: int) -> None:
        self.batch_requests.labels(model).observe(requests)
        self.batch_items.labels(model).observe(items)

    def serve(self, host: str, port: int) -> int:
        """Export ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread; returns the
        port."""
        self._http, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
