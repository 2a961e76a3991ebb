"""What both benches read from the same flags: `--prefix-aware` knobs and `--workload`'s sessions, with
--sessions, --rate, --duration, --limit and --speed applied as each workload reads them."""

from __future__ import annotations

import argparse

import pytest

from bench.shared_flags import generated_sessions, prefix_aware_knob
from bench.workloads import GroupedParams, LongMixParams, grouped_sessions, longmix_sessions, scaled


def _flags(workload: str, **given: object) -> argparse.Namespace:
    flags = {"seed": 0, "sessions": None, "duration": None, "rate": None, "limit": None, "speed": 1.0}
    return argparse.Namespace(workload=workload, **{**flags, **given})


def test_prefix_aware_knobs_are_a_key_and_a_number() -> None:
    assert prefix_aware_knob("recompute_penalty=2") == ("recompute_penalty", 2.0)
    assert prefix_aware_knob(" load_weight = 0.5") == ("load_weight", 0.5)
    for text in ("recompute_penalty", "recompute_penalty=high", "=x"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected KEY=NUMBER"):
            prefix_aware_knob(text)


def test_agent_flags_set_the_sessions_and_their_start_window() -> None:
    sessions, params = generated_sessions(_flags("agent", seed=3, sessions=5, duration=2.0))
    assert (params["seed"], params["sessions"], params["start_window_s"]) == (3, 5, 2.0)
    assert len(sessions) == 5 and all(s.start_s < 2.0 for s in sessions)
    limited, _ = generated_sessions(_flags("agent", seed=3, sessions=5, duration=2.0, limit=2, speed=2.0))
    assert limited == scaled(sessions[:2], 2.0)


def test_grouped_and_longmix_flags_set_the_rate_and_leave_out_prompts_due_after_the_duration() -> None:
    sessions, params = generated_sessions(_flags("grouped", rate=50.0, duration=1.0))
    assert params["rate"] == 50.0
    everything = grouped_sessions(GroupedParams(rate=50.0))
    assert sessions == [s for s in everything if s.start_s < 1.0] and len(sessions) < len(everything)
    mix, params = generated_sessions(_flags("longmix", sessions=7, rate=3.0, seed=1))
    assert (params["requests"], params["rate"], params["seed"]) == (7, 3.0, 1)
    assert mix == longmix_sessions(LongMixParams(seed=1, rate=3.0, requests=7))
