"""Chaos's clients against a stub gateway: prompts in families, each answer kept as an Outcome (a
refusal by its OpenAI code, the replica and Retry-After from the headers), a burst in order, and
steady traffic that can be cut by time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from bench.chaos_fleet import MODEL
from bench.chaos_traffic import Traffic, _outcome, burst, completion, family_prompt
from protocol.loopback_ports import free_port
from tests.bench.stub_server import serving


def test_prompts_of_a_family_share_their_prefix_and_nothing_else() -> None:
    a, b, other = family_prompt(0), family_prompt(6), family_prompt(1)
    assert len(a) == 104 and a[:64] == b[:64] and a[64:] != b[64:]
    assert a[:64] != other[:64]
    assert all(t < 49_152 for i in range(200) for t in family_prompt(i, families=50))
    assert completion([1, 2], max_tokens=3, stream=True) == {
        "model": MODEL, "prompt": [1, 2], "max_tokens": 3, "ignore_eos": True, "stream": True,
    }  # fmt: skip


def test_an_outcome_names_a_refusal_by_its_code() -> None:
    start = time.monotonic()
    refused = _outcome(start, 429, {"Retry-After": "1"}, b'{"error": {"code": "overloaded"}}')
    assert refused.status == 429 and refused.retry_after == "1" and refused.error == "overloaded"
    assert refused.latency_s >= 0
    assert _outcome(start, 502, {}, b"Bad Gateway" + b"!" * 100).error == "Bad Gateway" + "!" * 69
    ok = _outcome(start, 200, {"x-prefixgate-replica": "w1"}, b"{}")
    assert ok.error is None and ok.replica == "w1"


@pytest.fixture
def gateway() -> Iterator[str]:
    """Answers a completion whose prompt starts with an even token, refuses the others with 429."""

    async def complete(request: web.Request) -> web.Response:
        body: dict[str, Any] = await request.json()
        if body["prompt"][0] % 2:
            error = {"error": {"code": "overloaded"}}
            return web.json_response(error, status=429, headers={"Retry-After": "2"})
        return web.json_response({"choices": []}, headers={"x-prefixgate-replica": "w0"})

    with serving(("POST", "/v1/completions", complete)) as url:
        yield url


def test_a_burst_keeps_every_answer_in_order(gateway: str) -> None:
    outcomes = asyncio.run(burst(gateway, [completion([i]) for i in range(6)]))
    assert [o.status for o in outcomes] == [200, 429] * 3
    assert [o.error for o in outcomes[:2]] == [None, "overloaded"]
    assert outcomes[0].replica == "w0" and outcomes[1].retry_after == "2"


def test_a_burst_to_nothing_counts_no_answer() -> None:
    [outcome] = asyncio.run(burst(f"http://127.0.0.1:{free_port()}", [completion([0])], timeout_s=5))
    assert outcome.status == 0 and outcome.error


def test_traffic_runs_until_stopped_and_can_be_cut_by_time(gateway: str) -> None:
    with Traffic([gateway], lambda i: completion([2 * i]), concurrency=2, pause_s=0.0) as traffic:
        traffic.wait_for_requests(10)
        middle = time.monotonic()
        traffic.wait_for_requests(len(traffic.outcomes) + 10)
    done = len(traffic.outcomes)
    time.sleep(0.1)
    assert len(traffic.outcomes) == done >= 20  # stopped: no more requests
    assert all(o.status == 200 for o in traffic.outcomes)
    later = traffic.between(middle)
    assert 0 < len(later) < done and all(o.start >= middle for o in later)
    assert len(traffic.between(0.0, middle)) == done - len(later)
