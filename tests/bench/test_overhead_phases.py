"""The pure parts of `bench overhead`'s measurements: the routing-decision histogram's quantiles and
change, the schedule cut into windows, the highest rate sustained, and the zero-cost worker profile."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from bench.overhead_phases import _windows, decision_stats, histogram_quantile, instant_profile, sustained
from workers.sim.profiles import get_profile


def test_histogram_quantile_interpolates_within_the_bucket() -> None:
    buckets = {0.001: 10.0, 0.002: 30.0, 0.004: 40.0, math.inf: 40.0}
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.001)
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.0015)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.002 + 0.002 * 9.6 / 10)
    assert histogram_quantile(0.5, {0.001: 0.0, math.inf: 0.0}) is None
    # Beyond the last finite bound: that bound, as Prometheus answers.
    assert histogram_quantile(0.99, {0.001: 1.0, math.inf: 10.0}) == 0.001


def test_decision_stats_are_of_the_change_between_two_scrapes() -> None:
    before = {0.001: 100.0, 0.002: 100.0, math.inf: 100.0}
    after = {0.001: 100.0, 0.002: 110.0, math.inf: 110.0}
    stats = decision_stats(before, after)
    assert stats["count"] == 10.0
    # All ten new decisions fell between 1 and 2 ms: the old ones, all under 1 ms, do not count.
    assert 0.001 < (stats["p50"] or 0) <= 0.002
    assert decision_stats({}, {}) == {"count": 0.0, "p50": None, "p99": None}


def test_the_schedule_is_cut_into_windows_the_last_taking_the_rest() -> None:
    times = [0.1, 0.9, 1.0, 2.5, 3.0, 3.2]
    assert _windows(times, 1.0, 3.0) == [[0, 1], [2], [3, 4, 5]]
    assert _windows([], 1.0, 0.0) == [[]]


def test_the_sustained_rate_is_the_highest_with_under_1_percent_errors() -> None:
    rows = [
        {"target": "gateway", "req_s": 100.0, "error_rate": 0.0},
        {"target": "gateway", "req_s": 300.0, "error_rate": 0.05},
        {"target": "gateway", "req_s": 200.0, "error_rate": 0.009},
        {"target": "direct", "req_s": 500.0, "error_rate": 0.0},
    ]
    assert sustained(rows, "gateway") == 200.0 and sustained(rows, "direct") == 500.0
    assert sustained(rows[1:2], "gateway") is None


def test_the_instant_profile_keeps_the_limits_and_costs_nothing(tmp_path: Path) -> None:
    base, instant = get_profile("h100-8b"), get_profile(str(instant_profile(tmp_path)))
    assert instant.name == "h100-8b-instant" and instant.num_blocks == base.num_blocks
    assert instant.max_num_seqs == base.max_num_seqs
    assert dataclasses.astuple(instant.cost) == (0.0,) * 6 and any(dataclasses.astuple(base.cost))
