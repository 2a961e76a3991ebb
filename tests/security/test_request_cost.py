"""What one request may cost the gateway is bounded (issue 20, item 5): a prompt of a million token
ids, or of megabytes of text, is routed by its head (hashed, matched, recorded and published only that
far) and forwarded whole, for the replica to judge; partial ids never reach a bundled worker; and long
prompts tokenize behind one another, never in front of a short one."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
import redis

from bench.probes import wait_for
from protocol.models import load_tokenizer_spec
from protocol.redis_keys import PREDICTIONS
from tests.support.gateways import SIM_MODEL, RecordingBackend, RunningGateway, SimWorker

MILLION_IDS = [1 + (7 * i) % 49_000 for i in range(1_000_000)]
# Made-up words, which SmolLM2's tokenizer splits into several tokens each and a words worker counts
# as one: whose tokenization a worker used shows in its usage.
WORDS = ["zorvex", "quintalor", "brimmeth", "oxtravine", "pellucidar", "vantrosk", "glimmerq"]


def words(count: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(count))


def post(gateway: RunningGateway, path: str, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}{path}",
        content=orjson.dumps(body),
        headers={"Content-Type": "application/json"},
        timeout=timeout,
    )


def sound(gateway: RunningGateway, model: str) -> None:
    """The next client is served, and /metrics renders."""
    response = post(gateway, "/v1/completions", {"model": model, "prompt": [1, 2, 3], "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert httpx.get(f"{gateway.url}/metrics", timeout=10).status_code == 200


@pytest.mark.parametrize("form", ["prompt", "prefixgate_token_ids"])
def test_a_million_ids_are_forwarded_whole_and_recorded_and_published_by_their_head(
    form: str,
    redis_url: str,
    start_sim_worker: Callable[..., SimWorker],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    """1M ids, as a completion's prompt or a chat's `prefixgate_token_ids`, used to be 62,500 hashes in
    the index and a 1.5 MB entry in the shared predictions stream; now the first max_routed_tokens
    (128k by default) are. The worker gets all the ids the client sent, and its context limit answers."""
    # Room in the index for every block routed on (its capacity is the worker's pool).
    worker = start_sim_worker("w", "--num-blocks", "10000")
    routing = {"policy": "prefix_aware", "prefix_aware": {"mode": "approximate"}}
    gateway = start_gateway([worker.url], redis={"url": redis_url, "poll_interval_s": 0.05}, routing=routing)
    if form == "prompt":
        path, body = "/v1/completions", {"prompt": MILLION_IDS}
    else:
        messages = [{"role": "user", "content": "hi"}]
        path, body = "/v1/chat/completions", {"messages": messages, "prefixgate_token_ids": MILLION_IDS}
    response = post(gateway, path, {"model": SIM_MODEL, "max_tokens": 1, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"the prompt has {len(MILLION_IDS)} tokens" in error["message"]

    limit = gateway.state.config.limits.max_routed_tokens
    assert limit == 131_072
    assert gateway.state.index.blocks_of("w") == limit // 16
    client = redis.Redis.from_url(redis_url)
    mine = gateway.state.predictions.gateway_id.encode()

    def published() -> list[dict[bytes, bytes]]:
        entries = client.xrevrange(PREDICTIONS, count=100)
        return [fields for _, fields in entries if fields.get(b"gateway") == mine]

    (entry,) = wait_for(published, "the prediction to reach Redis", timeout=5)
    assert len(json.loads(entry[b"hashes"])) == limit // 16
    assert sum(len(k) + len(v) for k, v in entry.items()) < 200_000
    sound(gateway, SIM_MODEL)


def test_a_text_past_the_bound_routes_by_its_head_and_the_worker_tokenizes_it(
    start_sim_worker: Callable[..., SimWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    """A cut prompt's head still names its prefix: it goes to the worker holding it. The gateway's ids
    of that head are not the prompt's, so none are attached: the worker tokenizes the text itself
    (a words worker counts words, where the gateway's ids would count SmolLM2 tokens)."""
    workers = [start_sim_worker(f"w{i}", "--sim-tokenizer", "words") for i in range(2)]
    gateway = start_gateway([w.url for w in workers], limits={"max_tokenized_chars": 4096})
    smol = load_tokenizer_spec("default")
    assert smol is not None
    prefix = words(300, seed=1)
    assert len(prefix) < 4096

    def complete(prompt: str) -> httpx.Response:
        body = {"model": SIM_MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        response = post(gateway, "/v1/completions", body)
        assert response.status_code == 200, response.text
        return response

    first = complete(prefix)
    holder = first.headers["x-prefixgate-replica"]
    # Tokenized whole by the gateway: its ids were attached, and the worker counted those.
    assert first.json()["usage"]["prompt_tokens"] == len(smol.encode(prefix))
    blocks = len(smol.encode(prefix)) // 16
    wait_for(lambda: gateway.state.index.blocks_of(holder) >= blocks, "the holder's KV events", timeout=5)

    long = prefix + " " + words(3000, seed=2)
    again = complete(long)
    assert again.headers["x-prefixgate-replica"] == holder
    assert int(again.headers["x-prefixgate-matched-blocks"]) >= blocks - 1
    assert again.json()["usage"]["prompt_tokens"] == len(long.split())
    sound(gateway, SIM_MODEL)


def test_long_prompts_never_hold_up_a_short_one(
    recording_backend: Callable[..., tuple[RecordingBackend, str]],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    """Four prompts of about 1 MB each used to take the one tokenizer thread (and, holding the GIL,
    the event loop) for seconds, and a short request waited behind all of them."""
    backend, url = recording_backend("a")
    gateway = start_gateway([url], models={"foreign-m": {"tokenizer": "default"}})
    wait_for(lambda: gateway.state.tokenizers.is_loaded("foreign-m"), "the tokenizer", timeout=5)
    finished: dict[str, float] = {}
    statuses: dict[str, int] = {}

    def chat(name: str, content: str) -> None:
        body = {"model": "foreign-m", "messages": [{"role": "user", "content": content}], "max_tokens": 1}
        statuses[name] = post(gateway, "/v1/chat/completions", body).status_code
        finished[name] = time.monotonic()

    # Under the recording backend's own body limit (aiohttp's 1 MiB), as the report's were.
    bigs = [
        threading.Thread(target=chat, args=(f"big{i}", words(110_000, seed=10 + i)[:900_000]))
        for i in range(4)
    ]
    for thread in bigs:
        thread.start()
    wait_for(lambda: gateway.state.inflight == 4, "the four long prompts to be in flight", timeout=20)
    chat("small", "What is the capital of France?")
    for thread in bigs:
        thread.join(timeout=60)
    assert statuses == {name: 200 for name in ("big0", "big1", "big2", "big3", "small")}
    assert finished["small"] < min(finished[f"big{i}"] for i in range(4)), finished
    assert len(backend.received) == 5
    sound(gateway, "foreign-m")
