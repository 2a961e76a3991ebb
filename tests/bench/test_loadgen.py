"""The replay's load generator against a real simulated worker over loopback HTTP: failures counted by
kind, agent sessions closed loop within a session; and the bodies it sends and the kinds it counts."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from bench.arrivals import Arrival, Prompt
from bench.loadgen import closed_loop, completion_body, failure_kind, replay, replay_sessions
from bench.token_text import text_of
from bench.workloads import TOKEN_LOW, AgentParams, agent_sessions
from gateway.forward.upstream import UpstreamError
from tests.support.servers import free_port


@pytest.mark.fleet
def test_failures_are_counted_by_kind_not_raised(worker_url: str) -> None:
    prompt = Prompt(tuple(range(TOKEN_LOW, TOKEN_LOW + 32)), 4)
    arrivals = [Arrival(0.01 * i, prompt) for i in range(5)]

    def run(url: str, model: str | None = None) -> dict:
        return asyncio.run(replay(url, arrivals, model=model, progress=False)).summary()

    refused = run(f"http://127.0.0.1:{free_port()}")  # nothing listens; the model cannot be asked either
    assert (refused["sent"], refused["completed"], refused["errors"]) == (5, 0, {"connect": 5})
    assert refused["ttft_s"]["p50"] is None and refused["hit_rate"] == 0.0
    assert run(worker_url, model="no-such-model")["errors"] == {"http_404": 5}
    slow = [Arrival(0.0, Prompt(prompt.token_ids, 500))]
    assert asyncio.run(replay(worker_url, slow, timeout_s=0.2, progress=False)).errors == {"timeout": 1}
    assert run(worker_url)["completed"] == 5  # the worker is fine after all that


@pytest.mark.fleet
def test_agent_sessions_are_closed_loop_within_a_session(worker_url: str) -> None:
    params = AgentParams(
        tenants=1,
        system_tokens=64,
        sessions=2,
        min_turns=3,
        max_turns=3,
        tool_tokens=32,
        min_output_tokens=4,
        max_output_tokens=8,
        think_base_s=0.3,
        think_mean_s=0.01,
        start_window_s=0.1,
    )
    sessions = agent_sessions(params)
    result = asyncio.run(replay_sessions(worker_url, sessions, progress=False))
    summary = result.summary()
    assert result.sent == summary["completed"] == 6 and summary["errors"] == {}
    # Each session waits for each answer and then thinks: its turns cannot overlap, so the run lasts
    # at least one session's answers and two think times.
    by_session = sorted(result.records, key=lambda r: r.prompt_tokens)
    assert result.elapsed_s >= 2 * 0.3 + sum(r.e2e_s for r in by_session[::2])
    # Later turns extend earlier ones (and the two sessions share a system prompt): cached.
    assert sum(r.cached_tokens > 0 for r in result.records) >= 4


def test_a_completion_body_streams_exactly_max_tokens_of_the_prompt_as_ids_or_words() -> None:
    body, prompt_len = completion_body((5, 6, 7), 4, "m", "s1")
    assert prompt_len == 3
    assert orjson.loads(body) == {
        "prompt": [5, 6, 7],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "ignore_eos": True,
        "model": "m",
        "user": "s1",
    }
    words, prompt_len = completion_body((5, 6, 7), 4, None, text=True)
    sent = orjson.loads(words)
    assert prompt_len == 3 and sent["prompt"] == text_of((5, 6, 7))
    assert "model" not in sent and "user" not in sent  # left out, not sent empty


def test_failures_are_named_by_kind() -> None:
    assert failure_kind(TimeoutError()) == "timeout"
    assert failure_kind(UpstreamError("connect_failed", "refused")) == "connect"
    assert failure_kind(UpstreamError("disconnected", "reset")) == "disconnect"
    assert failure_kind(UpstreamError("bad_response", "garbled")) == "disconnect"
    assert failure_kind(UpstreamError("tls", "handshake")) == "client_error"
    assert failure_kind(ValueError("a data line that is not JSON")) == "bad_stream"


def test_a_closed_loop_needs_clients_time_and_prompts() -> None:
    prompts = [Prompt((5, 6), 1)]
    for concurrency, seconds, given in [(0, 1.0, prompts), (1, 0.0, prompts), (1, 1.0, [])]:
        with pytest.raises(ValueError, match="closed_loop needs"):
            asyncio.run(closed_loop("http://127.0.0.1:1", given, concurrency=concurrency, duration_s=seconds))
