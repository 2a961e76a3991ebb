"""Fitting a CostModel to measured step times: non-negative least squares on relative error.

The model is linear in its coefficients once the ridge (the token count where the dense layers turn
from weight-bound to compute-bound) is fixed, so the fit tries a grid of ridges and solves a small
non-negative least-squares problem for each, keeping the best. Errors are relative because step
times span two orders of magnitude and a 10 ms miss matters on a 50 ms decode, not on a 5 s prefill.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from workers.sim.cost_model import CostModel, StepShape

DEFAULT_RIDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True, slots=True)
class Fit:
    model: CostModel
    # (predicted - measured) / measured for each sample fitted.
    relative_errors: tuple[float, ...]

    @property
    def rms_error(self) -> float:
        return float(np.sqrt(np.mean(np.square(self.relative_errors))))

    @property
    def max_error(self) -> float:
        return float(np.max(np.abs(self.relative_errors)))


def relative_errors(
    model: CostModel, shapes: Sequence[StepShape], times: Sequence[float]
) -> tuple[float, ...]:
    return tuple((model.time(s) - t) / t for s, t in zip(shapes, times, strict=True))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0, exactly, by trying every support.

    The optimum is the unconstrained solution on its own support, so the best feasible support
    solution is the optimum. With the five columns of a cost model that is 31 small solves; numpy
    alone suffices and there is no iteration to converge.
    """
    n = a.shape[1]
    best, best_residual = np.zeros(n), float(np.linalg.norm(b))
    for size in range(1, n + 1):
        for support in itertools.combinations(range(n), size):
            cols = list(support)
            x_support, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(x_support < 0):
                continue
            x = np.zeros(n)
            x[cols] = x_support
            residual = float(np.linalg.norm(a @ x - b))
            if residual < best_residual:
                best, best_residual = x, residual
    return best


def _design(shapes: Sequence[StepShape], ridge: float) -> np.ndarray:
    """Columns: step_s, sample_s, token_s (over max(tokens, ridge)), attn_pair_s, kv_token_s."""
    return np.array(
        [[1.0, s.sampled, max(s.tokens, ridge), s.prefill_attn_pairs, s.decode_kv_tokens] for s in shapes],
        dtype=float,
    )


def fit_cost_model(
    shapes: Sequence[StepShape], times: Sequence[float], ridges: Sequence[float] = DEFAULT_RIDGES
) -> Fit:
    """The non-negative CostModel with the least RMS relative error over the samples."""
    if len(shapes) != len(times) or len(shapes) < 5:
        raise ValueError("need as many times as shapes, and at least 5 samples for 5 coefficients")
    if any(s.tokens == 0 for s in shapes) or min(times) <= 0:
        raise ValueError("every sample needs at least one token and a positive time")
    weights = 1.0 / np.asarray(times, dtype=float)
    target = np.ones(len(times))  # measured / measured
    fits = [_fit_at(shapes, times, weights, target, ridge) for ridge in ridges]
    return min(fits, key=lambda f: f.rms_error)


def _fit_at(
    shapes: Sequence[StepShape], times: Sequence[float], weights: np.ndarray, target: np.ndarray, ridge: float
) -> Fit:
    x = nnls(_design(shapes, ridge) * weights[:, None], target)
    step_s, sample_s, token_s, attn_pair_s, kv_token_s = (float(v) for v in x)
    model = CostModel(step_s, sample_s, token_s, token_s * ridge, attn_pair_s, kv_token_s)
    return Fit(model, relative_errors(model, shapes, times))
