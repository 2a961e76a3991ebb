"""The cost model: what a chunk contributes, monotonic in every input, additive as its docstring says."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.engine.batch import ScheduledChunk
from workers.engine.sampling_params import SamplingParams
from workers.sim.cost_model import CostModel, StepShape, chunk_shape, step_shape

MODEL = CostModel(
    step_s=2e-3, sample_s=1e-5, token_s=3e-5, weights_s=6e-3, attn_pair_s=1.5e-9, kv_token_s=5e-8
)

shapes = st.builds(
    StepShape,
    prefill_tokens=st.integers(0, 10_000),
    prefill_attn_pairs=st.integers(0, 10**8),
    decode_seqs=st.integers(0, 512),
    decode_kv_tokens=st.integers(0, 10**6),
    sampled=st.integers(0, 512),
)
FIELDS = [f.name for f in dataclasses.fields(StepShape)]


@st.composite
def steps(draw: st.DrawFn) -> StepShape:
    """The shape of a step the scheduler could run: one or more real chunks."""
    chunks = draw(st.lists(st.tuples(st.integers(0, 8000), st.integers(1, 2048), st.booleans()), min_size=1))
    total = StepShape()
    for start, n, sample in chunks:
        total += chunk_shape(start, n, sample)
    return total


def chunk(seq_id: int, start: int, n: int, sample: bool = True) -> ScheduledChunk:
    return ScheduledChunk(seq_id, [1] * n, start, [], sample, SamplingParams())


def test_a_prefill_chunk_counts_its_causal_pairs() -> None:
    # 3 queries at positions 10, 11, 12 see 11, 12 and 13 keys.
    assert chunk_shape(10, 3, sample=False) == StepShape(prefill_tokens=3, prefill_attn_pairs=36)
    assert chunk_shape(0, 4).prefill_attn_pairs == 1 + 2 + 3 + 4


def test_a_one_token_chunk_is_a_decode_reading_its_context() -> None:
    assert chunk_shape(99, 1) == StepShape(decode_seqs=1, decode_kv_tokens=100, sampled=1)


def test_step_shape_sums_its_chunks() -> None:
    chunks = [chunk(0, 0, 8, sample=False), chunk(1, 50, 1), chunk(2, 20, 1)]
    assert step_shape(chunks) == StepShape(
        prefill_tokens=8, prefill_attn_pairs=36, decode_seqs=2, decode_kv_tokens=72, sampled=2
    )
    assert MODEL.step_time(chunks) == MODEL.time(step_shape(chunks))


def test_the_form_term_by_term() -> None:
    shape = StepShape(
        prefill_tokens=500, prefill_attn_pairs=10**6, decode_seqs=100, decode_kv_tokens=10**5, sampled=101
    )
    expected = 2e-3 + 101 * 1e-5 + 600 * 3e-5 + 10**6 * 1.5e-9 + 10**5 * 5e-8
    assert MODEL.time(shape) == pytest.approx(expected)


def test_below_the_ridge_the_weights_floor_prices_the_dense_layers() -> None:
    assert MODEL.ridge_tokens == pytest.approx(200)
    one, many = StepShape(decode_seqs=1), StepShape(decode_seqs=150)
    # 150 decodes stream the weights once, as one does, and their FLOPs hide under that.
    assert MODEL.time(many) == MODEL.time(one)
    assert MODEL.time(StepShape(decode_seqs=400)) - MODEL.time(StepShape(decode_seqs=300)) == pytest.approx(
        100 * 3e-5
    )


def test_an_empty_step_costs_nothing() -> None:
    assert MODEL.time(StepShape()) == 0.0
    assert MODEL.step_time([]) == 0.0


@given(shapes, st.sampled_from(FIELDS), st.integers(1, 10_000))
def test_monotonic_in_every_input(shape: StepShape, field: str, more: int) -> None:
    bigger = dataclasses.replace(shape, **{field: getattr(shape, field) + more})
    assert MODEL.time(bigger) >= MODEL.time(shape)


@given(steps(), steps())
def test_additive_above_the_weight_floor(a: StepShape, b: StepShape) -> None:
    """Two steps merged cost their sum less one step overhead, once each is past the ridge."""
    floor = StepShape(prefill_tokens=int(MODEL.ridge_tokens) + 1)
    a, b = a + floor, b + floor
    assert MODEL.time(a + b) == pytest.approx(MODEL.time(a) + MODEL.time(b) - MODEL.step_s)


@given(steps(), steps())
def test_merging_steps_never_costs_more_than_running_them_apart(a: StepShape, b: StepShape) -> None:
    assert MODEL.time(a + b) <= MODEL.time(a) + MODEL.time(b) + 1e-12


def test_invalid_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        chunk_shape(0, 0)
    with pytest.raises(ValueError):
        StepShape(decode_seqs=-1)
    with pytest.raises(ValueError):
        dataclasses.replace(MODEL, kv_token_s=float("nan"))
