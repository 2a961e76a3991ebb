"""The chain cache gives exactly block_hashes' chains, hashes a prompt that extends a kept one only
where it grew, keeps models and block sizes apart, and stays within its bound."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radix import block_hashes
from radix.chain_cache import STRIDE, ChainCache

ids = st.integers(0, 2**32 - 1)


@settings(max_examples=200, deadline=None)
@given(
    base=st.lists(st.integers(0, 50), max_size=120),
    edits=st.lists(
        st.tuples(st.integers(0, 130), st.lists(st.integers(0, 50), max_size=40)), min_size=1, max_size=8
    ),
    block_size=st.sampled_from([1, 2, 3, 4]),
    stride=st.integers(1, 4),
)
def test_every_chain_equals_a_whole_hashing(
    base: list[int], edits: list[tuple[int, list[int]]], block_size: int, stride: int
) -> None:
    """Prompts that keep a head of the last one and add a tail of their own (a conversation's next
    turn, an edited tail, a prompt cut short, one unrelated) come out as block_hashes gives them."""
    chains = ChainCache(max_bytes=2**20, stride=stride)
    prompt = base
    for keep, tail in edits:
        prompt = prompt[:keep] + tail
        assert chains.block_hashes(prompt, block_size, "m") == block_hashes(prompt, block_size, "m")


def test_a_growing_prompt_is_hashed_only_where_it_grew() -> None:
    chains = ChainCache(max_bytes=2**24)
    rng = random.Random(0)
    prompt = [rng.randrange(49152) for _ in range(16 * 100)]
    chains.block_hashes(prompt, 16, "m")
    assert (chains.stats.misses, chains.stats.hashed_blocks) == (1, 100)
    for turn in range(1, 6):
        prompt += [rng.randrange(49152) for _ in range(16 * 3)]
        assert chains.block_hashes(prompt, 16, "m") == block_hashes(prompt, 16, "m")
        # What a hit leaves to hash: the new blocks and at most one stride before them.
        assert chains.stats.hits == turn
    assert chains.stats.hashed_blocks - 100 <= 5 * (3 + STRIDE)
    assert chains.stats.reused_blocks >= 5 * (100 - STRIDE)


def test_a_numpy_prompt_reads_the_same_chain() -> None:
    chains = ChainCache(max_bytes=2**20)
    prompt = list(range(16 * 40))
    chains.block_hashes(prompt, 16, "m")
    assert chains.block_hashes(np.array(prompt + [7] * 16), 16, "m") == block_hashes(
        prompt + [7] * 16, 16, "m"
    )
    assert chains.stats.hits == 1


@pytest.mark.parametrize(
    ("model", "block_size", "adapter"), [("other", 16, ""), ("m", 8, ""), ("m", 16, "lora")]
)
def test_models_adapters_and_block_sizes_share_nothing(model: str, block_size: int, adapter: str) -> None:
    chains = ChainCache(max_bytes=2**20)
    prompt = list(range(16 * 40))
    chains.block_hashes(prompt, 16, "m")
    assert chains.block_hashes(prompt, block_size, model, adapter) == block_hashes(
        prompt, block_size, model, adapter
    )
    assert chains.stats.hits == 0


def test_the_cache_stays_within_its_bound_dropping_the_least_recent() -> None:
    bound = 10_000  # about seven of the twenty prompts
    chains = ChainCache(max_bytes=bound)
    rng = random.Random(1)
    prompts = [[rng.randrange(49152) for _ in range(16 * 64)] for _ in range(20)]
    for prompt in prompts:
        chains.block_hashes(prompt, 16, "m")
        assert chains.stats.bytes <= bound
    assert chains.stats.entries < 2 * len(prompts)
    hits = chains.stats.hits
    chains.block_hashes(prompts[-1] + [1] * 16, 16, "m")
    chains.block_hashes(prompts[0] + [1] * 16, 16, "m")
    assert chains.stats.hits == hits + 1


def test_short_prompts_and_a_zero_bound_keep_nothing() -> None:
    short = ChainCache(max_bytes=2**20)
    prompt = list(range(16 * (STRIDE - 1)))
    assert short.block_hashes(prompt, 16, "m") == block_hashes(prompt, 16, "m")
    off = ChainCache(max_bytes=0)
    long_prompt = list(range(16 * 4 * STRIDE))
    assert off.block_hashes(long_prompt, 16, "m") == block_hashes(long_prompt, 16, "m")
    assert short.stats.entries == off.stats.entries == 0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        ChainCache(max_bytes=1).block_hashes([1, 2], 0, "m")
    with pytest.raises(ValueError, match="stride"):
        ChainCache(max_bytes=1, stride=0)
    with pytest.raises(OverflowError):
        ChainCache(max_bytes=2**20).block_hashes([2**32] * 16 * STRIDE, 16, "m")
