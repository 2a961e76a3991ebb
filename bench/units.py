"""Replicas that count a prompt in another unit than the gateway's, for the fleet simulator.

The gateway hashes its own tokens into its own blocks; a foreign backend runs its own tokenizer and
KV block, and reports what it reused in those. A simulated replica of another unit is given each
prompt as its own tokens: `words` merges the gateway's tokens into words (a word starts at a token
whose id hash says so, about one in WORD_TOKENS, so a prefix of tokens is a prefix of words: the
prefix stability a real tokenizer has at word boundaries), `blocks64` keeps the tokens but caches in
blocks of 64. Either way the replica's reports disagree with the gateway's blocks by rounding, which
is what approximate mode's learning must tolerate (radix.reports).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

UNITS = ("tokens", "words", "blocks64")
# Gateway tokens per word, on average: a real tokenizer's 1.3 for English, ~2.8 for bench.token_text' text.
WORD_TOKENS = 3


@dataclass(frozen=True, slots=True)
class Unit:
    """How a replica counts: `words` merges tokens into words; `block_size` its KV block (None: the
    gateway's)."""

    name: str = "tokens"
    words: bool = False
    block_size: int | None = None

    @property
    def foreign(self) -> bool:
        return self.words or self.block_size is not None


TOKENS = Unit()


def unit_of(name: str) -> Unit:
    if name == "tokens":
        return TOKENS
    if name == "words":
        return Unit(name, words=True)
    if name == "blocks64":
        return Unit(name, block_size=64)
    raise ValueError(f"unit must be one of {UNITS}, got {name!r}")


def _starts_word(token: int) -> bool:
    return xxhash.xxh32_intdigest(token.to_bytes(4, "little")) % WORD_TOKENS == 0


def own_tokens(unit: Unit, tokens: Sequence[int], vocab_size: int) -> list[int]:
    """The prompt as the replica counts it: the tokens themselves, or one id per word (a hash of the
    word's tokens into the vocabulary, clear of the lowest ids where special tokens live)."""
    if not unit.words:
        return list(tokens)
    words: list[int] = []
    current: list[int] = []
    for t in tokens:
        if current and _starts_word(t):
            words.append(_word_id(current, vocab_size))
            current = []
        current.append(t)
    if current:
        words.append(_word_id(current, vocab_size))
    return words


def _word_id(tokens: list[int], vocab_size: int) -> int:
    digest = xxhash.xxh64_intdigest(b"".join(t.to_bytes(4, "little") for t in tokens))
    return 1000 + digest % (vocab_size - 1000)
