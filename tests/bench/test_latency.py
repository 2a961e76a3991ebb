"""Latency measures and both goodputs: the targets per request, refusals counted against them."""

from __future__ import annotations

import pytest

from bench.latency import RequestLatency, Slo, summarize

SLO = Slo(ttft_s=2.0, itl_s=0.05, stall_s=0.25)


def test_a_request_meets_the_slo_only_within_both_targets() -> None:
    assert RequestLatency(2.0, 0.05, 0.05).meets(SLO)
    assert not RequestLatency(2.01, 0.01, 0.01).meets(SLO)
    assert not RequestLatency(0.1, 0.051, 0.051).meets(SLO)
    # One token: no gap to miss.
    assert RequestLatency(1.0, None, None).meets(SLO)


def test_a_stream_with_one_freeze_is_goodput_but_not_stall_free() -> None:
    # 500 tokens 30 ms apart but for one 2 s freeze: a mean of 34 ms, within the mean-ITL target.
    frozen = RequestLatency(0.5, (498 * 0.03 + 2.0) / 499, 2.0)
    assert frozen.meets(SLO) and not frozen.stall_free(SLO)
    assert RequestLatency(0.5, 0.03, 0.25).stall_free(SLO)
    # Slow but even: no freeze, yet too slow for goodput.
    slow = RequestLatency(0.5, 0.08, 0.09)
    assert slow.stall_free(SLO) and not slow.meets(SLO)
    assert not RequestLatency(2.5, 0.01, 0.01).stall_free(SLO)
    assert RequestLatency(1.0, None, None).stall_free(SLO)


def test_goodput_counts_refused_requests_against_the_share() -> None:
    latencies = [
        RequestLatency(0.5, 0.02, 0.03),
        RequestLatency(3.0, 0.02, 0.03),  # late start
        RequestLatency(0.5, 0.08, 0.1),  # slow stream
        RequestLatency(0.5, 0.04, 0.6),  # a freeze
        RequestLatency(1.0, None, None),
    ]
    summary = summarize(latencies, [0.02, 0.02, 0.08, 0.04], requests=6, span_s=4.0, slo=SLO)
    assert summary.completed == 5 and summary.requests == 6
    assert summary.goodput_share == pytest.approx(3 / 6)
    assert summary.goodput_rps == pytest.approx(3 / 4.0)
    assert summary.stall_free_share == pytest.approx(3 / 6)
    assert summary.stall_free_rps == pytest.approx(3 / 4.0)
    assert summary.ttft_mean_s == pytest.approx(5.5 / 5)
    assert summary.request_itl_mean_s == pytest.approx(0.04)
    assert summary.itl_mean_s == pytest.approx(0.04)


def test_itl_p99_is_over_every_gap_and_sees_a_stall_the_means_hide() -> None:
    gaps = [0.01] * 98 + [0.5, 0.5]
    summary = summarize([RequestLatency(0.1, sum(gaps) / 100, 0.5)], gaps, requests=1, span_s=1.0, slo=SLO)
    assert summary.itl_mean_s < 0.05 and summary.goodput_share == 1.0
    assert summary.itl_p99_s > 0.4 and summary.stall_free_share == 0.0


def test_transfer_and_room_wait_shares_are_of_the_summed_ttft_and_bytes_add_up() -> None:
    latencies = [
        RequestLatency(1.0, 0.02, 0.02, 0.1, 3 * 10**9, reserve_wait_s=0.4),
        RequestLatency(3.0, 0.02, 0.02),
    ]
    summary = summarize(latencies, [], requests=2, span_s=10.0, slo=SLO)
    assert summary.transfer_share == pytest.approx(0.1 / 4.0)
    assert summary.reserve_wait_share == pytest.approx(0.4 / 4.0)
    assert summary.transferred_gb == pytest.approx(3.0)


def test_an_empty_run_summarises_to_zeros() -> None:
    summary = summarize([], [], requests=0, span_s=0.0, slo=SLO)
    assert summary.goodput_share == summary.goodput_rps == summary.itl_p99_s == 0.0
    assert summary.stall_free_share == summary.stall_free_rps == summary.reserve_wait_share == 0.0


@pytest.mark.parametrize("targets", [{"ttft_s": 0.0}, {"itl_s": -0.01}, {"stall_s": 0.0}])
def test_slo_targets_must_be_positive(targets: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="positive"):
        Slo(**targets)
