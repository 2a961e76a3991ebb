"""What a replay measured: moved turns, the predicted TTFT against the one seen, latency statistics and
the summary a run reports."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from bench.replay_result import (
    ReplayResult,
    RequestRecord,
    cached_predicted,
    hit_rate_by_turn,
    latency_stats,
    moved_turns,
    pooled,
    ttft_predicted,
)


def _record(session: int | None, turn: int, replica: str) -> RequestRecord:
    return RequestRecord(0.1, (), 0.2, 10, 0, 1, replica, session, turn)


def test_moved_turns_count_later_turns_served_elsewhere_than_the_turn_before() -> None:
    records = [
        _record(0, 0, "w0"),
        _record(0, 1, "w0"),
        _record(0, 2, "w1"),  # moved
        _record(0, 3, "w1"),
        _record(1, 0, "w1"),
        _record(1, 2, "w0"),  # its turn 1 failed: nothing to compare with
        _record(1, 3, "w1"),  # moved
    ]
    assert moved_turns(records) == pytest.approx(2 / 4)
    assert moved_turns(list(reversed(records))) == pytest.approx(2 / 4)  # completion order is no matter
    assert moved_turns([_record(i, 0, f"w{i % 2}") for i in range(5)]) is None  # single turns
    assert moved_turns([_record(None, 0, "w0"), _record(None, 0, "w1")]) is None  # no sessions


def test_hit_rate_by_turn_reads_each_turn_numbers_cached_over_prompt_tokens() -> None:
    records = [
        replace(_record(0, 0, "w0"), prompt_tokens=100, cached_tokens=50),
        replace(_record(1, 0, "w1"), prompt_tokens=300, cached_tokens=50),
        replace(_record(0, 1, "w0"), prompt_tokens=200, cached_tokens=150),
        replace(_record(None, 5, "w0"), prompt_tokens=90, cached_tokens=90),  # no session: not a turn
        replace(_record(1, 2, "w1"), prompt_tokens=0, cached_tokens=0),  # nothing to read a rate from
    ]
    assert hit_rate_by_turn(records) == pytest.approx({0: 100 / 400, 1: 150 / 200})
    assert list(hit_rate_by_turn(list(reversed(records)))) == [0, 1]  # by turn, whatever the order
    assert hit_rate_by_turn([]) == {}


def test_the_predicted_ttft_is_read_against_the_ttft_seen() -> None:
    seen = [
        replace(_record(0, k, "w0"), ttft_s=t, predicted_ttft_s=p)
        for k, (t, p) in enumerate([(1, 0.5), (3, 1.5)])
    ]
    assert ttft_predicted(seen) == pytest.approx(0.5)
    assert ttft_predicted([*seen, _record(0, 9, "w1")]) == pytest.approx(0.5)  # no prediction: not counted
    assert ttft_predicted([_record(0, 0, "w0")]) is None


def test_the_predicted_cached_tokens_are_read_against_those_reported() -> None:
    seen = [
        replace(_record(0, k, "w0"), cached_tokens=c, predicted_cached_tokens=p)
        for k, (c, p) in enumerate([(100, 100), (100, 60), (0, 40), (200, 200)])
    ]
    assert cached_predicted(seen) == pytest.approx({"ratio": 400 / 400, "under": 0.25, "over": 0.25})
    exact = [seen[0], seen[3], _record(0, 9, "w1")]  # no prediction: not counted
    assert cached_predicted(exact) == pytest.approx({"ratio": 1.0, "under": 0.0, "over": 0.0})
    assert cached_predicted([seen[2]]) == {"ratio": None, "under": 0.0, "over": 1.0}  # nothing reported
    assert cached_predicted([_record(0, 0, "w0")]) is None


def test_latency_stats_are_none_when_nothing_was_measured() -> None:
    assert latency_stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    stats = latency_stats([float(v) for v in range(1, 101)])
    assert stats == pytest.approx({"mean": 50.5, "p50": 50.5, "p90": 90.1, "p99": 99.01})


def test_a_summary_reads_hits_against_prompt_tokens_and_rates_against_the_span() -> None:
    records = [
        RequestRecord(0.1, (0.01, 0.03), 0.2, 100, 40, 3, "w0", 0, 0),
        RequestRecord(0.3, (), 0.5, 100, 60, 1, "w1", 0, 1),
    ]
    summary = ReplayResult("http://x", 3, 2.0, records, Counter({"timeout": 1})).summary()
    assert (summary["sent"], summary["completed"], summary["errors"]) == (3, 2, {"timeout": 1})
    assert summary["hit_rate"] == pytest.approx(0.5)
    assert summary["requests_per_replica"] == {"w0": 1, "w1": 1}
    assert summary["moved_turns"] == 1.0 and summary["ttft_predicted"] is None
    assert summary["cached_predicted"] is None
    assert summary["hit_rate_by_turn"] == pytest.approx({0: 0.4, 1: 0.6})
    assert summary["ttft_s"]["mean"] == pytest.approx(0.2) and summary["itl_s"]["mean"] == pytest.approx(0.02)
    assert summary["throughput_req_s"] == pytest.approx(1.0) and summary["output_tok_s"] == pytest.approx(2.0)
    empty = ReplayResult("http://x", 0, 0.0).summary()
    assert (empty["completed"], empty["hit_rate"], empty["throughput_req_s"]) == (0, 0.0, 0.0)
    assert empty["moved_turns"] is None and empty["e2e_s"]["p99"] is None


def test_pooled_replays_keep_each_replays_sessions_apart() -> None:
    """Two rounds of one workload: session 0 stayed on w0 in the first and on w1 in the second; read as
    one session it would have moved."""
    first = ReplayResult("u", 3, 10.0, [_record(0, 0, "w0"), _record(0, 1, "w0")], Counter(timeout=1))
    second = ReplayResult("u", 2, 12.0, [_record(0, 0, "w1"), _record(0, 1, "w1"), _record(None, 0, "w0")])
    both = pooled([first, second])
    assert both.sent == 5 and both.elapsed_s == 22.0 and both.completed == 5
    assert both.errors == Counter(timeout=1)
    assert moved_turns(both.records) == 0.0
    assert both.summary()["requests_per_replica"] == {"w0": 3, "w1": 2}
    with pytest.raises(ValueError):
        pooled([])
