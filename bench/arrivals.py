"""Open-loop workloads for the replay: prompts of token ids and when each is due, built from a seed
(shared-prefix groups at Poisson times) or from a trace, and arrivals as sessions of one turn, the
form the load generator sends. Pure functions of their arguments, so two runs with one seed send
byte-identical prompts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.trace import TraceRequest, prompt_tokens
from bench.workloads import TOKEN_HIGH, TOKEN_LOW, Session, Turn


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float  # seconds after the replay starts
    prompt: Prompt


def shared_prefix_workload(
    groups: int, prompts: int, system_len: int, question_len: int, output_len: int, seed: int = 0
) -> list[Prompt]:
    """`groups` x `prompts` distinct prompts, group by group: each group's system prompt followed by
    one of its questions. A group's tokens depend only on (seed, group), so adding groups keeps the
    existing ones and two runs with one seed send byte-identical prompts."""
    if min(groups, prompts, output_len) < 1 or min(system_len, question_len) < 0:
        raise ValueError("groups, prompts and output_len must be >= 1, system_len and question_len >= 0")
    if system_len + question_len < 1:
        raise ValueError("a prompt needs at least one token: system_len + question_len must be >= 1")
    workload = []
    for group in range(groups):
        rng = np.random.default_rng([seed, group])
        system = rng.integers(TOKEN_LOW, TOKEN_HIGH, system_len).tolist()
        for _ in range(prompts):
            question = rng.integers(TOKEN_LOW, TOKEN_HIGH, question_len).tolist()
            workload.append(Prompt(tuple(system + question), output_len))
    return workload


def poisson_times(rate: float, duration_s: float, rng: np.random.Generator) -> list[float]:
    """Send times of a Poisson process at `rate` per second, within [0, duration_s)."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    times = []
    t = rng.exponential(1 / rate)
    while t < duration_s:
        times.append(float(t))
        t += rng.exponential(1 / rate)
    return times


def shared_prefix_arrivals(
    prompts: Sequence[Prompt], rate: float, duration_s: float, seed: int = 0
) -> list[Arrival]:
    """Poisson arrivals, each asking a (group, question) pair drawn uniformly at random."""
    rng = np.random.default_rng(seed)
    times = poisson_times(rate, duration_s, rng)
    picks = rng.integers(len(prompts), size=len(times))
    return [Arrival(t, prompts[i]) for t, i in zip(times, picks, strict=True)]


def trace_prompt(request: TraceRequest, vocab_size: int, max_prompt_tokens: int) -> Prompt:
    """The request's expanded tokens, cut so that a small (CPU, simulated) worker can hold them."""
    return Prompt(
        tuple(prompt_tokens(request, vocab_size)[:max_prompt_tokens]), max(request.output_length, 1)
    )


def trace_arrivals(
    trace: Sequence[TraceRequest],
    duration_s: float,
    *,
    rate: float | None = None,
    seed: int = 0,
    vocab_size: int = 32000,
    max_prompt_tokens: int = 4000,
) -> list[Arrival]:
    """The trace's requests in order, at their own times relative to the first (load_trace has applied
    the speed) or, given a rate, at Poisson times; only those due within `duration_s` are expanded."""
    if not trace:
        return []
    if rate is None:
        times = [r.arrival_s - trace[0].arrival_s for r in trace]
    else:
        times = poisson_times(rate, duration_s, np.random.default_rng(seed))
    return [
        Arrival(t, trace_prompt(r, vocab_size, max_prompt_tokens))
        for t, r in zip(times, trace, strict=False)
        if t < duration_s
    ]


def arrival_sessions(arrivals: Sequence[Arrival]) -> list[Session]:
    """Open-loop arrivals as sessions of one turn each."""
    return [Session(a.at_s, (Turn(a.prompt.token_ids, a.prompt.max_tokens),)) for a in arrivals]
