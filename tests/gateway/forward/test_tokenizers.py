"""What routing takes of a prompt (gateway.forward.tokenizers): its head within the limits, and
whether its ids are the whole prompt's, the only ones worth attaching for a bundled worker; past
LONG_QUEUE long prompts waiting, one more is routed by load rather than queued; a turn with little new
to encode is tokenized on the event loop, and a try there that gives up changes nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator

import pytest

from gateway.forward.prefix_cache import PrefixCache
from gateway.forward.request_view import RequestView
from gateway.forward.tokenizers import (
    INLINE_CHARS,
    INLINE_TRY_CHARS,
    LONG_QUEUE,
    SHORT_PROMPT_CHARS,
    Tokenizers,
    _inline,
    _worth_inline,
)
from gateway.gateway_config import Limits
from protocol.models import load_tokenizer_spec
from protocol.tokenizer import Tokenizer

MODEL = "m"
TOKENIZER: Tokenizer = load_tokenizer_spec("default")  # type: ignore[assignment]
LIMITS = Limits(max_routed_tokens=256, max_tokenized_chars=4096)


@pytest.fixture(scope="module")
def tokenizers() -> Iterator[Tokenizers]:
    loaded = Tokenizers({MODEL: "default"}, cache_bytes=2**20)
    asyncio.run(loaded.load([MODEL]))
    yield loaded
    loaded.close()


def text(chars: int) -> RequestView:
    return RequestView("completions", text=("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars])


def test_a_prompt_within_the_limits_is_routed_and_attached_whole(tokenizers: Tokenizers) -> None:
    prompt = asyncio.run(tokenizers.prompt(text(500), MODEL, LIMITS))
    assert prompt is not None and prompt.tokenized and 0 < len(prompt.ids) <= 256


def test_a_prompt_past_either_limit_is_routed_by_its_head_and_not_attached(tokenizers: Tokenizers) -> None:
    whole = asyncio.run(tokenizers.prompt(text(4000), MODEL, Limits()))
    assert whole is not None and whole.tokenized and len(whole.ids) > 256
    for view in (text(4000), text(50_000)):  # too many ids; too many characters too
        prompt = asyncio.run(tokenizers.prompt(view, MODEL, LIMITS))
        assert prompt is not None and not prompt.tokenized
        assert prompt.ids == whole.ids[:256]
        assert prompt.token_ids is None, "a head is no prompt to continue a stream from"
    assert whole.token_ids == whole.ids


def test_a_clients_ids_are_routed_by_their_head_and_never_attached(tokenizers: Tokenizers) -> None:
    ids = list(range(1, 10_001))
    prompt = asyncio.run(tokenizers.prompt(RequestView("completions", token_ids=ids), MODEL, LIMITS))
    assert prompt is not None and prompt.ids == ids[:256] and not prompt.tokenized
    assert prompt.token_ids is None
    short = asyncio.run(tokenizers.prompt(RequestView("completions", token_ids=ids[:100]), MODEL, LIMITS))
    assert short is not None and short.token_ids == ids[:100] and not short.tokenized


def test_past_the_long_queue_a_long_prompt_is_routed_by_load(tokenizers: Tokenizers) -> None:
    long = text(SHORT_PROMPT_CHARS + 1)

    async def burst() -> list[object]:
        calls = [tokenizers.prompt(long, MODEL, LIMITS) for _ in range(LONG_QUEUE + 1)]
        return await asyncio.gather(*calls, tokenizers.prompt(text(100), MODEL, LIMITS))

    *longs, short = asyncio.run(burst())
    assert all(p is not None for p in longs[:LONG_QUEUE]) and longs[LONG_QUEUE] is None
    assert short is not None


def conversation(turns: int) -> RequestView:
    messages = [{"role": "system", "content": "You answer questions about the fleet. " * 60}]
    for n in range(turns):
        messages.append({"role": "user", "content": f"Question {n}: which replica holds it?"})
        messages.append({"role": "assistant", "content": f"Answer {n}: the second one."})
    return RequestView("chat", messages=[*messages, {"role": "user", "content": "And now?"}])


@pytest.fixture
def fresh() -> Iterator[tuple[Tokenizers, PrefixCache]]:
    """Tokenizers with an empty prefix cache of their own."""
    loaded = Tokenizers({MODEL: "default"}, cache_bytes=2**20)
    asyncio.run(loaded.load([MODEL]))
    cache = loaded._caches[MODEL]
    assert cache is not None
    yield loaded, cache
    loaded.close()


def test_a_turn_whose_history_the_cache_knows_is_tokenized_on_the_event_loop(
    fresh: tuple[Tokenizers, PrefixCache],
) -> None:
    loaded, cache = fresh
    threads: list[str] = []
    encode = cache._encode

    def spy(text: str) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(text)

    cache._encode = spy  # type: ignore[method-assign]
    for turns, where in ((1, "tokenize-short_0"), (2, "MainThread"), (3, "MainThread")):
        view = conversation(turns)
        threads.clear()
        prompt = asyncio.run(loaded.prompt(view, MODEL, Limits()))
        whole = TOKENIZER.encode(TOKENIZER.render_chat(view.messages or []))
        assert prompt is not None and list(prompt.ids) == whole and prompt.tokenized
        # A new conversation has all its system prompt to encode: the thread's; a later turn only
        # its new messages, on the loop. Its first try on the loop gave up before encoding anything.
        assert threads and set(threads) == {where}


def test_on_the_event_loop_a_prompt_is_tried_only_where_it_could_be_cheap() -> None:
    assert _worth_inline(text(INLINE_CHARS), INLINE_CHARS, Limits())
    assert not _worth_inline(text(INLINE_CHARS + 1), INLINE_CHARS + 1, Limits())
    history = conversation(2)
    assert _worth_inline(history, 5000, Limits())
    assert not _worth_inline(history, INLINE_TRY_CHARS + 1, Limits())
    # Never where the prompt could be cut for its length: the cut encodes past any allowance.
    assert not _worth_inline(history, 5000, Limits(max_tokenized_chars=8000))


def test_a_try_on_the_event_loop_that_gives_up_leaves_the_cache_as_it_was(
    fresh: tuple[Tokenizers, PrefixCache],
) -> None:
    _, cache = fresh
    before = dataclasses.replace(cache.stats)
    assert _inline(conversation(2), TOKENIZER, cache, Limits()) is None
    assert cache.stats == before


def test_many_small_messages_past_the_allowance_in_all_go_to_the_thread_whole(
    fresh: tuple[Tokenizers, PrefixCache],
) -> None:
    loaded, _ = fresh
    # Each message far under INLINE_CHARS, together far over it, and nothing of them known: a client
    # cannot keep the loop encoding by splitting its prompt.
    messages = [{"role": "user" if n % 2 == 0 else "assistant", "content": f"m{n} " * 30} for n in range(60)]
    view = RequestView("chat", messages=messages)
    prompt = asyncio.run(loaded.prompt(view, MODEL, Limits()))
    assert prompt is not None and list(prompt.ids) == TOKENIZER.encode(TOKENIZER.render_chat(messages))
    cache = loaded._caches[MODEL]
    assert cache is not None and cache.stats.misses == 1 and cache.stats.hits == 0
