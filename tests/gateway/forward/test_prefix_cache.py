"""The prefix cache gives exactly the tokenizer's ids, reuses what a conversation's last turn computed,
and stays within its bound; a tokenizer whose markers would not cut exactly gets none."""

from __future__ import annotations

import random

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.forward.prefix_cache import LOOKBACK, MIN_PREFIX_CHARS, Allowance, PrefixCache, TooLong
from protocol.models import load_tokenizer_spec
from protocol.tokenizer import Tokenizer

TOKENIZER: Tokenizer = load_tokenizer_spec("default")  # type: ignore[assignment]
assert TOKENIZER is not None


def whole(text: str) -> list[int]:
    return TOKENIZER.encode(text)


def render(messages: list[dict[str, str]]) -> str:
    return TOKENIZER.render_chat(messages)


def cache(max_bytes: int = 2**24) -> PrefixCache:
    system = {"role": "system", "content": "sample " * 80}
    made = PrefixCache.of(TOKENIZER.backend, render([system, {"role": "user", "content": "hi"}]), max_bytes)
    assert made is not None and made.marker == "<|im_start|>"
    return made


# Content that tries the cut: the marker and its neighbours inside a message, whitespace and newlines
# on either side of it, multi-byte and combining characters, and lone surrogate-free emoji.
PIECES = [
    "hello",
    " world",
    "\n",
    "  ",
    "\t",
    "<|im_start|>",
    "<|im_end|>",
    "<|im_start",
    "|>",
    "assistant\n",
    "é",
    "e\u0301",
    "日本語",
    "🙂",
    "1234",
    "'s",
    "```python\nprint(1)\n```",
    "",
]
content = st.lists(st.sampled_from(PIECES), max_size=12).map("".join)
roles = st.sampled_from(["user", "assistant", "tool"])


@settings(max_examples=200, deadline=None)
@given(
    system=content,
    turns=st.lists(st.tuples(roles, content), min_size=1, max_size=8),
    padding=st.integers(0, 400),
)
def test_every_turn_of_a_growing_conversation_gets_the_ids_of_a_full_tokenization(
    system: str, turns: list[tuple[str, str]], padding: int
) -> None:
    prefixes = cache()
    messages = [{"role": "system", "content": "x" * padding + system}]
    for role, text in turns:
        messages.append({"role": role, "content": text})
        rendered = render(messages)
        assert list(prefixes.encode(rendered)) == whole(rendered)


def test_the_next_turn_tokenizes_only_what_is_new() -> None:
    prefixes = cache()
    messages = [{"role": "system", "content": "You answer questions about the fleet. " * 40}]
    for turn in range(6):
        messages.append({"role": "user", "content": f"Question {turn}: how many replicas hold it?"})
        rendered = render(messages)
        before = prefixes.stats.reused_tokens
        assert list(prefixes.encode(rendered)) == whole(rendered)
        reused = prefixes.stats.reused_tokens - before
        if turn == 0:
            assert reused == 0
        else:
            # All but this turn's question and the generation prompt came from the cache.
            new = len(whole(rendered)) - reused
            assert 0 < new < 40 < reused
        messages.append({"role": "assistant", "content": f"Answer {turn}: two of them."})
    assert (prefixes.stats.hits, prefixes.stats.misses) == (5, 1)


def test_a_new_conversation_on_a_known_system_prompt_reuses_it() -> None:
    prefixes = cache()
    system = {"role": "system", "content": "Shared instructions for every tenant session. " * 30}
    first = render([system, {"role": "user", "content": "one"}])
    prefixes.encode(first)
    second = render([system, {"role": "user", "content": "a different first question"}])
    assert list(prefixes.encode(second)) == whole(second)
    assert prefixes.stats.hits == 1 and prefixes.stats.reused_tokens >= len(whole(system["content"]))


def test_the_cache_stays_within_its_bound_dropping_the_least_recent() -> None:
    prefixes = cache(max_bytes=40_000)
    rng = random.Random(0)
    conversations = []
    for n in range(30):
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(400))
        system = {"role": "system", "content": f"{n} {words}"}
        conversations.append([system, {"role": "user", "content": "q"}])
        prefixes.encode(render(conversations[-1]))
        assert prefixes.stats.bytes <= 40_000
    assert prefixes.stats.entries < 30 * 2
    # The latest conversation is still known, the first one no longer.
    hits = prefixes.stats.hits
    prefixes.encode(render([*conversations[-1], {"role": "user", "content": "more"}]))
    assert prefixes.stats.hits == hits + 1
    prefixes.encode(render([*conversations[0], {"role": "user", "content": "more"}]))
    assert prefixes.stats.hits == hits + 1


def test_a_text_without_markers_past_the_minimum_is_tokenized_whole_and_not_kept() -> None:
    prefixes = cache()
    text = "<|im_start|>user\n" + "plain text " * 100
    assert prefixes.cuts(text) == []
    assert list(prefixes.encode(text)) == whole(text)
    assert prefixes.stats.entries == 0 and prefixes.cuts("a" * MIN_PREFIX_CHARS + "<|im_start|>") == [256]


def word_level(lstrip: bool) -> tokenizers.Tokenizer:
    vocab = {"[UNK]": 0, "a": 1, "b": 2}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens([tokenizers.AddedToken("<turn>", lstrip=lstrip, special=True)])
    return backend


@pytest.mark.parametrize(
    ("lstrip", "sample", "has_cache"),
    [
        (False, "<turn>" + "a b " * 100 + "<turn>b a", True),
        (True, "<turn>" + "a b " * 100 + "<turn>b a", False),  # a marker that eats the space before it
        (False, "a b " * 100, False),  # no marker in what the template renders
    ],
)
def test_a_cache_is_made_only_for_markers_that_cut_exactly(
    lstrip: bool, sample: str, has_cache: bool
) -> None:
    assert (PrefixCache.of(word_level(lstrip), sample, 2**20) is not None) is has_cache


def test_a_zero_bound_is_no_cache() -> None:
    assert PrefixCache.of(TOKENIZER.backend, render([{"role": "user", "content": "x" * 400}]), 0) is None


def test_a_conversation_edited_far_back_still_reuses_what_it_shares() -> None:
    prefixes = cache()
    system = {"role": "system", "content": "Shared instructions for every tenant session. " * 30}
    turns = [{"role": "user" if n % 2 == 0 else "assistant", "content": f"turn {n} " * 20} for n in range(10)]
    prefixes.encode(render([system, *turns[:3]]))
    # The same first three turns, then more new turns than the cuts looked up first.
    edited = [
        system,
        *turns[:3],
        *({"role": m["role"], "content": "edited " + m["content"]} for m in turns[3:]),
    ]
    rendered = render(edited)
    assert len(prefixes.cuts(rendered)) > LOOKBACK + 3
    before = prefixes.stats.reused_tokens
    assert list(prefixes.encode(rendered)) == whole(rendered)
    assert prefixes.stats.reused_tokens - before >= len(whole(render([system, *turns[:2]])))


def test_past_its_allowance_a_text_is_refused_before_anything_is_tokenized_or_kept() -> None:
    prefixes = cache()
    first = render([{"role": "system", "content": "instructions " * 100}, {"role": "user", "content": "hi"}])
    with pytest.raises(TooLong):
        prefixes.encode(first, Allowance(100))
    assert (prefixes.stats.hits, prefixes.stats.misses, prefixes.stats.entries) == (0, 0, 0)
    prefixes.encode(first)
    # The next turn has little that is new: within a small allowance, which it then uses up.
    turn = render(
        [
            {"role": "system", "content": "instructions " * 100},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"},
        ]
    )
    allowance = Allowance(200)
    assert list(prefixes.encode(turn, allowance)) == whole(turn)
    assert 0 < allowance.chars < 200 and prefixes.stats.hits == 1
