"""Driving the engine in tests: random prompts, and every request run to its end."""

from __future__ import annotations

import random

from workers.engine.engine_core import Engine
from workers.engine.sampling_params import SamplingParams

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def prompts(
    vocab: int, lengths: tuple[int, ...] = (3, 9, 16, 17, 31, 40, 64, 90), seed: int = 1
) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def run(engine: Engine, batch: list[list[int]], sampling: SamplingParams = GREEDY) -> dict[int, list[int]]:
    ids = [engine.add_request(p, sampling) for p in batch]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return {k: tokens[i] for k, i in enumerate(ids)}
