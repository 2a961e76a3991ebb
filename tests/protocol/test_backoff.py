"""Retry delays shared by the gateway's followers and the worker's Redis tasks: doubling to a bound,
reset by a success, and a failing flag that marks where an outage starts and ends."""

from __future__ import annotations

from protocol.backoff import RETRY_FIRST_S, RETRY_MAX_S, Backoff


def test_backoff_doubles_to_its_bound_and_a_success_resets_it() -> None:
    backoff = Backoff(first_s=0.1, most_s=0.5)
    assert [backoff.failed() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.succeeded()
    assert backoff.failed() == 0.1


def test_the_defaults_start_at_the_first_delay_and_stop_at_the_bound() -> None:
    backoff = Backoff()
    assert backoff.failed() == RETRY_FIRST_S
    assert max(backoff.failed() for _ in range(20)) == RETRY_MAX_S


def test_failing_is_set_by_a_failure_and_cleared_by_a_success() -> None:
    backoff = Backoff()
    assert not backoff.failing, "a fresh backoff is no outage"
    backoff.failed()
    assert backoff.failing
    backoff.failed()
    assert backoff.failing, "still the same outage"
    backoff.succeeded()
    assert not backoff.failing
