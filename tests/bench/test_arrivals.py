"""The replay's open-loop workloads: shared-prefix prompts and their Poisson arrivals, a pure function
of the seed; a trace's requests at their own times or a rate's; and arrivals as sessions of one turn."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.arrivals import (
    Arrival,
    Prompt,
    arrival_sessions,
    poisson_times,
    shared_prefix_arrivals,
    shared_prefix_workload,
    trace_arrivals,
    trace_prompt,
)
from bench.trace import TraceRequest, load_trace, prompt_tokens, write_conversation_trace
from bench.workloads import TOKEN_HIGH, TOKEN_LOW


def test_shared_prefix_workload_is_a_function_of_the_seed() -> None:
    workload = shared_prefix_workload(3, 5, 40, 7, 11, seed=1)
    assert workload == shared_prefix_workload(3, 5, 40, 7, 11, seed=1)
    assert workload != shared_prefix_workload(3, 5, 40, 7, 11, seed=2)
    assert len(workload) == 15 and {p.max_tokens for p in workload} == {11}
    assert all(
        len(p.token_ids) == 47 and TOKEN_LOW <= min(p.token_ids) < max(p.token_ids) < TOKEN_HIGH
        for p in workload
    )
    systems = [{p.token_ids[:40] for p in workload[g * 5 : (g + 1) * 5]} for g in range(3)]
    assert all(len(s) == 1 for s in systems) and len(set.union(*systems)) == 3
    assert len({p.token_ids[40:] for p in workload}) == 15
    # More groups leave the existing ones as they were.
    assert shared_prefix_workload(4, 5, 40, 7, 11, seed=1)[:15] == workload

    arrivals = shared_prefix_arrivals(workload, rate=50, duration_s=10, seed=4)
    assert arrivals == shared_prefix_arrivals(workload, rate=50, duration_s=10, seed=4)
    times = [a.at_s for a in arrivals]
    assert times == sorted(times) and times[0] > 0 and times[-1] < 10
    assert 400 < len(arrivals) < 600  # Poisson: 500 expected, sd 22
    assert {a.prompt for a in arrivals} == set(workload)


def test_trace_arrivals_follow_the_trace_or_the_rate(tmp_path: Path) -> None:
    trace = load_trace(write_conversation_trace(tmp_path / "t.jsonl", conversations=10), speed=2)
    own = trace_arrivals(trace, duration_s=15, max_prompt_tokens=1000)
    assert [a.at_s for a in own] == [r.arrival_s - trace[0].arrival_s for r in trace[: len(own)]]
    assert 0 < len(own) < len(trace) and own[-1].at_s < 15
    assert max(len(a.prompt.token_ids) for a in own) == 1000
    assert [a.prompt.max_tokens for a in own] == [r.output_length for r in trace[: len(own)]]
    paced = trace_arrivals(trace, duration_s=1, rate=20, max_prompt_tokens=1000)
    assert [a.prompt for a in paced] == [a.prompt for a in own[: len(paced)]]
    assert paced[-1].at_s < 1


def test_poisson_times_are_a_function_of_the_generator_and_stay_within_the_duration() -> None:
    times = poisson_times(100, 2.0, np.random.default_rng(7))
    assert times == poisson_times(100, 2.0, np.random.default_rng(7))
    assert times == sorted(times) and times[0] > 0 and times[-1] < 2.0
    assert 150 < len(times) < 250  # 200 expected, sd 14
    for rate in (0, -1):
        with pytest.raises(ValueError, match="rate must be positive"):
            poisson_times(rate, 1.0, np.random.default_rng(0))


def test_shared_prefix_workload_refuses_shapes_without_a_prompt() -> None:
    for shape in [(0, 1, 4, 4, 1), (1, 0, 4, 4, 1), (1, 1, 4, 4, 0), (1, 1, -1, 4, 1), (1, 1, 4, -1, 1)]:
        with pytest.raises(ValueError, match="must be >= 1"):
            shared_prefix_workload(*shape)
    with pytest.raises(ValueError, match="at least one token"):
        shared_prefix_workload(1, 1, 0, 0, 1)
    # No question: every prompt of a group is its system prompt.
    assert len(set(shared_prefix_workload(1, 3, 8, 0, 2))) == 1


def test_trace_prompts_are_cut_to_fit_and_ask_for_at_least_one_token() -> None:
    request = TraceRequest(arrival_s=0.0, input_length=1000, output_length=0, hash_ids=(1, 2))
    prompt = trace_prompt(request, 32000, 600)
    assert prompt == Prompt(tuple(prompt_tokens(request, 32000)[:600]), 1)
    assert len(trace_prompt(request, 32000, 4000).token_ids) == 1000
    assert trace_arrivals([], duration_s=10) == []


def test_arrivals_are_sessions_of_one_turn_each_at_their_time() -> None:
    arrivals = [Arrival(0.5, Prompt((5, 6, 7), 3)), Arrival(1.25, Prompt((8,), 1))]
    sessions = arrival_sessions(arrivals)
    assert [s.start_s for s in sessions] == [0.5, 1.25]
    assert [[(t.prompt, t.max_tokens, t.think_s) for t in s.turns] for s in sessions] == [
        [((5, 6, 7), 3, 0.0)],
        [((8,), 1, 0.0)],
    ]
    assert {s.key for s in sessions} == {""}  # no session affinity to ask for
