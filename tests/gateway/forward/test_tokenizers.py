"""What routing takes of a prompt (gateway.forward.tokenizers): its head within the limits, and
whether its ids are the whole prompt's, the only ones worth attaching for a bundled worker; past
LONG_QUEUE long prompts waiting, one more is routed by load rather than queued."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from gateway.forward.request_view import RequestView
from gateway.forward.tokenizers import LONG_QUEUE, SHORT_PROMPT_CHARS, Tokenizers
from gateway.gateway_config import Limits

MODEL = "m"
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


def test_a_clients_ids_are_routed_by_their_head_and_never_attached(tokenizers: Tokenizers) -> None:
    ids = list(range(1, 10_001))
    prompt = asyncio.run(tokenizers.prompt(RequestView("completions", token_ids=ids), MODEL, LIMITS))
    assert prompt is not None and prompt.ids == ids[:256] and not prompt.tokenized


def test_past_the_long_queue_a_long_prompt_is_routed_by_load(tokenizers: Tokenizers) -> None:
    long = text(SHORT_PROMPT_CHARS + 1)

    async def burst() -> list[object]:
        calls = [tokenizers.prompt(long, MODEL, LIMITS) for _ in range(LONG_QUEUE + 1)]
        return await asyncio.gather(*calls, tokenizers.prompt(text(100), MODEL, LIMITS))

    *longs, short = asyncio.run(burst())
    assert all(p is not None for p in longs[:LONG_QUEUE]) and longs[LONG_QUEUE] is None
    assert short is not None
