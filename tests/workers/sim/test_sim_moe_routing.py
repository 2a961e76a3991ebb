"""MoE routing statistics against their formulas and a Monte Carlo of a uniform top-k gate; the
profiled models' parameter counts against their model cards."""

from __future__ import annotations

import numpy as np
import pytest

from workers.sim.moe_profiles import MIXTRAL_8X7B, QWEN3_30B_A3B
from workers.sim.moe_routing import ExpertLayout, Gate


def uniform_gate_draws(experts: int, top_k: int, tokens: int, trials: int, seed: int = 0) -> np.ndarray:
    """Expert ids, shape (trials, tokens, top_k): each token's k distinct experts, uniformly drawn."""
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((trials, tokens, experts)), axis=-1)[..., :top_k]


@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (128, 8)])
@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
def test_distinct_experts_closed_form_and_monte_carlo(experts: int, top_k: int, tokens: int) -> None:
    expected = experts * (1 - (1 - top_k / experts) ** tokens)
    draws = uniform_gate_draws(experts, top_k, tokens, trials=400)
    touched = np.mean([len(np.unique(trial)) for trial in draws])
    assert touched == pytest.approx(expected, rel=0.03)
    # One rank holds every expert: the slowest rank is the whole model, with no sampling noise.
    load = ExpertLayout(experts, top_k, group=1).slowest(tokens)
    assert load.picks == tokens * top_k and load.imbalance == 1.0
    assert load.distinct == pytest.approx(expected)


@pytest.mark.parametrize(("experts", "top_k", "group"), [(8, 2, 2), (8, 2, 8), (128, 8, 4), (128, 8, 8)])
@pytest.mark.parametrize("tokens", [4, 16, 256])
def test_the_slowest_rank_matches_a_monte_carlo_within_ten_percent(
    experts: int, top_k: int, group: int, tokens: int
) -> None:
    draws = uniform_gate_draws(experts, top_k, tokens, trials=300)
    ranks = draws // (experts // group)
    slowest_picks = np.stack([(ranks == r).sum(axis=(1, 2)) for r in range(group)]).max(axis=0).mean()
    slowest_distinct = np.mean(
        [max(len(np.unique(d[k == r])) for r in range(group)) for d, k in zip(draws, ranks, strict=True)]
    )
    load = ExpertLayout(experts, top_k, group).slowest(tokens)
    assert load.picks == pytest.approx(slowest_picks, rel=0.1)
    assert load.distinct == pytest.approx(slowest_distinct, rel=0.1)
    # Top-k sampling noise alone unbalances the ranks, the more so the fewer the tokens.
    assert load.imbalance > 1


def test_sampling_noise_fades_with_the_batch() -> None:
    layout = ExpertLayout(8, 2, group=8)
    imbalances = [layout.slowest(n).imbalance for n in (8, 64, 512, 4096)]
    assert imbalances == sorted(imbalances, reverse=True)
    assert imbalances[-1] < 1.05 < imbalances[0]


def test_a_skewed_gate_loads_the_rank_of_the_popular_experts() -> None:
    uniform, skewed = ExpertLayout(8, 2, 4), ExpertLayout(8, 2, 4, Gate(zipf=1.0))
    assert skewed.slowest(4096).imbalance > 2 > 1.05 > uniform.slowest(4096).imbalance
    # A token picks k experts however skewed the gate, and no expert more than once.
    for experts, top_k in ((8, 2), (128, 8)):
        inclusion = Gate(zipf=1.5).inclusion(experts, top_k)
        assert sum(inclusion) == pytest.approx(top_k)
        assert max(inclusion) == 1.0 and min(inclusion) > 0
    assert Gate().inclusion(8, 2) == [0.25] * 8


def test_layouts_that_cannot_be_are_refused() -> None:
    with pytest.raises(ValueError, match="evenly"):
        ExpertLayout(8, 2, group=3)
    with pytest.raises(ValueError, match="top_k"):
        ExpertLayout(8, 9, group=1)
    with pytest.raises(ValueError, match="zipf"):
        Gate(zipf=-1.0)


def test_the_models_have_their_published_sizes() -> None:
    # Mixtral: 46.7B parameters, 12.9B active; Qwen3-30B-A3B: 30.5B, 3.3B active.
    assert MIXTRAL_8X7B.total_params / 1e9 == pytest.approx(46.7, abs=0.05)
    assert MIXTRAL_8X7B.active_params / 1e9 == pytest.approx(12.9, abs=0.05)
    assert QWEN3_30B_A3B.total_params / 1e9 == pytest.approx(30.5, abs=0.05)
    assert QWEN3_30B_A3B.active_params / 1e9 == pytest.approx(3.3, abs=0.06)
    assert MIXTRAL_8X7B.kv_bytes_per_token(2) == 128 * 1024
    assert QWEN3_30B_A3B.kv_bytes_per_token(2) == 96 * 1024
