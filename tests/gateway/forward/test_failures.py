"""What a client is told when its replicas fail: a refusal with its Retry-After over a 5xx, 504 for a
timeout, 502 otherwise; and why no replica could take it at all."""

from __future__ import annotations

import orjson

from gateway.forward.failures import Failures, refusal, stream_error, unavailable
from gateway.forward.upstream import UpstreamError
from gateway.gateway_config import Limits
from protocol.openai_responses import SSE_DONE
from tests.support.replicas import MODEL, replica


def test_a_refusal_is_the_answer_over_later_failures() -> None:
    failures = Failures(last="replica b could not be reached", kind="error", refusal=refusal(429, {}, MODEL))
    answer = failures.answer(MODEL, Limits())
    assert (answer.status, answer.code, answer.headers) == (429, "queue_full", {"Retry-After": "1"})
    assert refusal(503, {"Retry-After": "7"}, MODEL).headers == {"Retry-After": "7"}


def test_a_timeout_is_504_and_names_the_limits_and_anything_else_is_502() -> None:
    timed_out = Failures(last="replica a failed before its first output", kind="timeout")
    answer = timed_out.answer(MODEL, Limits(request_timeout_s=12))
    assert answer.status == 504
    assert "request_timeout_s 12" in answer.message and "replica a" in answer.message
    answer = Failures(last="replica a could not be reached", kind="error").answer(MODEL, Limits())
    assert (answer.status, answer.code) == (502, "upstream_unavailable")


def test_why_no_replica_can_take_the_request() -> None:
    prefill = replica("p", role="prefill")
    assert "prefill replicas (p)" in unavailable([prefill], MODEL)
    sglang_decode = replica("d", role="decode", kind="openai", pd_protocol="sglang")
    assert "need a prefill replica" in unavailable([sglang_decode], MODEL)
    assert "no healthy replica" in unavailable([], MODEL)


def test_a_stream_no_replica_could_finish_ends_with_an_error_event_then_done() -> None:
    event, status = stream_error("a", TimeoutError(), request_timeout_s=30)
    assert status == 504 and event.endswith(SSE_DONE)
    error = orjson.loads(event.removeprefix(b"data: ").split(b"\n\n")[0])["error"]
    assert error["code"] == "upstream_timeout" and "30 s" in error["message"]
    event, status = stream_error("a", UpstreamError("reset", "connection reset"), request_timeout_s=30)
    assert status == 502 and b"upstream_failed" in event
