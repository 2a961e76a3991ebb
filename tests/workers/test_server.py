"""The worker's HTTP API over real loopback HTTP, with the official openai client where it applies,
on the tiny random model: OpenAI shapes, usage with cached tokens, refusals, disconnects, backpressure,
metrics and the KV event feed."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol.kv_events import EventBatch, apply_batches
from tests.support.polling import wait_for
from tests.support.workers import RunningWorker, StartWorker, idle, load, random_ids, slow_down
from workers.engine.engine import EngineConfig
from workers.kv_events import KVEventLog
from workers.server import Worker
from workers.sim.engine import SimEngine
from workers.sim.profiles import CPU_SMOLLM2
from workers.sim.runner import VirtualClock

LONG = {"ignore_eos": True}


def greedy(**extra: object) -> dict:
    return {"temperature": 0, "extra_body": {"ignore_eos": True, **extra}}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) >= {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def first_event(lines: Iterator[str]) -> str:
    """The first SSE data line. The caller keeps `lines` alive: a dropped httpx line iterator
    closes its connection, which is a disconnect."""
    return next(line for line in lines if line.startswith("data: "))


# -- OpenAI endpoints ---------------------------------------------------------------------------


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


def test_streamed_chat_matches_the_whole_response(tiny_worker: RunningWorker) -> None:
    client = tiny_worker.client()
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(
        model=tiny_worker.model, messages=messages, max_tokens=8, **greedy()
    )
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(
            model=tiny_worker.model,
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            **greedy(),
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    *body, last = chunks
    assert last.choices == [] and all(c.usage is None for c in body)
    assert last.usage.completion_tokens == 8 and last.usage.prompt_tokens == whole.usage.prompt_tokens
    # The same templated prompt again: every full block but the last token's is cached.
    assert last.usage.prompt_tokens_details.cached_tokens == (whole.usage.prompt_tokens - 1) // 4 * 4


def test_streamed_completion_without_usage(tiny_worker: RunningWorker) -> None:
    stream = tiny_worker.client().completions.create(
        model=tiny_worker.model, prompt="Once upon", max_tokens=4, stream=True, **greedy()
    )
    chunks = list(stream)
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    with httpx.stream(
        "POST",
        f"{tiny_worker.url}/v1/completions",
        json={"prompt": "Once upon", "max_tokens": 2, "stream": True},
    ) as raw:
        assert raw.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in raw.iter_lines() if line]
    assert frames[-1] == "data: [DONE]" and all(f.startswith("data: ") for f in frames)


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


def test_logprobs(tiny_worker: RunningWorker) -> None:
    client = tiny_worker.client()
    done = client.completions.create(
        model=tiny_worker.model, prompt="abc", max_tokens=3, logprobs=2, **greedy()
    )
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(
        len(top) <= 2 and max(top.values()) >= logprob - 1e-6
        for top, logprob in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    chat = client.chat.completions.create(
        model=tiny_worker.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        **greedy(),
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    # Greedy: the sampled token is the most likely one.
    assert all(abs(c.logprob - c.top_logprobs[0].logprob) < 1e-6 for c in content)


def test_models_health_and_load(tiny_worker: RunningWorker) -> None:
    [model] = tiny_worker.client().models.list().data
    assert model.id == "tiny-llama" and model.owned_by == "prefixgate"
    health = httpx.get(f"{tiny_worker.url}/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny-llama"
    assert (health["block_size"], health["num_blocks"], health["max_context_len"]) == (4, 256, 512)
    assert (
        health["incarnation"] == tiny_worker.worker.events.incarnation
        and health["backend"] == "torch_sdpa"
        and health["backend_reason"].startswith("auto chose torch_sdpa: flash_attn cannot run")
    )
    assert load(tiny_worker) == {
        "running": 0,
        "waiting": 0,
        "queued_prefill_tokens": 0,
        "kv_blocks_used": 0,
        "kv_blocks_total": 256,
        "block_size": 4,
    }


# -- n > 1 choices -------------------------------------------------------------------------------

SEEDED = {"temperature": 1.0, "seed": 7, "extra_body": {"ignore_eos": True}}


def by_index(texts: list[tuple[int, str]]) -> dict[int, str]:
    joined: dict[int, str] = {}
    for index, text in texts:
        joined[index] = joined.get(index, "") + text
    return joined


def assert_offsets_run_per_choice(tokens: list[str], offsets: list[int]) -> None:
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_n_completion_choices_share_one_prompt(tiny_worker: RunningWorker) -> None:
    client = tiny_worker.client()
    ids = random_ids(18, seed=11)
    single = client.completions.create(model=tiny_worker.model, prompt=ids, max_tokens=5, **SEEDED)
    done = client.completions.create(
        model=tiny_worker.model, prompt=ids, max_tokens=5, n=3, logprobs=1, **SEEDED
    )
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in done.choices)
    # Choice 0 is the request itself; the others draw from seeds of their own.
    assert done.choices[0].text == single.choices[0].text
    assert len({c.text for c in done.choices}) == 3
    for c in done.choices:
        assert len(c.logprobs.tokens) == 5
        assert_offsets_run_per_choice(c.logprobs.tokens, c.logprobs.text_offset)
    # The prompt counts once; its 4 full blocks were cached by the single-choice request.
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (18, 15, 33)
    assert done.usage.prompt_tokens_details.cached_tokens == 16
    raw = httpx.post(f"{tiny_worker.url}/v1/completions", json={"prompt": ids, "max_tokens": 2, "n": 3})
    assert raw.headers["x-prefixgate-cached-tokens"] == "16"
    assert raw.json()["usage"]["completion_tokens"] == 6
    wait_for(lambda: idle(tiny_worker), "the worker to be idle")


def test_n_chat_choices_greedy_are_all_the_single_choice(tiny_worker: RunningWorker) -> None:
    client = tiny_worker.client()
    messages = [{"role": "user", "content": "Name three colours."}]
    single = client.chat.completions.create(
        model=tiny_worker.model, messages=messages, max_tokens=6, **greedy()
    )
    done = client.chat.completions.create(
        model=tiny_worker.model, messages=messages, max_tokens=6, n=3, **greedy()
    )
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert [c.message.content for c in done.choices] == [single.choices[0].message.content] * 3
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in done.choices)
    assert done.usage.prompt_tokens == single.usage.prompt_tokens and done.usage.completion_tokens == 18
    wait_for(lambda: idle(tiny_worker), "the worker to be idle")


def test_n_streamed_completion_choices(tiny_worker: RunningWorker) -> None:
    client = tiny_worker.client()
    ids = random_ids(22, seed=12)
    whole = client.completions.create(model=tiny_worker.model, prompt=ids, max_tokens=6, n=3, **SEEDED)
    chunks = list(
        client.completions.create(
            model=tiny_worker.model,
            prompt=ids,
            max_tokens=6,
            n=3,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
            **SEEDED,
        )
    )
    *body, last = chunks
    assert all(len(c.choices) == 1 and c.usage is None for c in body)
    texts = by_index([(c.choices[0].index, c.choices[0].text) for c in body])
    assert texts == {c.index: c.text for c in whole.choices}
    finishes = [(c.choices[0].index, c.choices[0].finish_reason) for c in body if c.choices[0].finish_reason]
    assert sorted(finishes) == [(0, "length"), (1, "length"), (2, "length")]
    for index in range(3):
        mine = [c.choices[0].logprobs for c in body if c.choices[0].index == index and c.choices[0].logprobs]
        tokens = [t for lp in mine for t in lp.tokens]
        assert len(tokens) == 6
        assert_offsets_run_per_choice(tokens, [o for lp in mine for o in lp.text_offset])
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (22, 18)
    with httpx.stream(
        "POST",
        f"{tiny_worker.url}/v1/completions",
        json={"prompt": ids, "max_tokens": 3, "n": 3, "stream": True},
    ) as raw:
        frames = [line for line in raw.iter_lines() if line]
    assert frames.count("data: [DONE]") == 1 and frames[-1] == "data: [DONE]"
    wait_for(lambda: idle(tiny_worker), "the worker to be idle")


def test_n_streamed_chat_choices_each_open_and_finish(tiny_worker: RunningWorker) -> None:
    client = tiny_worker.client()
    messages = [{"role": "user", "content": "Count to three."}]
    whole = client.chat.completions.create(
        model=tiny_worker.model, messages=messages, max_tokens=5, **greedy()
    )
    chunks = list(
        client.chat.completions.create(
            model=tiny_worker.model, messages=messages, max_tokens=5, n=3, stream=True, **greedy()
        )
    )
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:3]] == [
        (i, "assistant") for i in range(3)
    ]
    assert all(c.choices[0].delta.role is None for c in chunks[3:])
    contents = by_index([(c.choices[0].index, c.choices[0].delta.content or "") for c in chunks])
    assert contents == {i: whole.choices[0].message.content for i in range(3)}
    finishes = [
        (c.choices[0].index, c.choices[0].finish_reason) for c in chunks if c.choices[0].finish_reason
    ]
    assert sorted(finishes) == [(0, "length"), (1, "length"), (2, "length")]
    wait_for(lambda: idle(tiny_worker), "the worker to be idle")


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


def test_a_client_leaving_aborts_all_its_choices(make_worker: StartWorker) -> None:
    worker = make_worker()
    slow_down(worker, 0.02)
    body = {"prompt": random_ids(40, seed=13), "max_tokens": 200, "n": 3, "stream": True, **LONG}
    with (
        httpx.Client(base_url=worker.url, timeout=10) as client,
        client.stream("POST", "/v1/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        first_event(lines)
        busy = load(worker)
        assert busy["running"] == 3 and busy["kv_blocks_used"] > 0
    wait_for(lambda: idle(worker), "the worker to be idle", timeout=3)


# -- refusals -------------------------------------------------------------------------------------

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


def test_transport_level_refusals_are_openai_errors_too(tiny_worker: RunningWorker) -> None:
    too_big = httpx.post(
        f"{tiny_worker.url}/v1/completions", content=b'{"prompt": "' + b"a" * 100_000 + b'"}'
    )
    assert error_of(too_big, 413)["type"] == "invalid_request_error"
    error_of(httpx.get(f"{tiny_worker.url}/v1/nowhere"), 404)
    error_of(httpx.get(f"{tiny_worker.url}/v1/completions"), 405)
    for query in ("", "after=x", "after=-1", "after=0&timeout=500", "after=0&limit=0"):
        error_of(httpx.get(f"{tiny_worker.url}/kv/events?{query}"), 400)
    assert load(tiny_worker)["running"] == 0


# -- disconnects and backpressure -----------------------------------------------------------------


def test_a_client_leaving_mid_stream_aborts_its_sequence(make_worker: StartWorker) -> None:
    worker = make_worker()
    slow_down(worker, 0.02)
    body = {"prompt": random_ids(40, seed=3), "max_tokens": 400, "stream": True, **LONG}
    with (
        httpx.Client(base_url=worker.url, timeout=10) as client,
        client.stream("POST", "/v1/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        first = first_event(lines)
        assert '"text_completion"' in first
        busy = load(worker)
        assert busy["running"] == 1 and busy["kv_blocks_used"] > 0
    # 400 tokens at >= 20 ms a step would take 8 s: the sequence must be gone long before.
    wait_for(lambda: idle(worker), "the worker to be idle", timeout=3)
    metrics = httpx.get(f"{worker.url}/metrics").text
    assert 'prefixgate_worker_requests_total{endpoint="/v1/completions",status="499"} 1.0' in metrics


def test_a_client_leaving_a_non_streaming_request_aborts_it(make_worker: StartWorker) -> None:
    worker = make_worker()
    slow_down(worker, 0.02)
    body = {"prompt": random_ids(40, seed=4), "max_tokens": 400, **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{worker.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    wait_for(lambda: idle(worker), "the worker to be idle", timeout=3)


def test_an_over_full_queue_answers_429_with_retry_after(make_worker: StartWorker) -> None:
    worker = make_worker(EngineConfig(block_size=4, num_blocks=256, max_num_seqs=1), max_waiting=1)
    slow_down(worker, 0.02)
    hog = {"prompt": random_ids(20, seed=5), "max_tokens": 400, "stream": True, **LONG}
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=worker.url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=hog) as stream:
            lines = stream.iter_lines()
            first_event(lines)
            queued = pool.submit(
                httpx.post,
                f"{worker.url}/v1/completions",
                json={"prompt": "queued", "max_tokens": 2},
                timeout=20,
            )
            wait_for(lambda: load(worker)["waiting"] == 1, "one request waiting")
            refused = httpx.post(
                f"{worker.url}/v1/completions", json={"prompt": "one too many", "max_tokens": 2}
            )
            assert error_of(refused, 429)["code"] == "queue_full"
            assert int(refused.headers["Retry-After"]) >= 1
            with pytest.raises(openai.RateLimitError):
                worker.client().completions.create(model=worker.model, prompt="x", max_tokens=1)
        # The hog's client left: the queued request runs now.
        assert queued.result().status_code == 200
    assert worker.client().completions.create(model=worker.model, prompt="x", max_tokens=1).usage


# -- metrics ----------------------------------------------------------------------------------------


def samples(worker: RunningWorker) -> dict[tuple[str, tuple], float]:
    response = httpx.get(f"{worker.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def test_metrics_use_vllm_names_and_a_registry_per_app(make_worker: StartWorker) -> None:
    a, b = make_worker(), make_worker()
    slow_down(a, 0.02)
    ids = random_ids(24, seed=6)
    for _ in range(2):
        a.client().completions.create(model=a.model, prompt=ids, max_tokens=3, **greedy())
    model = (("model_name", "tiny-llama"),)
    with httpx.stream(
        "POST",
        f"{a.url}/v1/completions",
        json={"prompt": random_ids(30, seed=7), "max_tokens": 300, "stream": True, **LONG},
    ) as s:
        lines = s.iter_lines()
        first_event(lines)
        busy = samples(a)
    assert busy[("vllm:num_requests_running", model)] == 1
    assert busy[("vllm:num_requests_waiting", model)] == 0
    assert 0 < busy[("vllm:kv_cache_usage_perc", model)] <= 1
    assert busy[("prefixgate_worker_kv_blocks_total", model)] == 256
    assert (
        busy[("prefixgate_worker_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 2
    )
    assert busy[("prefixgate_worker_prompt_tokens_total", model)] == 48
    assert busy[("prefixgate_worker_generation_tokens_total", model)] == 6
    assert busy[("prefixgate_worker_prefix_cache_hit_tokens_total", model)] == 20
    assert busy[("prefixgate_worker_time_to_first_token_seconds_count", model)] == 3
    assert busy[("prefixgate_worker_e2e_request_latency_seconds_count", model)] == 2
    other = samples(b)
    assert (
        "prefixgate_worker_requests_total",
        (("endpoint", "/v1/completions"), ("status", "200")),
    ) not in other
    assert other[("vllm:num_requests_running", model)] == 0


# -- KV events --------------------------------------------------------------------------------------


class Consumer:
    """What a gateway does over HTTP: a snapshot, then the batches after it, by long-poll."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)
        snap = self.http.get("/kv/snapshot").json()
        self.incarnation, self.seq, self.cached = snap["incarnation"], snap["seq"], set(snap["hashes"])
        self.event_types: set[str] = set()

    def poll(self, timeout: float) -> int:
        response = self.http.get(
            "/kv/events", params={"after": self.seq, "timeout": timeout, "incarnation": self.incarnation}
        )
        assert response.status_code == 200, response.text
        body = response.json()
        batches = [EventBatch.from_json(b) for b in body["batches"]]
        assert [b.seq for b in batches] == list(range(self.seq + 1, self.seq + 1 + len(batches)))
        apply_batches(self.cached, batches)
        self.event_types |= {e.type for b in batches for e in b.events}
        if batches:
            self.seq = batches[-1].seq
        return body["seq"]

    def catch_up(self) -> None:
        while self.poll(0) != self.seq:
            pass


def test_an_event_consumer_holds_exactly_the_workers_cached_set(make_worker: StartWorker) -> None:
    """A random workload with shared prefixes over a pool small enough to evict."""
    worker = make_worker(EngineConfig(block_size=4, num_blocks=40, max_num_seqs=4))
    rng = random.Random(8)
    families = [random_ids(rng.randrange(8, 30), seed=100 + i) for i in range(4)]
    prompts = [rng.choice(families) + random_ids(rng.randrange(1, 12), seed=200 + i) for i in range(40)]
    live = Consumer(worker.url)
    stop = threading.Event()

    def follow() -> None:
        while not stop.is_set():
            live.poll(timeout=0.5)

    follower = threading.Thread(target=follow)
    follower.start()
    client = worker.client()
    with ThreadPoolExecutor(6) as pool:
        list(
            pool.map(
                lambda p: client.completions.create(
                    model=worker.model, prompt=p, max_tokens=rng.randrange(1, 6), **greedy()
                ),
                prompts,
            )
        )
    stop.set()
    follower.join()
    late = Consumer(worker.url)
    wait_for(lambda: idle(worker), "the worker to be idle")
    live.catch_up()
    late.catch_up()
    truth = set(worker.engine.block_manager.cached_hashes())
    assert live.cached == truth and late.cached == truth and truth
    assert {"stored", "removed"} <= live.event_types, "the small pool was meant to evict"
    replay: set[int] = set()
    everything = httpx.get(f"{worker.url}/kv/events", params={"after": 0, "limit": 100_000}).json()
    apply_batches(replay, [EventBatch.from_json(b) for b in everything["batches"]])
    assert everything["batches"][0]["events"] == [{"type": "cleared"}] and replay == truth


def test_a_long_poll_returns_as_soon_as_events_arrive(tiny_worker: RunningWorker) -> None:
    seq = httpx.get(f"{tiny_worker.url}/kv/snapshot").json()["seq"]
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        waiting = pool.submit(
            httpx.get, f"{tiny_worker.url}/kv/events", params={"after": seq, "timeout": 20}, timeout=30
        )
        time.sleep(0.2)
        assert not waiting.done()
        tiny_worker.client().completions.create(
            model=tiny_worker.model, prompt=random_ids(12, seed=9), max_tokens=1, **greedy()
        )
        body = waiting.result().json()
    assert time.monotonic() - started < 10
    assert body["batches"] and body["batches"][0]["seq"] == seq + 1
    assert any(e["type"] == "stored" for b in body["batches"] for e in b["events"])
    quiet = httpx.get(f"{tiny_worker.url}/kv/events", params={"after": body["seq"], "timeout": 0.2}).json()
    assert quiet["batches"] == []


def test_readers_too_far_behind_or_from_another_incarnation_get_410(make_worker: StartWorker) -> None:
    worker = make_worker(event_capacity=2)
    for i in range(3):
        worker.client().completions.create(
            model=worker.model, prompt=random_ids(9, seed=20 + i), max_tokens=1
        )
    current = httpx.get(f"{worker.url}/kv/snapshot").json()
    assert current["seq"] >= 4 and current["block_size"] == 4 and current["model"] == "tiny-llama"
    for params in (
        {"after": 0},
        {"after": current["seq"] + 5},
        {"after": current["seq"], "incarnation": "old"},
    ):
        gone = httpx.get(f"{worker.url}/kv/events", params=params)
        assert error_of(gone, 410)["code"] == "events_gone"
        assert gone.json()["seq"] == current["seq"] and gone.json()["incarnation"] == current["incarnation"]
    fresh = httpx.get(f"{worker.url}/kv/events", params={"after": current["seq"] - 1}).json()
    assert [b["seq"] for b in fresh["batches"]] == [current["seq"]]


# -- another engine behind the same server ------------------------------------------------------------


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
