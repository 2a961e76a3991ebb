"""Polling and asking a process over HTTP: a wait that returns what it waited for, a timeout that
names it, a coroutine's wait that lets the loop run, a Prometheus sample found by exact name, and
nothing listening read as None."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.probes import get_json, metric, sample, wait_for, wait_for_async
from protocol.loopback_ports import free_port

PAGE = """\
# TYPE prefixgate_gateway_inflight_requests gauge
prefixgate_gateway_inflight_requests 3.0
prefixgate_gateway_inflight_requests_max 9.0
prefixgate_gateway_redis_up{gateway="g0"} 1.0
"""


def test_wait_for_returns_the_value_of_a_condition_that_becomes_true() -> None:
    answers = iter([None, 0, "", {"seq": 3}])
    assert wait_for(lambda: next(answers), "the third answer", interval=0.001) == {"seq": 3}


def test_wait_for_names_what_never_happened_after_the_timeout() -> None:
    calls = []
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"after 0\.1 s waiting for the moon"):
        wait_for(lambda: calls.append(1), "the moon", timeout=0.1, interval=0.01)
    assert time.monotonic() - start >= 0.1
    assert len(calls) > 2


def test_wait_for_async_lets_the_loop_run_between_calls() -> None:
    async def main() -> bool:
        done = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, done.set)
        # Only the loop can make the condition true: a poll that blocked it would time out.
        return await wait_for_async(done.is_set, "the timer", timeout=2, interval=0.01)

    assert asyncio.run(main()) is True


def test_wait_for_async_names_what_never_happened_after_the_timeout() -> None:
    with pytest.raises(TimeoutError, match="waiting for the moon"):
        asyncio.run(wait_for_async(lambda: False, "the moon", timeout=0.05, interval=0.01))


def test_a_sample_is_found_by_its_exact_unlabelled_name() -> None:
    assert sample(PAGE, "prefixgate_gateway_inflight_requests") == 3.0
    assert sample(PAGE, "prefixgate_gateway_inflight_requests_max") == 9.0
    # A labelled sample is not an unlabelled one.
    assert sample(PAGE, "prefixgate_gateway_redis_up") is None


def test_nothing_listening_answers_none() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert get_json(f"{url}/health", timeout_s=0.5) is None
    assert metric(url, "prefixgate_gateway_inflight_requests") is None
