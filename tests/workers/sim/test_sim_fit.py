"""Fitting: exact non-negative least squares, and a cost model recovered from its own predictions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from workers.sim.cost_model import CostModel, StepShape, chunk_shape
from workers.sim.fit import fit_cost_model, nnls


def grid() -> list[StepShape]:
    prefill = [chunk_shape(p, q) for q in (16, 64, 256) for p in (0, 512, 2048)]
    decode = []
    for n in (1, 8, 64, 256):
        for ctx in (32, 1024):
            total = StepShape()
            for _ in range(n):
                total += chunk_shape(ctx, 1)
            decode.append(total)
    return prefill + decode


def test_nnls_matches_least_squares_when_that_is_non_negative() -> None:
    rng = np.random.default_rng(0)
    a = rng.random((20, 4))
    x = np.array([1.0, 2.0, 0.5, 3.0])
    assert nnls(a, a @ x) == pytest.approx(x)


def test_nnls_clamps_a_coefficient_that_least_squares_would_make_negative() -> None:
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b = np.array([1.0, -1.0, 0.0])
    # Unconstrained: x = (1, -1). With x >= 0, the best is x2 = 0 and x1 = mean(1, 0).
    assert nnls(a, b) == pytest.approx([0.5, 0.0])


@pytest.mark.parametrize("weights_s", [0.0, 64 * 3e-5])
def test_a_model_is_recovered_from_its_own_predictions(weights_s: float) -> None:
    truth = CostModel(
        step_s=2e-3, sample_s=1e-5, token_s=3e-5, weights_s=weights_s, attn_pair_s=1.5e-9, kv_token_s=5e-8
    )
    shapes = grid()
    fit = fit_cost_model(shapes, [truth.time(s) for s in shapes])
    assert fit.rms_error < 1e-9
    for field in dataclasses.fields(CostModel):
        expected = getattr(truth, field.name)
        if field.name == "weights_s" and weights_s == 0.0:
            # No floor is the same model as a floor of one token's worth, the smallest ridge tried.
            expected = truth.token_s
        assert getattr(fit.model, field.name) == pytest.approx(expected, rel=1e-6, abs=1e-15)


def test_noise_shows_in_the_errors_but_the_coefficients_stay_close() -> None:
    truth = CostModel(
        step_s=0.06, sample_s=2e-3, token_s=7e-3, weights_s=7e-3, attn_pair_s=5e-6, kv_token_s=2.5e-5
    )
    shapes = grid()
    noise = np.random.default_rng(1).normal(1.0, 0.05, len(shapes))
    fit = fit_cost_model(shapes, [truth.time(s) * k for s, k in zip(shapes, noise, strict=True)])
    assert 0.01 < fit.rms_error < 0.1
    assert fit.max_error >= fit.rms_error
    assert fit.model.token_s == pytest.approx(truth.token_s, rel=0.1)
    assert fit.model.kv_token_s == pytest.approx(truth.kv_token_s, rel=0.25)


def test_too_few_samples_are_refused() -> None:
    with pytest.raises(ValueError):
        fit_cost_model(grid()[:4], [1.0] * 4)
