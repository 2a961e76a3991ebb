"""Polling and asking a process over HTTP: how long a wait took, a timeout that names what it waited
for, a Prometheus sample found by exact name, and nothing listening read as None."""

from __future__ import annotations

import time

import pytest

from bench.probes import get_json, metric, sample, wait_until
from protocol.loopback_ports import free_port

PAGE = """\
# TYPE prefixgate_gateway_inflight_requests gauge
prefixgate_gateway_inflight_requests 3.0
prefixgate_gateway_inflight_requests_max 9.0
prefixgate_gateway_redis_up{gateway="g0"} 1.0
"""


def test_wait_until_returns_the_seconds_it_took() -> None:
    ready_at = time.monotonic() + 0.2
    took = wait_until(lambda: time.monotonic() >= ready_at, 5, "the clock", poll_s=0.01)
    assert 0.15 < took < 2


def test_wait_until_names_what_timed_out() -> None:
    calls = []
    with pytest.raises(TimeoutError, match="waiting for the moon"):
        wait_until(lambda: calls.append(1), 0.1, "the moon", poll_s=0.01)
    assert len(calls) > 2


def test_a_sample_is_found_by_its_exact_unlabelled_name() -> None:
    assert sample(PAGE, "prefixgate_gateway_inflight_requests") == 3.0
    assert sample(PAGE, "prefixgate_gateway_inflight_requests_max") == 9.0
    # A labelled sample is not an unlabelled one.
    assert sample(PAGE, "prefixgate_gateway_redis_up") is None


def test_nothing_listening_answers_none() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert get_json(f"{url}/health", timeout_s=0.5) is None
    assert metric(url, "prefixgate_gateway_inflight_requests") is None
