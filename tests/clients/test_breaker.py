"""An endpoint's circuit breaker and retry budget, on a clock the test moves: open after the
failures in a row, refuse at once for the cool-down, one probe, closed by an answer, open again
by a failed probe; retries bounded by their share of the requests."""

from __future__ import annotations

import pytest

from nemo_orch.clients.breaker import UNGUARDED, EndpointGuard, GuardSettings


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_circuit_opens_cools_down_probes_and_closes():
    clock = Clock()
    guard = EndpointGuard(GuardSettings(failures=2, cooldown_s=10.0), clock)
    assert guard.admit() is None
    guard.failed("HTTP 500")
    assert guard.admit() is None and not guard.is_open  # one failure: still closed
    guard.answered()  # an answer in between: the count starts over
    guard.failed("HTTP 500")
    assert guard.admit() is None
    guard.failed("HTTP 503: overloaded")
    assert guard.is_open
    refused = guard.admit()
    assert refused == (
        "circuit open after 2 failed requests in a row (last: HTTP 503: "
        "overloaded); tried again in 10.0 s"
    )
    clock.now = 9.5
    assert guard.admit().endswith("tried again in 0.5 s")
    clock.now = 10.0
    assert guard.admit() is None  # the probe
    assert guard.admit().startswith("circuit half open after 2 failed requests in a row")
    guard.failed("no connection")  # a failed probe: open again, for a whole cool-down
    assert guard.admit().endswith("tried again in 10.0 s")
    clock.now = 20.0
    assert guard.admit() is None
    guard.answered()  # the endpoint is back
    assert not guard.is_open and guard.admit() is None and guard.admit() is None


def test_an_abandoned_probe_lets_the_next_one_go():
    clock = Clock()
    guard = EndpointGuard(GuardSettings(failures=1, cooldown_s=1.0), clock)
    guard.failed("timed out")
    clock.now = 1.0
    assert guard.admit() is None  # the probe, then cancelled: no verdict
    guard.abandoned()
    assert guard.admit() is None


def test_retries_are_bounded_by_their_share_of_the_requests():
    guard = EndpointGuard(GuardSettings(retry_ratio=0.5, retry_reserve=1))
    assert guard.may_retry() and not guard.may_retry()  # the reserve, then nothing
    guard.admit()
    guard.admit()  # two requests earn one retry
    assert guard.may_retry() and not guard.may_retry()
    unguarded = EndpointGuard(UNGUARDED)
    for _ in range(10):
        unguarded.failed("down")
        assert unguarded.may_retry() and unguarded.admit() is None


def test_settings_are_checked():
    with pytest.raises(ValueError, match="failures >= 0"):
        GuardSettings(failures=-1)
    with pytest.raises(ValueError, match="retry_ratio >= 0"):
        GuardSettings(retry_ratio=-0.1)
