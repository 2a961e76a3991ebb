"""A scenario's result: requests counted as succeeded, refused the specified way (429 with
Retry-After) or failed; passed only with checks, all of them held, and no error."""

from __future__ import annotations

from bench.chaos_scenarios import ScenarioResult, _served_by
from bench.chaos_traffic import Outcome


def test_outcomes_are_counted_by_what_they_were() -> None:
    result = ScenarioResult("s", max_latency_s=0.5)
    result.count(
        [
            Outcome(0.0, 0.1, 200, "w0"),
            Outcome(0.0, 0.2, 429, retry_after="1"),
            Outcome(0.0, 0.3, 429),  # no Retry-After: not the specified refusal
            Outcome(0.0, 2.0, 0, error="ConnectError"),
            Outcome(0.0, 0.1, 503),
        ]
    )
    assert (result.requests, result.succeeded, result.refused, result.failed) == (5, 1, 1, 3)
    assert result.max_latency_s == 2.0
    result.count([Outcome(0.0, 0.1, 200)])
    assert result.requests == 6 and result.succeeded == 2 and result.max_latency_s == 2.0


def test_a_result_passes_only_with_every_check_held_and_no_error() -> None:
    assert not ScenarioResult("s").passed  # no checks: nothing was shown
    assert ScenarioResult("s", checks={"a": True, "b": True}).passed
    assert not ScenarioResult("s", checks={"a": True, "b": False}).passed
    broken = ScenarioResult("s", checks={"a": True}, error="RuntimeError: boom")
    assert not broken.passed and broken.to_json()["passed"] is False
    assert ScenarioResult("s", checks={"a": True}).to_json()["passed"] is True


def test_served_by_names_the_replicas_that_answered() -> None:
    outcomes = [Outcome(0.0, 0.1, 200, "w0"), Outcome(0.0, 0.1, 200, "w1"), Outcome(0.0, 0.1, 0)]
    assert _served_by(outcomes) == {"w0", "w1"}
