"""Sampling: greedy, filters, seeds that ignore the rest of the batch, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from workers.engine.sampler import sample, step_seed
from workers.engine.sampling_params import SamplingParams

VOCAB = 50


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def tokens(
    logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int] | None = None
) -> list[int]:
    return [s.token_id for s in sample(logits, params, num_generated or [0] * len(params))]


def test_greedy_is_argmax() -> None:
    logits = logits_rows(6)
    assert tokens(logits, [SamplingParams(temperature=0)] * 6) == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
        SamplingParams(temperature=0.8, top_k=1, seed=3),
    ],
    ids=["top_k=1", "tiny top_p", "top_k=1 seeded"],
)
def test_filters_that_keep_one_token_equal_greedy(params: SamplingParams) -> None:
    logits = logits_rows(16, seed=1)
    for _ in range(5):
        assert tokens(logits, [params] * 16) == logits.argmax(-1).tolist()


def test_top_k_and_top_p_keep_only_allowed_tokens() -> None:
    logits = logits_rows(1, seed=2).repeat(400, 1)
    order = logits[0].argsort(descending=True).tolist()
    top3 = set(tokens(logits, [SamplingParams(temperature=5.0, top_k=3)] * 400))
    assert top3 == set(order[:3])
    probs = torch.softmax(logits[0], -1)[order]
    # The nucleus: the fewest top tokens whose mass reaches top_p.
    top_p = float(probs[:4].sum()) - 1e-4
    nucleus = set(tokens(logits, [SamplingParams(temperature=1.0, top_p=top_p)] * 400))
    assert nucleus <= set(order[:4])
    assert len(nucleus) >= 3


def test_unfiltered_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, math.log(3.0), -1e9]]).repeat(4000, 1)
    draws = torch.tensor(tokens(logits, [SamplingParams(temperature=1.0)] * 4000), dtype=torch.float32)
    assert not (draws == 2).any()
    assert abs(float((draws == 1).float().mean()) - 0.75) < 0.03


def test_seeded_rows_ignore_the_rest_of_the_batch() -> None:
    row = logits_rows(1, seed=4)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [tokens(row, [seeded], [n])[0] for n in range(30)]
    for batch_size in (3, 8):
        others = logits_rows(batch_size, seed=batch_size)
        for position in (0, batch_size - 1):
            batch = others.clone()
            batch[position] = row[0]
            params = [SamplingParams(temperature=0.7, seed=None)] * batch_size
            params[position] = seeded
            got = [tokens(batch, params, [n] * batch_size)[position] for n in range(30)]
            assert got == alone
    # The step number is part of the seed, so a seeded request does not repeat one token forever.
    assert len(set(alone)) > 3
    assert alone != [tokens(row, [SamplingParams(temperature=1.0, seed=99)], [n])[0] for n in range(30)]


def test_step_seeds_differ() -> None:
    seeds = {step_seed(s, n) for s in range(20) for n in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**64 for s in seeds)


def test_logprobs() -> None:
    logits = logits_rows(3, seed=5)
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=1.0, logprobs=0, seed=1),
        SamplingParams(temperature=0),
    ]
    out = sample(logits, params, [0, 0, 0])
    reference = torch.log_softmax(logits, -1)
    first = out[0]
    assert first.logprob == pytest.approx(float(reference[0].max()), abs=1e-6)
    assert first.top_logprobs is not None and len(first.top_logprobs) == 5
    assert first.top_logprobs[0] == (first.token_id, pytest.approx(first.logprob))
    values = [lp for _, lp in first.top_logprobs]
    assert values == sorted(values, reverse=True)
    assert sum(math.exp(lp) for lp in values) <= 1.0 + 1e-6
    assert out[1].top_logprobs == []
    assert out[1].logprob == pytest.approx(float(reference[1, out[1].token_id]), abs=1e-6)
    assert out[2].logprob is None and out[2].top_logprobs is None


def test_row_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="one entry per row"):
        sample(logits_rows(2), [SamplingParams()], [0])
