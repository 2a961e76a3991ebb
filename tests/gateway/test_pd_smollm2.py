"""Prefill/decode disaggregation end to end on this CPU: the gateway in front of one SmolLM2 prefill
worker and one SmolLM2 decode worker, through the official client. The answers are the greedy tokens
a mixed worker gives for the same requests, the decode side reports the transferred prompt as cached,
and both pools are all free afterwards, also when a client leaves while the KV is on its way."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from bench.probes import wait_for
from gateway.gateway_config import parse_config
from gateway.http.app import create_app
from protocol.disaggregation import TRANSFERRED_TOKENS_HEADER
from protocol.transfer_auth import SECRET_ENV
from tests.support.servers import ServerThread
from tests.support.workers import RunningWorker, idle, serve_worker, slow_down
from workers.bundled_worker import Worker
from workers.engine.engine_core import Engine, EngineConfig
from workers.engine.llm import load
from workers.kv_event_log import KVEventLog

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = (
    "You are a meticulous assistant for a team that maintains a prefix-aware gateway for language "
    "model fleets. Answer in one short sentence. "
) * 12


@dataclass
class PdFleet:
    """The module's workers and gateway, served in this process (ServerThreads, not processes)."""

    prefill: RunningWorker
    decode: RunningWorker
    mixed: RunningWorker
    gateway: str

    def client(self, url: str | None = None, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{url or self.gateway}/v1", api_key="none", max_retries=0, **kwargs)


SECRET = "a-test-kv-transfer-secret"


@pytest.fixture(scope="module")
def fleet() -> Iterator[PdFleet]:
    # The fleet's KV transfer secret, where the gateway reads it; the workers are given it.
    with pytest.MonkeyPatch.context() as env:
        env.setenv(SECRET_ENV, SECRET)
        yield from _fleet()


def _fleet() -> Iterator[PdFleet]:
    loaded = load()
    servers: list[ServerThread] = []
    workers = {}
    for role in ("prefill", "decode", "mixed"):
        events = KVEventLog()
        engine = Engine(loaded, EngineConfig(block_size=16, num_blocks=256), **events.callbacks())
        worker = Worker.around(
            engine, events, worker_id=role, backend="torch_sdpa", role=role, transfer_secret=SECRET.encode()
        )
        workers[role], server = serve_worker(worker, engine)
        servers.append(server)
    config = {
        "replicas": [{"url": workers["prefill"].url}, {"url": workers["decode"].url}],
        "models": {MODEL: {"tokenizer": "default"}},
        "health": {"interval_s": 0.2, "load_interval_s": 0.05},
    }
    gateway = ServerThread(create_app(parse_config(config)))
    servers.append(gateway)
    url = gateway.start()
    wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, "the gateway to be healthy", timeout=30)
    yield PdFleet(workers["prefill"], workers["decode"], workers["mixed"], url)
    for server in servers:
        server.stop()


def ask(client: openai.OpenAI, question: str) -> tuple[str, int, httpx.Headers]:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=16,
        temperature=0,
    )
    completion = raw.parse()
    return (
        completion.choices[0].message.content or "",
        completion.usage.prompt_tokens_details.cached_tokens,
        raw.headers,
    )


def test_paired_answers_are_the_mixed_workers_and_the_prompt_arrives_cached(fleet: PdFleet) -> None:
    via_gateway, direct = fleet.client(), fleet.client(fleet.mixed.url)
    for i, question in enumerate(("What does the gateway route by?", "Name one cache eviction order.")):
        text, cached, headers = ask(via_gateway, question)
        assert headers["x-prefixgate-replica"] == "decode"
        expected, _, _ = ask(direct, question)
        assert text == expected and text
        moved = int(headers.get(TRANSFERRED_TOKENS_HEADER, "0"))
        if i == 0:
            assert headers["x-prefixgate-prefill-replica"] == "prefill"
            assert moved > 256 and cached == moved, "the cold decode side got the whole prompt by transfer"
        else:
            # The system prompt is on the decode worker now: what is left is computed there, unpaired.
            assert cached >= 256 and moved == 0
            assert "x-prefixgate-prefill-replica" not in headers
    wait_for(lambda: idle(fleet.prefill) and idle(fleet.decode), "both workers to be idle")
    decode_metrics = httpx.get(f"{fleet.decode.url}/metrics").text
    assert "prefixgate_worker_kv_transfer_received_bytes_total" in decode_metrics


def test_a_client_leaving_mid_transfer_frees_both_pools(fleet: PdFleet) -> None:
    slow_down(fleet.prefill, 0.5)
    reserved: list[int] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            reserved.append(httpx.get(f"{fleet.decode.url}/load").json()["kv_blocks_used"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        leaving = fleet.client(timeout=openai.Timeout(30, read=1.0))
        with pytest.raises(openai.APITimeoutError):
            ask(leaving, "A question nobody waits for the answer to, about " + "caches " * 40)
        watching.set()
        watcher.join()
        assert max(reserved) > 0, "the decode worker held a reservation while the prefill ran"
        wait_for(lambda: idle(fleet.prefill) and idle(fleet.decode), "both workers to be idle", timeout=15)
    finally:
        del fleet.prefill.engine.step  # slow_down's instance attribute: the class's step again
    time.sleep(0.1)
    assert fleet.decode.engine.block_manager.num_used_blocks == 0
    assert fleet.prefill.engine.block_manager.num_used_blocks == 0
