"""Prefill/decode disaggregation between real workers over loopback: a decode worker pulls a prompt's
KV from a prefill worker, decodes exactly what a mixed worker would, keeps the blocks for later
prefix hits, and leaks nothing when the prefill side fails or the client leaves mid-transfer."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest

from bench.probes import wait_for
from protocol.disaggregation import PREFILL_ERROR_HEADER, TRANSFERRED_TOKENS_HEADER
from protocol.transfer_auth import grant, order_signature
from radix.hashing import block_hashes
from tests.support.workers import RunningWorker, StartWorker, idle, random_ids, slow_down
from workers.bundled_worker import Worker
from workers.engine.engine_core import EngineConfig
from workers.kv_event_log import KVEventLog
from workers.sim.profiles import CPU_SMOLLM2
from workers.sim.runner import VirtualClock
from workers.sim.sim_engine import SimEngine

CONFIG = EngineConfig(block_size=4, num_blocks=256)
# The fleet's KV transfer secret: every worker here holds it, and the tests sign as the gateway would.
SECRET = b"a-test-kv-transfer-secret"


def granted(prefill_url: str) -> dict:
    """A gateway's grant to pull a fresh transfer from `prefill_url`."""
    return grant(SECRET, prefill_url, uuid.uuid4().hex)


def complete(
    worker: RunningWorker, prompt: list[int], prefill: str | None = None, **extra: object
) -> httpx.Response:
    body: dict = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}
    if prefill is not None:
        body["prefixgate_prefill"] = granted(prefill)
    response = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response


def tokens_of(response: httpx.Response) -> str:
    return response.json()["choices"][0]["text"]


def cached_of(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture
def pair(make_worker: StartWorker) -> tuple[RunningWorker, RunningWorker, RunningWorker]:
    """A prefill worker, a decode worker and a mixed one, all on the same tiny model."""
    return (
        make_worker(CONFIG, role="prefill", transfer_secret=SECRET),
        make_worker(CONFIG, role="decode", transfer_secret=SECRET),
        make_worker(CONFIG),
    )


def test_roles_are_announced(pair: tuple[RunningWorker, RunningWorker, RunningWorker]) -> None:
    roles = [httpx.get(f"{w.url}/health").json()["role"] for w in pair]
    assert roles == ["prefill", "decode", "mixed"]


def test_decode_pulls_the_prompt_and_matches_a_mixed_worker(
    pair: tuple[RunningWorker, RunningWorker, RunningWorker],
) -> None:
    prefill, decode, mixed = pair
    for seed, length in ((1, 37), (2, 64), (3, 5)):
        prompt = random_ids(length, seed)
        pulled = complete(decode, prompt, prefill.url)
        assert tokens_of(pulled) == tokens_of(complete(mixed, prompt))
        reusable = (length - 1) // 4 * 4
        assert pulled.headers[TRANSFERRED_TOKENS_HEADER] == str(reusable)
        assert cached_of(pulled) == reusable
        assert PREFILL_ERROR_HEADER not in pulled.headers
    # The prefill worker keeps what it computed; the decode worker now holds it too, as a prefix hit.
    prompt = random_ids(37, 1)
    decode_hashes = block_hashes(prompt[:36], 4, decode.model)
    assert set(decode_hashes) <= decode.engine.block_manager.cached_hashes()
    assert set(decode_hashes) <= prefill.engine.block_manager.cached_hashes()
    again = complete(decode, [*prompt, 7, 8, 9], prefill.url)
    assert again.headers[TRANSFERRED_TOKENS_HEADER] == "0" and cached_of(again) == 36
    wait_for(lambda: idle(prefill) and idle(decode), "both workers to be idle")


def test_only_the_blocks_the_decode_worker_lacks_move(
    pair: tuple[RunningWorker, RunningWorker, RunningWorker],
) -> None:
    prefill, decode, _ = pair
    head = random_ids(16, 9)
    complete(decode, head)  # its 4 blocks cached on the decode worker (the 4th once decoding began)
    prompt = [*head, *random_ids(21, 10)]
    pulled = complete(decode, prompt, prefill.url)
    assert pulled.headers[TRANSFERRED_TOKENS_HEADER] == str(36 - 16)
    assert cached_of(pulled) == 36


def test_the_decode_side_streams_and_reports_cached_tokens(
    pair: tuple[RunningWorker, RunningWorker, RunningWorker],
) -> None:
    prefill, decode, mixed = pair
    prompt = random_ids(50, 4)
    body = {
        "prompt": prompt,
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prefixgate_prefill": granted(prefill.url),
    }
    with httpx.stream("POST", f"{decode.url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers[TRANSFERRED_TOKENS_HEADER] == "48"
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    assert text == tokens_of(complete(mixed, prompt, max_tokens=10))
    assert '"cached_tokens":48' in lines[-1]


def test_an_unreachable_prefill_worker_costs_only_time(
    pair: tuple[RunningWorker, RunningWorker, RunningWorker],
) -> None:
    _, decode, mixed = pair
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    prompt = random_ids(30, 5)
    served = complete(decode, prompt, dead)
    assert served.headers[TRANSFERRED_TOKENS_HEADER] == "0"
    assert "cannot connect" in served.headers[PREFILL_ERROR_HEADER].lower()
    assert tokens_of(served) == tokens_of(complete(mixed, prompt))
    assert cached_of(served) == 0
    wait_for(lambda: idle(decode), "the decode worker to be idle")
    metrics = httpx.get(f"{decode.url}/metrics").text
    assert 'prefixgate_worker_kv_pull_failures_total{model_name="tiny-llama"} 1.0' in metrics


def test_a_prefill_worker_refuses_a_decode_request(
    pair: tuple[RunningWorker, RunningWorker, RunningWorker],
) -> None:
    prefill, decode, _ = pair
    body = {"prompt": random_ids(9, 1), "max_tokens": 2, "prefixgate_prefill": {"url": decode.url}}
    refused = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prefixgate_prefill"
    bad = httpx.post(f"{decode.url}/v1/completions", json={**body, "prefixgate_prefill": "nope"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prefixgate_prefill"
    for order in ({"token_ids": []}, {"token_ids": [1, 2], "transfer": {"host": "h", "port": 0, "id": "x"}}):
        refused = httpx.post(f"{prefill.url}/kv/prefill", json=order, timeout=30)
        assert refused.status_code == 400, refused.text


class SilentServer:
    """A TCP server on loopback that accepts and then says nothing: a peer that hangs mid-protocol.
    Speaks just enough HTTP to stay open (it never answers)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


def test_a_client_leaving_mid_transfer_releases_the_reservation(
    pair: tuple[RunningWorker, RunningWorker, RunningWorker], silent: SilentServer
) -> None:
    _, decode, _ = pair
    prompt = random_ids(40, 6)
    body = {
        "prompt": prompt,
        "max_tokens": 4,
        "prefixgate_prefill": granted(f"http://127.0.0.1:{silent.port}"),
    }
    outcome: list[BaseException] = []

    def client() -> None:
        try:
            httpx.post(f"{decode.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.5))
        except httpx.ReadTimeout as error:
            outcome.append(error)

    leaving = threading.Thread(target=client)
    leaving.start()
    # The prompt's 9 reusable blocks are reserved while the (silent) prefill worker is waited for.
    wait_for(
        lambda: httpx.get(f"{decode.url}/load").json()["kv_blocks_used"] == 9,
        "the decode worker to reserve 9 blocks",
        timeout=5,
    )
    leaving.join()
    assert outcome, "the request should have hung until the client left"
    wait_for(lambda: idle(decode), "the decode worker to be idle", timeout=5)
    assert decode.engine.block_manager.num_cached_blocks == 0, "nothing arrived, nothing is registered"


def test_a_stalled_receiver_frees_the_prefill_sides_held_blocks(
    pair: tuple[RunningWorker, RunningWorker, RunningWorker], silent: SilentServer
) -> None:
    prefill, _, _ = pair
    ids, expires = random_ids(33, 7), time.time() + 60
    order = {
        "token_ids": ids,
        "transfer": {"host": "127.0.0.1", "port": silent.port, "id": "t"},
        "expires": expires,
        "sig": order_signature(SECRET, "t", "127.0.0.1", silent.port, 0, expires, ids),
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{prefill.url}/kv/prefill", json=order, timeout=httpx.Timeout(10, read=1.0))
    wait_for(lambda: idle(prefill), "the prefill worker to be idle", timeout=5)
    # It computed the prompt's 8 reusable blocks, which stay cached, and holds none of them any more.
    assert len(prefill.engine.block_manager.cached_hashes()) == 8


def test_simulated_workers_pair_up_with_hashes_and_no_bytes(serve: Callable[..., RunningWorker]) -> None:
    """The --sim engine has no tensors: a pair of simulated workers runs the same protocol, moving
    the hashes (and so the decode side's cache and events) but no bytes."""
    workers = []
    for role in ("prefill", "decode"):
        events = KVEventLog()
        sim = SimEngine(CPU_SMOLLM2, clock=VirtualClock(), **events.callbacks())
        worker = Worker.around(sim, events, worker_id=role, backend="sim", role=role, transfer_secret=SECRET)
        workers.append(serve(worker, sim))
    prefill, decode = workers
    prompt = random_ids(70, 11)
    pulled = complete(decode, prompt, prefill.url)
    assert pulled.headers[TRANSFERRED_TOKENS_HEADER] == "64" and cached_of(pulled) == 64
    hashes = block_hashes(prompt[:64], 16, decode.model)
    assert set(hashes) <= decode.engine.block_manager.cached_hashes()
    snapshot = httpx.get(f"{decode.url}/kv/snapshot").json()
    assert set(hashes) <= set(snapshot["hashes"])
    wait_for(lambda: idle(prefill) and idle(decode), "both workers to be idle")


def test_a_decode_worker_without_room_waits_for_it_rather_than_prefill_itself(
    make_worker: StartWorker,
) -> None:
    prefill = make_worker(CONFIG, role="prefill", transfer_secret=SECRET)
    decode = make_worker(EngineConfig(block_size=4, num_blocks=24), role="decode", transfer_secret=SECRET)
    slow_down(decode, 0.05)
    # An 80-token prompt holds 20 of the pool's 24 blocks (23 by its end) for 10 slow steps.
    hog = {"prompt": random_ids(80, 12), "max_tokens": 10, "ignore_eos": True}
    done: list[float] = []

    def run_hog() -> None:
        httpx.post(f"{decode.url}/v1/completions", json=hog, timeout=60).raise_for_status()
        done.append(time.monotonic())

    hogging = threading.Thread(target=run_hog)
    hogging.start()
    wait_for(
        lambda: httpx.get(f"{decode.url}/load").json()["running"] == 1, "the hog to run on the decode worker"
    )
    pulled = complete(decode, random_ids(37, 13), prefill.url, max_tokens=4)
    finished = time.monotonic()
    hogging.join()
    assert pulled.headers[TRANSFERRED_TOKENS_HEADER] == "36", pulled.headers.get(PREFILL_ERROR_HEADER)
    assert done and done[0] <= finished
    wait_for(lambda: idle(decode), "the decode worker to be idle")


def test_no_room_past_the_wait_computes_locally_without_blaming_the_prefill_worker(
    make_worker: StartWorker,
) -> None:
    prefill = make_worker(CONFIG, role="prefill", transfer_secret=SECRET)
    decode = make_worker(
        EngineConfig(block_size=4, num_blocks=24), role="decode", room_wait_s=0.2, transfer_secret=SECRET
    )
    slow_down(decode, 0.1)
    hog = {"prompt": random_ids(80, 14), "max_tokens": 10, "ignore_eos": True}
    hogging = threading.Thread(
        target=lambda: httpx.post(f"{decode.url}/v1/completions", json=hog, timeout=60).raise_for_status()
    )
    hogging.start()
    wait_for(
        lambda: httpx.get(f"{decode.url}/load").json()["running"] == 1, "the hog to run on the decode worker"
    )
    served = complete(decode, random_ids(37, 15), prefill.url, max_tokens=4)
    hogging.join()
    assert served.headers[TRANSFERRED_TOKENS_HEADER] == "0"
    assert PREFILL_ERROR_HEADER not in served.headers, "the decode worker's lack of room is its own"
    metrics = httpx.get(f"{decode.url}/metrics").text
    assert 'prefixgate_worker_kv_pull_failures_total{model_name="tiny-llama"} 1.0' in metrics
    wait_for(lambda: idle(decode) and idle(prefill), "both workers to be idle")
