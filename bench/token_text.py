"""A workload's token ids as text: one made-up word per id, so that servers with their own tokenizer
(vLLM, SGLang, a router that matches text, a backend counting words) can be sent the same prompts.

The rendering is prefix-stable: the text of a prompt's first k ids is a prefix of the whole prompt's
text, ending at a word boundary, and the words are lower-case letters separated by single spaces, so a
BPE tokenizer (whose pre-tokenizer splits before each space) gives a prefix of the ids for a prefix of
the words. A word is two or three syllables, which most tokenizers split into two or three tokens: the
servers count several tokens where the workload counted one id, as a real tokenizer's unit differs
from a gateway's guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
_BASE = len(SYLLABLES)


@lru_cache(maxsize=65536)
def word(token_id: int) -> str:
    """The word for one id: distinct ids below len(SYLLABLES)**3 give distinct words."""
    if token_id < 0:
        raise ValueError(f"token ids are not negative, got {token_id}")
    first, rest = SYLLABLES[token_id % _BASE], token_id // _BASE
    second, third = SYLLABLES[rest % _BASE], rest // _BASE
    return first + second + (SYLLABLES[third % _BASE] if third else "")


def text_of(token_ids: Sequence[int]) -> str:
    """The prompt as words, one per id, separated by single spaces."""
    return " ".join(map(word, token_ids))
