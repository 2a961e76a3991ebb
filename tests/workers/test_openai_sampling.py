"""The OpenAI knobs as engine parameters: the default max_tokens of n choices fits the KV pool."""

from __future__ import annotations

import dataclasses

import pytest

from protocol.openai_api import ServedModel, parse_chat, parse_completion
from workers.engine.block_manager import BlockManager
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerConfig, UnschedulableSequence
from workers.engine.sequence import Sequence
from workers.openai_sampling import sampling_params

BLOCK_SIZE, NUM_BLOCKS = 4, 256
MODEL = ServedModel(
    name="m", vocab_size=100, max_context_len=4096, kv_capacity_tokens=BLOCK_SIZE * NUM_BLOCKS
)


def admit(prompt_len: int, sampling: SamplingParams, n: int) -> None:
    """Scheduler.add of an n-choice request on MODEL's pool: raises when it could never fit."""
    scheduler = Scheduler(SchedulerConfig(), BlockManager(NUM_BLOCKS, BLOCK_SIZE, "m"))
    group = [Sequence(i, list(range(prompt_len)), sampling, arrival_time=0.0) for i in range(n)]
    group[0].forks = group[1:]
    scheduler.add(group[0])


@pytest.mark.parametrize("n", [1, 2, 3, 7])
@pytest.mark.parametrize("prompt_len", [16, 18, 301])
def test_chat_default_gives_every_choice_all_that_fits_at_once(n: int, prompt_len: int) -> None:
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "n": n}, MODEL)
    sampling = sampling_params(chat, prompt_len, MODEL, BLOCK_SIZE)
    admit(prompt_len, sampling, n)
    # And not a block less than that: a block more per choice no longer fits.
    with pytest.raises(UnschedulableSequence, match="KV blocks"):
        admit(prompt_len, dataclasses.replace(sampling, max_tokens=sampling.max_tokens + BLOCK_SIZE), n)


def test_explicit_and_completion_defaults_ignore_n() -> None:
    completion = parse_completion({"prompt": "x", "n": 5}, MODEL)
    assert sampling_params(completion, 10, MODEL, BLOCK_SIZE).max_tokens == 16
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "n": 5, "max_tokens": 900}, MODEL)
    assert sampling_params(chat, 10, MODEL, BLOCK_SIZE).max_tokens == 900
