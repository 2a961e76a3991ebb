"""bench vllm's pure parts: a row's rounds read as one (the servers themselves are
tests/gateway/test_real_vllm.py's)."""

from __future__ import annotations

import argparse

import pytest

from bench.replay_result import ReplayResult, RequestRecord
from bench.vllm_bench import ROUTERS, _chosen, _speed, row_summary
from bench.vllm_fleet import ServerCounters, VllmServer

SERVERS = [VllmServer(i, 8000 + i, f"ipc:///tmp/e{i}", f"tcp://127.0.0.1:{9000 + i}") for i in range(2)]


def _replay(ttfts: list[float], replica: str) -> ReplayResult:
    records = [RequestRecord(t, (), t, 100, 50, 1, replica, s, 0) for s, t in enumerate(ttfts)]
    return ReplayResult("u", len(records), 10.0, records)


def test_a_rows_rounds_pool_their_requests_and_sum_the_servers_counters() -> None:
    rounds = [
        (_replay([1.0, 3.0], "vllm0"), [ServerCounters(2, 200, 200, 100), ServerCounters(0, 0, 0, 0)]),
        (_replay([2.0], "vllm1"), [ServerCounters(0, 0, 0, 0), ServerCounters(1, 100, 100, 80)]),
    ]
    row = row_summary(ROUTERS[0], SERVERS, rounds)
    assert row["ttft_s"]["mean"] == pytest.approx(2.0) and row["completed"] == 3
    assert [r["ttft_mean_s"] for r in row["rounds"]] == [pytest.approx(2.0), pytest.approx(2.0)]
    assert row["servers"]["vllm0"]["requests"] == 2 and row["servers"]["vllm1"]["hit_rate"] == pytest.approx(
        0.8
    )
    assert row["vllm_hit_rate"] == pytest.approx(180 / 300)
    assert row["imbalance"] == pytest.approx(2 * 2 / 3)


def test_rounds_below_one_are_refused() -> None:
    args = argparse.Namespace(workloads="agent", routers=None, rounds=0)
    with pytest.raises(SystemExit, match="--rounds"):
        _chosen(args)


def test_speed_is_auto_or_a_positive_finite_number() -> None:
    assert _speed("auto") is None and _speed("0.25") == 0.25
    for bad in ("0", "-1", "nan", "inf", "fast", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="positive number or auto"):
            _speed(bad)
