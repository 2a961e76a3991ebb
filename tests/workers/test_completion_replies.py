"""How a worker's answers are written (workers.completion_replies), over real loopback HTTP on the
tiny random model: whole and streamed answers agree, logprobs, n > 1 choices each with its index,
and a client that leaves aborts every choice of its request; alone, how usage is counted and tokens
named."""

from __future__ import annotations

import httpx
import pytest

from bench.probes import wait_for
from protocol.openai_responses import usage_json
from tests.support.workers import RunningWorker, StartWorker, idle, load, random_ids, slow_down
from tests.workers.worker_http import LONG, first_event, greedy
from workers.completion_replies import Usage, engine_failed, token_decoder
from workers.engine.engine_core import RequestOutput
from workers.engine.loader import LoadedModel

# -- streams and logprobs ---------------------------------------------------------------------


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


# -- disconnects ------------------------------------------------------------------------------


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


# -- counting and naming tokens, without a server -----------------------------------------------------


def output(index: int, *, finished: bool, completion_tokens: int, cached: int = 8) -> RequestOutput:
    return RequestOutput(
        request_id=1,
        index=index,
        new_token_ids=[5],
        new_text="x",
        finished=finished,
        finish_reason="length" if finished else None,
        prompt_tokens=12,
        cached_tokens=cached,
        completion_tokens=completion_tokens,
    )


def test_usage_counts_the_prompt_once_and_each_choice_when_it_finishes() -> None:
    usage = Usage(2)
    usage.add(output(0, finished=False, completion_tokens=1))
    usage.add(output(1, finished=False, completion_tokens=1))
    assert (usage.unfinished, usage.completion_tokens, usage.prompt_tokens) == (2, 0, 12)
    usage.add(output(0, finished=True, completion_tokens=3))
    usage.add(output(1, finished=True, completion_tokens=4, cached=4))
    assert usage.unfinished == 0
    assert usage.json() == usage_json(12, 7, 4), "the last delta's cached count stands"
    assert usage.json()["total_tokens"] == 19


def test_a_token_is_named_by_the_tokenizer_or_else_by_its_id(tiny: tuple[object, LoadedModel]) -> None:
    tokenizer = tiny[1].tokenizer
    ids = tokenizer.encode("Hello there")
    decode = token_decoder(tokenizer)
    assert [decode(i) for i in ids] == [tokenizer.decode([i]) for i in ids]
    assert token_decoder(None)(4021) == "4021"


def test_a_failed_engine_step_is_the_workers_500_naming_the_failure() -> None:
    error = engine_failed(RuntimeError("CUDA error: out of memory"))
    assert (error.status, error.code, error.type) == (500, "engine_error", "server_error")
    assert error.message == "the engine failed: CUDA error: out of memory"
