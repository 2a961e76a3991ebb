"""/v1/completions and /v1/chat/completions (workers.openai_routes) over real loopback HTTP on the tiny
random model, with the official openai client where it applies: prompts as text or ids, cached
tokens, sampling, and every refusal as a typed 4xx; alone, how the engine's refusals are told."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import httpx
import openai
import pytest

from bench.probes import wait_for
from protocol.errors import ApiError
from tests.support.workers import RunningWorker, StartWorker, idle, random_ids
from tests.workers.worker_http import error_of, greedy
from workers.bundled_worker import Worker
from workers.engine.engine_core import EngineConfig, PromptTooLong, RequestOutput
from workers.engine.scheduler import UnschedulableSequence
from workers.kv_event_log import KVEventLog
from workers.openai_routes import first_output
from workers.sim.profiles import CPU_SMOLLM2
from workers.sim.runner import VirtualClock
from workers.sim.sim_engine import SimEngine

# -- OpenAI endpoints -------------------------------------------------------------------------


def test_completion_response_shape_and_usage(tiny_worker: RunningWorker) -> None:
    client = tiny_worker.client()
    done = client.completions.create(model=tiny_worker.model, prompt="Hello there", max_tokens=5, **greedy())
    assert done.id.startswith("cmpl-") and done.object == "text_completion"
    assert done.model == "tiny-llama" and abs(done.created - time.time()) < 60
    [choice] = done.choices
    assert choice.index == 0 and choice.finish_reason == "length" and isinstance(choice.text, str)
    assert done.usage.completion_tokens == 5
    assert done.usage.prompt_tokens == len(tiny_worker.worker.tokenizer.encode("Hello there"))
    assert done.usage.total_tokens == done.usage.prompt_tokens + 5
    assert done.usage.prompt_tokens_details.cached_tokens == 0


def test_prompt_as_text_ids_or_attached_ids_is_the_same_request(tiny_worker: RunningWorker) -> None:
    client = tiny_worker.client()
    text = "The quick brown fox jumps over the lazy dog"
    ids = tiny_worker.worker.tokenizer.encode(text)
    by_text = client.completions.create(model=tiny_worker.model, prompt=text, max_tokens=6, **greedy())
    by_ids = client.completions.create(model=tiny_worker.model, prompt=ids, max_tokens=6, **greedy())
    attached = client.completions.create(
        model=tiny_worker.model, prompt="ignored text", max_tokens=6, **greedy(prefixgate_token_ids=ids)
    )
    assert by_text.choices[0].text == by_ids.choices[0].text == attached.choices[0].text
    assert by_text.usage.prompt_tokens == attached.usage.prompt_tokens == len(ids)


def test_repeated_prefix_reports_cached_tokens(tiny_worker: RunningWorker) -> None:
    client = tiny_worker.client()
    ids = random_ids(30, seed=1)
    first = client.completions.create(model=tiny_worker.model, prompt=ids, max_tokens=2, **greedy())
    again = client.completions.create(model=tiny_worker.model, prompt=ids, max_tokens=2, **greedy())
    longer = client.completions.create(
        model=tiny_worker.model, prompt=[*ids, 7, 8, 9], max_tokens=2, **greedy()
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Block size 4: all 7 full blocks before the last prompt token come from the cache.
    assert again.usage.prompt_tokens_details.cached_tokens == 28
    assert longer.usage.prompt_tokens_details.cached_tokens >= 28
    assert again.choices[0].text == first.choices[0].text


def test_stop_strings_and_seeds(tiny_worker: RunningWorker) -> None:
    client = tiny_worker.client()
    free = client.completions.create(model=tiny_worker.model, prompt="abc", max_tokens=16, **greedy())
    text = free.choices[0].text
    stop = text[3:5]
    assert len(stop) == 2
    stopped = client.completions.create(
        model=tiny_worker.model, prompt="abc", max_tokens=16, stop=[stop], **greedy()
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    sampled = [
        client.completions.create(
            model=tiny_worker.model, prompt="abc", max_tokens=8, temperature=1.0, top_p=0.9, seed=seed
        )
        .choices[0]
        .text
        for seed in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1] != sampled[2]


# -- refusals ---------------------------------------------------------------------------------


def test_n_choices_default_max_tokens_fits_the_pool_and_refusals(make_worker: StartWorker) -> None:
    worker = make_worker(EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4))
    client = worker.client()
    messages = [{"role": "user", "content": "Tell me a story."}]
    # Chat without max_tokens asks for all that fits: for 3 choices, a third of the pool each.
    done = client.chat.completions.create(model=worker.model, messages=messages, n=3, **greedy())
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert 3 <= done.usage.completion_tokens <= 3 * 64 * 4 // 3
    too_many = httpx.post(f"{worker.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 5})
    assert "n=5" in error_of(too_many, 400)["message"]
    too_big = httpx.post(f"{worker.url}/v1/completions", json={"prompt": [5] * 100, "max_tokens": 60, "n": 4})
    assert "KV blocks" in error_of(too_big, 400)["message"]
    wait_for(lambda: idle(worker), "the worker to be idle")


BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "x",', 400, None),
    ("/v1/completions", b'["x"]', 400, None),
    ("/v1/completions", b'{"prompt": 12}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": []}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [1, 99999999]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "model": "gpt-4o"}', 404, "model"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "3"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -1}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 9}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "top_p": 2}', 400, "top_p"),
    ("/v1/completions", b'{"prompt": "x", "n": 65}', 400, "n"),
    ("/v1/completions", b'{"prompt": "x", "best_of": 2}', 400, "best_of"),
    ("/v1/completions", b'{"prompt": "x", "stop": [1]}', 400, "stop"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("/v1/completions", b'{"prompt": "x", "stream_options": {"include_usage": true}}', 400, "stream_options"),
    ("/v1/completions", b'{"prompt": "x", "echo": true}', 400, "echo"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": {"role": "user", "content": "x"}}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', 400, "n"),
]


@pytest.mark.parametrize(("path", "raw", "status", "param"), BAD_REQUESTS)
def test_bad_input_is_a_4xx_openai_error(
    tiny_worker: RunningWorker, path: str, raw: bytes, status: int, param: str | None
) -> None:
    response = httpx.post(tiny_worker.url + path, content=raw, headers={"Content-Type": "application/json"})
    error = error_of(response, status)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_the_openai_client_sees_typed_errors(tiny_worker: RunningWorker) -> None:
    client = tiny_worker.client()
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="nope", prompt="x")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="best_of is not supported"):
        client.completions.create(model=tiny_worker.model, prompt="x", best_of=2)


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


def test_a_tool_calling_history_is_served_and_unsupported_features_are_refused_by_name(
    tiny_worker: RunningWorker,
) -> None:
    """A bundled worker cannot call tools, but it serves the histories agents send: an assistant turn
    that called a tool (content null) and the tool's result, through the chat template or, where the
    template cannot render them, its canonical form (protocol.prompts)."""
    client = tiny_worker.client()
    history = [
        {"role": "user", "content": "Find order 7."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "order 7: shipped"},
        {"role": "user", "content": "So?"},
    ]
    reply = client.chat.completions.create(model=tiny_worker.model, messages=history, max_tokens=3)
    assert reply.choices[0].finish_reason == "length" and reply.usage.prompt_tokens > 20
    for field, value in (("tools", [TOOL]), ("response_format", {"type": "json_object"})):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=tiny_worker.model, messages=history, max_tokens=3, **{field: value}
            )
        assert refused.value.param == field and f"{field} is not supported" in refused.value.message
    assert idle(tiny_worker)


def test_prompt_longer_than_the_context_window(tiny_worker: RunningWorker) -> None:
    client = tiny_worker.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=tiny_worker.model, prompt=[5] * 600, max_tokens=1)
    assert "600" in info.value.message and "512" in info.value.message
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=tiny_worker.model, prompt=[5] * 500, max_tokens=20)
    assert "520" in info.value.message and "512" in info.value.message
    # Fits the window but not the KV pool (256 blocks of 4 = 1024 tokens is enough here), so: fine.
    ok = client.completions.create(model=tiny_worker.model, prompt=[5] * 500, max_tokens=2, **greedy())
    assert ok.usage.prompt_tokens == 500


def test_request_the_kv_pool_can_never_hold_is_400(make_worker: StartWorker) -> None:
    worker = make_worker(EngineConfig(block_size=4, num_blocks=8))
    response = httpx.post(f"{worker.url}/v1/completions", json={"prompt": [5] * 40, "max_tokens": 4})
    assert "KV blocks" in error_of(response, 400)["message"]
    # Chat without max_tokens asks for all that fits: a prompt that alone overflows the pool is refused.
    messages = [{"role": "user", "content": "tell me " * 20}]
    chat = httpx.post(f"{worker.url}/v1/chat/completions", json={"messages": messages})
    assert "KV blocks" in error_of(chat, 400)["message"]
    short = httpx.post(
        f"{worker.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] >= 1


# -- another engine behind the same server ----------------------------------------------------


def test_the_simulated_engine_serves_token_id_prompts(serve: Callable[..., RunningWorker]) -> None:
    events = KVEventLog()
    sim = SimEngine(CPU_SMOLLM2, clock=VirtualClock(), **events.callbacks())
    worker = serve(Worker.around(sim, events, worker_id="sim-1", backend="sim"), sim)
    health = httpx.get(f"{worker.url}/health").json()
    assert (health["model"], health["backend"], health["block_size"]) == ("SmolLM2-135M-Instruct", "sim", 16)
    ids = random_ids(40, seed=30)
    client = worker.client()
    first = client.completions.create(model=worker.model, prompt=ids, max_tokens=4, **greedy())
    assert first.choices[0].text and first.usage.completion_tokens == 4
    chat = client.chat.completions.create(
        model=worker.model,
        messages=[{"role": "user", "content": "?"}],
        max_tokens=4,
        **greedy(prefixgate_token_ids=ids),
    )
    assert chat.usage.prompt_tokens_details.cached_tokens == 32
    refused = httpx.post(f"{worker.url}/v1/completions", json={"prompt": "text needs a tokenizer"})
    assert error_of(refused, 400)["code"] == "token_ids_required"
    snapshot = httpx.get(f"{worker.url}/kv/snapshot").json()
    assert set(snapshot["hashes"]) == set(sim.block_manager.cached_hashes()) and snapshot["hashes"]


# -- the engine's refusals, without a server ------------------------------------------------------------


def first_of(error: Exception) -> ApiError:
    async def outputs() -> AsyncIterator[RequestOutput]:
        raise error
        yield

    async def main() -> RequestOutput:
        return await first_output(outputs())

    with pytest.raises(ApiError) as refused:
        asyncio.run(main())
    return refused.value


def test_a_prompt_too_long_for_the_context_window_is_a_400_on_max_tokens() -> None:
    refused = first_of(PromptTooLong("600 tokens, the window is 512"))
    assert (refused.status, refused.param, refused.code) == (400, "max_tokens", "context_length_exceeded")
    assert refused.message == "600 tokens, the window is 512"


def test_a_request_the_kv_pool_can_never_hold_is_a_400_too_large() -> None:
    refused = first_of(UnschedulableSequence("needs 40 KV blocks, the pool has 8"))
    assert (refused.status, refused.param, refused.code) == (400, "max_tokens", "request_too_large")


def test_an_engine_that_fails_before_the_first_token_is_a_500() -> None:
    refused = first_of(RuntimeError("the engine thread died"))
    assert (refused.status, refused.code) == (500, "engine_error")
    assert "the engine thread died" in refused.message


def test_the_first_output_is_passed_through() -> None:
    out = RequestOutput(1, 0, [7], "a", False, None, prompt_tokens=3, cached_tokens=0, completion_tokens=1)

    async def outputs() -> AsyncIterator[RequestOutput]:
        yield out

    assert asyncio.run(first_output(outputs())) is out
