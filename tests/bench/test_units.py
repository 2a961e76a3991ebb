"""Replicas of another unit: words merge tokens prefix-stably, at several tokens a word."""

from __future__ import annotations

import random

import pytest

from bench.units import WORD_TOKENS, own_tokens, unit_of


def test_words_are_prefix_stable_at_word_boundaries_and_several_tokens_long() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(1000, 30000) for _ in range(3000)]
    words = own_tokens(unit_of("words"), tokens, 32000)
    assert 0.8 * len(tokens) / WORD_TOKENS < len(words) < 1.25 * len(tokens) / WORD_TOKENS
    for cut in (100, 1500, 2999):
        prefix = own_tokens(unit_of("words"), tokens[:cut], 32000)
        # Every word but the last (which may continue past the cut) is the whole prompt's.
        assert prefix[:-1] == words[: len(prefix) - 1]
    assert all(1000 <= w < 32000 for w in words)


def test_tokens_and_blocks64_keep_the_tokens() -> None:
    tokens = [5, 6, 7]
    assert own_tokens(unit_of("tokens"), tokens, 100) == tokens
    assert own_tokens(unit_of("blocks64"), tokens, 100) == tokens
    assert unit_of("blocks64").block_size == 64 and unit_of("blocks64").foreign
    assert not unit_of("tokens").foreign


def test_an_unknown_unit_names_the_choices() -> None:
    with pytest.raises(ValueError, match="tokens"):
        unit_of("bytes")
