"""SimRunner: ModelRunner's contract with synthetic tokens, and time on either clock."""

from __future__ import annotations

import time
from typing import Any

import pytest

from workers.engine.batch import ScheduledChunk
from workers.engine.sampling_params import SamplingParams
from workers.sim.cost_model import CostModel
from workers.sim.runner import RealClock, SimRunner, VirtualClock, synthetic_token

COST = CostModel(step_s=0.01, sample_s=0.0, token_s=1e-4, weights_s=0.0, attn_pair_s=0.0, kv_token_s=0.0)
EOS = (2, 0)


def chunk(
    seq_id: int, start: int, n: int, sample: bool, generated: int = 0, **sampling: Any
) -> ScheduledChunk:
    return ScheduledChunk(seq_id, [7] * n, start, [], sample, SamplingParams(**sampling), generated)


def runner(**kwargs: Any) -> SimRunner:
    return SimRunner(COST, vocab_size=100, eos_token_ids=EOS, clock=VirtualClock(), **kwargs)


def test_one_token_per_sampling_chunk_in_chunk_order() -> None:
    chunks = [chunk(3, 0, 64, False), chunk(1, 40, 1, True, 5), chunk(9, 64, 30, True), chunk(4, 0, 1, True)]
    outputs = runner().execute(chunks)
    assert [o.seq_id for o in outputs] == [1, 9, 4]
    assert all(0 <= o.token_id < 100 for o in outputs)
    assert all(o.logprob is None and o.top_logprobs is None for o in outputs)
    assert runner().execute([chunk(3, 0, 64, False)]) == []


def test_forks_sample_right_after_their_chunk_as_sequences_of_their_own() -> None:
    forks = ((5, SamplingParams()), (6, SamplingParams(logprobs=1)))
    forked = ScheduledChunk(1, [7] * 12, 0, [], True, SamplingParams(), 0, forks=forks)
    outputs = runner().execute([chunk(3, 0, 4, True), forked, chunk(4, 0, 1, True)])
    assert [o.seq_id for o in outputs] == [3, 1, 5, 6, 4]
    assert outputs[2] == runner().execute([chunk(5, 0, 12, True)])[0]
    assert (outputs[3].logprob, outputs[3].top_logprobs) == (0.0, [(outputs[3].token_id, 0.0)])


def test_tokens_depend_on_the_sequence_and_its_progress_only() -> None:
    a = runner().execute([chunk(1, 40, 1, True, 5)])
    b = runner().execute([chunk(8, 0, 12, True), chunk(1, 40, 1, True, 5)])[1:]
    assert a == b
    many = [chunk(s, 40, 1, True, 5) for s in range(20)]
    assert runner(seed=1).execute(many) != runner(seed=0).execute(many)
    stream = [runner().execute([chunk(1, 40 + i, 1, True, i)])[0].token_id for i in range(50)]
    assert len(set(stream)) > 30


def test_no_eos_and_no_stop_token_unless_asked() -> None:
    stop = (5, 6, 7)
    tokens = {synthetic_token(0, s, g, 10, excluded=(*EOS, *stop)) for s in range(50) for g in range(20)}
    assert tokens == {1, 3, 4, 8, 9}
    outputs = runner().execute([chunk(s, 0, 3, True, stop_token_ids=stop) for s in range(300)])
    assert not {o.token_id for o in outputs} & {*EOS, *stop}


def test_an_eos_rate_ends_about_that_share_of_tokens() -> None:
    outputs = runner(eos_probability=0.25).execute([chunk(s, 0, 2, True) for s in range(2000)])
    eos = sum(o.token_id == EOS[0] for o in outputs)
    assert 400 < eos < 600
    with pytest.raises(ValueError):
        SimRunner(COST, vocab_size=100, eos_probability=0.1)


def test_logprobs_when_asked() -> None:
    (out,) = runner().execute([chunk(1, 0, 4, True, logprobs=3)])
    assert out.logprob == 0.0
    assert out.top_logprobs == [(out.token_id, 0.0)]
    (none,) = runner().execute([chunk(1, 0, 4, True, logprobs=0)])
    assert none.top_logprobs == []


def test_virtual_time_counts_the_step_and_does_not_sleep() -> None:
    sim = runner()
    chunks = [chunk(1, 0, 1000, True)]
    start = time.perf_counter()
    for _ in range(100):
        sim.execute(chunks)
    assert time.perf_counter() - start < 0.5
    assert sim.last_step_time == pytest.approx(0.11)
    assert sim.clock.now() == pytest.approx(11.0)
    clock = VirtualClock(5.0)
    clock.advance_to(3.0)
    assert clock.now() == 5.0
    clock.advance_to(7.5)
    assert clock.now() == 7.5


def test_real_time_sleeps_the_step() -> None:
    sim = SimRunner(COST, vocab_size=100, clock=RealClock())
    start = time.monotonic()
    sim.execute([chunk(1, 0, 200, True)])
    assert 0.03 <= time.monotonic() - start < 0.5
    assert sim.step_time([chunk(1, 0, 200, True)]) == pytest.approx(0.03)
