"""A long prompt's head, tokenized alone, gives a head of the whole prompt's ids (the gateway routes
a prompt past its limits by its head): the cut rule, on texts and through the chat template, and
tokenizing that leaves the GIL to other threads."""

from __future__ import annotations

import random
import threading
import time

import pytest

from protocol.models import default_gguf_path
from protocol.prompts import chat_prompt_ids
from protocol.tokenizer import CUT_MARGIN_CHARS, HeadTokenizer, Tokenizer

WORDS = ["the", "quick", "fox", "1234567", "é", "中文字符", "über", "don't", "   ", "\n\n", '{"a":', "}"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<jupyter_output>"]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf_path())


def texts() -> list[str]:
    rng = random.Random(3)
    mixed = [
        "".join(rng.choice(WORDS + SPECIALS) + rng.choice(["", " ", "\n"]) for _ in range(300))
        for _ in range(6)
    ]
    runs = ["a" * 3000, "ab" * 1500, "中" * 2000, "".join(rng.choice("abcdefgh") for _ in range(3000))]
    return mixed + runs


def test_a_cut_text_keeps_a_head_of_the_whole_texts_ids(smol: Tokenizer) -> None:
    rng = random.Random(4)
    for text in texts():
        whole = smol.backend.encode(text, add_special_tokens=False)
        for cut in [rng.randrange(1, len(text)) for _ in range(40)]:
            head = smol.head_ids(text, cut)
            assert head == whole.ids[: len(head)], (text[max(cut - 40, 0) : cut], cut)
            # Only the tokens near the cut are lost.
            before_cut = sum(end <= cut for _, end in whole.offsets)
            assert before_cut - len(head) <= 2 * CUT_MARGIN_CHARS


def test_a_text_within_the_bound_is_tokenized_whole(smol: Tokenizer) -> None:
    text = "Hello <|im_start|>user there"
    assert smol.head_ids(text, len(text)) == smol.encode(text)


def test_a_cut_inside_a_special_token_keeps_none_of_its_pieces(smol: Tokenizer) -> None:
    text = "x" * 40 + "<|im_start|>user\nhello"
    whole = smol.encode(text)
    for cut in range(40, 40 + len("<|im_start|>") + 1):
        head = smol.head_ids(text, cut)
        assert head == whole[: len(head)]


def test_a_head_tokenizer_gives_a_head_of_a_conversations_ids(smol: Tokenizer) -> None:
    """Through the template, and through its canonical fallback, whose pieces are encoded one by one:
    the budget is shared, and nothing after the cut is encoded."""
    long = " ".join(random.Random(5).choice(WORDS) for _ in range(3000))
    templated = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": long}]
    # A turn of tool calls alone, which SmolLM2's template cannot render: canonical from there on.
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    fallback = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": long},
        {"role": "user", "content": long},
    ]
    for messages in (templated, fallback):
        whole = chat_prompt_ids(smol, messages)
        head = HeadTokenizer.of(smol, 4000)
        ids = chat_prompt_ids(head, messages)
        assert head.budget.cut and 0 < len(ids) < len(whole)
        assert ids == whole[: len(ids)]
        roomy = HeadTokenizer.of(smol, 10 * len(long))
        assert chat_prompt_ids(roomy, messages) == whole and not roomy.budget.cut


def test_encoding_leaves_the_gil_to_other_threads(smol: Tokenizer) -> None:
    """A plain HF encode holds the GIL throughout: a megabyte of text froze every other thread,
    the gateway's event loop included, for most of a second."""
    text = " ".join(random.Random(6).choice(WORDS) for _ in range(250_000))
    ticks = 0
    done = threading.Event()

    def tick() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.perf_counter()
    smol.encode(text)
    seconds = time.perf_counter() - start
    done.set()
    ticker.join()
    # A tick a millisecond, give or take a loaded machine: a held GIL allows one or two.
    assert ticks >= seconds * 1000 / 10, (ticks, seconds)
