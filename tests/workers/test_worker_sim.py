"""`prefixgate worker --sim`: the flags build a simulated engine with the pool asked for, and the worker
they build serves the OpenAI API (token-id prompts) with prefix caching, load and snapshots."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterator

import httpx
import openai
import pytest

from prefixgate.cli import build_parser
from tests.support.servers import ServerThread
from workers.bundled_worker import Worker
from workers.kv_event_log import KVEventLog
from workers.sim.profiles import get_profile
from workers.worker_app import create_app
from workers.worker_cli import advertise_url, build_engine, build_worker, engine_config, extra_contexts


def parse(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["worker", *flags])


def test_sim_flags_choose_the_profile_and_override_its_pool() -> None:
    default = get_profile("cpu-smollm2")
    sim, backend, reason = build_engine(parse("--sim"), KVEventLog())
    bm = sim.block_manager
    assert (backend, sim.model_name) == ("sim", default.model_name) and "cost model" in reason
    assert (bm.block_size, bm.num_blocks) == (default.block_size, default.num_blocks)
    big = get_profile("h100-8b")
    sim, _, _ = build_engine(parse("--sim", "--sim-profile", "h100-8b"), KVEventLog())
    assert (sim.block_manager.block_size, sim.block_manager.num_blocks) == (big.block_size, big.num_blocks)
    sim, _, _ = build_engine(parse("--sim", "--sim-profile", "h100-8b", "--block-size", "16"), KVEventLog())
    # A new block size keeps the profile's KV memory: the same tokens in more, smaller blocks.
    assert (sim.block_manager.block_size, sim.block_manager.num_blocks) == (16, big.kv_capacity_tokens // 16)
    sim, _, _ = build_engine(parse("--sim", "--num-blocks", "40"), KVEventLog())
    assert (sim.block_manager.block_size, sim.block_manager.num_blocks) == (default.block_size, 40)
    for bad in (("--sim", "--kv-memory", "1G"), ("--sim", "--sim-profile", "no-such-gpu")):
        with pytest.raises(SystemExit):
            build_engine(parse(*bad), KVEventLog())
    assert engine_config(parse()).block_size == 16  # the real engine's default is unchanged


def test_redis_flags() -> None:
    assert extra_contexts(parse()) == []
    assert len(extra_contexts(parse("--redis", "redis://127.0.0.1:1/0"))) == 1
    assert advertise_url(parse("--port", "8123")) == "http://127.0.0.1:8123"
    assert advertise_url(parse("--host", "0.0.0.0", "--port", "9")) == f"http://{socket.gethostname()}:9"
    assert advertise_url(parse("--host", "::1", "--port", "9")) == "http://[::1]:9"
    assert advertise_url(parse("--advertise-url", "http://lb.example:80/")) == "http://lb.example:80"
    for bad in (("--heartbeat", "0"), ("--load-period", "-1"), ("--stream-maxlen", "0")):
        with pytest.raises(SystemExit):
            parse(*bad)


@pytest.fixture(scope="module")
def sim_worker() -> Iterator[tuple[str, Worker]]:
    args = parse(
        "--sim", "--sim-profile", "h100-8b", "--block-size", "16", "--num-blocks", "64", "--id", "s1"
    )
    worker = build_worker(args)
    server = ServerThread(create_app(worker, contexts=extra_contexts(args)))
    yield server.start(), worker
    server.stop()


def ids(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def test_the_sim_worker_answers_the_official_client(sim_worker: tuple[str, Worker]) -> None:
    url, worker = sim_worker
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = worker.info.model
    health = httpx.get(f"{url}/health").json()
    assert (health["worker_id"], health["backend"], health["num_blocks"]) == ("s1", "sim", 64)
    greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}

    cold = client.completions.create(model=model, prompt=ids(40, 100), max_tokens=5, **greedy)
    assert cold.choices[0].text and cold.choices[0].finish_reason == "length"
    assert (cold.usage.prompt_tokens, cold.usage.completion_tokens) == (40, 5)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    # The same first 32 tokens (two blocks of 16), another tail: both blocks come from the cache.
    warm = client.completions.create(model=model, prompt=ids(32, 100) + ids(9, 5000), max_tokens=3, **greedy)
    assert warm.usage.prompt_tokens_details.cached_tokens == 32

    stream = client.completions.create(
        model=model,
        prompt=ids(32, 100) + ids(20, 7000),
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        **greedy,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(text.split()) == 4
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 4
    assert usage.prompt_tokens_details.cached_tokens == 32

    refused = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "text", "max_tokens": 2})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "token_ids_required"


def test_the_sim_worker_reports_load_and_snapshot(sim_worker: tuple[str, Worker]) -> None:
    url, worker = sim_worker
    body = {"prompt": ids(48, 20000), "max_tokens": 2, "ignore_eos": True}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    load = httpx.get(f"{url}/load").json()
    assert (load["running"], load["waiting"], load["kv_blocks_total"], load["block_size"]) == (0, 0, 64, 16)
    snapshot = httpx.get(f"{url}/kv/snapshot").json()
    assert snapshot["incarnation"] == worker.events.incarnation and snapshot["block_size"] == 16
    assert len(snapshot["hashes"]) >= 3  # at least this request's three full blocks
    assert set(snapshot["hashes"]) == worker.front.engine.block_manager.cached_hashes()
