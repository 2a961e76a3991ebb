"""The bundled worker's KV events in vLLM's wire format: a simulated worker started as
`prefixgate worker --kv-events-zmq` publishes batches that any vLLM subscriber reads (numbered from 0,
the tokens of every stored block), and its replay socket answers vLLM's replay protocol."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import zmq

from prefixgate.cli import build_parser
from protocol.vllm_kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    read_pub_frames,
    read_replay_answer,
    replay_request,
)
from radix.hashing import chain_hashes, root_hash
from tests.support.servers import ServerThread, distinct_ports
from workers.app_state import RUNTIME
from workers.bundled_worker import Worker
from workers.kv_event_log import KVEventLog
from workers.worker_app import create_app
from workers.worker_cli import build_worker, extra_contexts
from workers.zmq_publisher import ZmqPublisher, ZmqPublisherConfig

BLOCK_SIZE = 16


@dataclass
class ZmqWorker:
    url: str
    worker: Worker
    endpoint: str
    replay: str

    def complete(self, prompt: list[int], max_tokens: int = 2) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text

    def snapshot(self) -> set[int]:
        return set(httpx.get(f"{self.url}/kv/snapshot", timeout=10).json()["hashes"])


@pytest.fixture
def zmq_worker() -> Iterator[ZmqWorker]:
    """A simulated worker on a 24-block pool (it evicts), built from its command line."""
    port, pub, replay = distinct_ports(3)
    args = build_parser().parse_args(
        [
            "worker", "--sim", "--sim-profile", "h100-8b", "--block-size", str(BLOCK_SIZE),
            "--num-blocks", "24", "--port", str(port), "--kv-events-zmq", f"tcp://127.0.0.1:{pub}",
            "--kv-events-replay", f"tcp://127.0.0.1:{replay}",
        ]
    )  # fmt: skip
    worker = build_worker(args)
    server = ServerThread(create_app(worker, contexts=extra_contexts(args)), port=port)
    url = server.start()
    yield ZmqWorker(url, worker, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    server.stop()


def replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol from a DEALER: every buffered batch from `start`, up to the end marker."""
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart(replay_request(start))
        answers = []
        while dealer.poll(5000):
            answer = read_replay_answer(dealer.recv_multipart())
            if answer is None:
                return answers
            answers.append(answer)
    raise AssertionError("the replay socket did not finish its answer")


def replayed_set(batches: list[KVEventBatch], model: str) -> set[int]:
    """What a vLLM subscriber that re-hashes every stored block holds after these batches: it must be
    the worker's own cached set, the worker's hashes being docs/design.md §3's chain over the same tokens."""
    held: set[int] = set()
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent = root_hash(model) if event.parent_block_hash is None else event.parent_block_hash
                assert isinstance(parent, int)
                assert chain_hashes(parent, event.token_ids, event.block_size) == event.block_hashes
                assert (event.block_size, event.medium, event.lora_id) == (BLOCK_SIZE, "GPU", None)
                held.update(h for h in event.block_hashes if isinstance(h, int))
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            else:
                held.clear()
    return held


def test_the_worker_publishes_vllm_batches_that_replay_to_its_cached_set(zmq_worker: ZmqWorker) -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(zmq_worker.endpoint)
        family = list(range(1000, 1040))
        zmq_worker.complete(family)  # until the subscription is through, messages are not for it
        for i in range(12):
            zmq_worker.complete([*family[: 8 + i], *range(2000 + 100 * i, 2040 + 100 * i)])
        live = []
        while sub.poll(500):
            topic, seq, payload = read_pub_frames(sub.recv_multipart())
            live.append((seq, payload))
        assert topic == b"" and live
    history = replay(zmq_worker.replay, 0)
    seqs = [seq for seq, _ in history]
    assert seqs == list(range(len(history))), "numbered from 0 without a hole"
    assert set(live) <= set(history), "the live messages are the buffered ones, byte for byte"
    batches = [decode_batch(payload) for _, payload in history]
    assert batches[0].events == [AllBlocksCleared()], "a fresh publisher starts from nothing"
    assert any(isinstance(e, BlockRemoved) for b in batches for e in b.events), "the pool was meant to evict"
    assert replayed_set(batches, zmq_worker.worker.info.model) == zmq_worker.snapshot()


def test_replay_answers_from_any_seq_and_survives_a_bad_request(zmq_worker: ZmqWorker) -> None:
    for i in range(3):
        zmq_worker.complete(list(range(100 * i, 100 * i + 40)))
    history = replay(zmq_worker.replay, 0)
    assert len(history) >= 4
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(zmq_worker.replay)
        dealer.send_multipart([b"", b"not eight bytes"])
        assert not dealer.poll(300), "a malformed request gets no answer"
    assert replay(zmq_worker.replay, 2) == history[2:]
    assert replay(zmq_worker.replay, len(history) + 5) == []


@pytest.mark.parametrize("keep_tokens", [False, True])
def test_the_command_line_wires_a_log_that_keeps_tokens(keep_tokens: bool) -> None:
    """vLLM's events carry every stored block's tokens: the log keeps them exactly when it publishes
    them, and a publisher refuses a log that does not."""
    flags = ["--kv-events-zmq", "tcp://*:5557"] if keep_tokens else []
    args = build_parser().parse_args(["worker", "--sim", *flags])
    worker = build_worker(args)
    try:
        assert worker.events.keep_tokens is keep_tokens
        assert len(extra_contexts(args)) == int(keep_tokens)
        if not keep_tokens:
            runtime = create_app(worker)[RUNTIME]
            with pytest.raises(ValueError, match="keep_tokens"):
                ZmqPublisher(runtime, ZmqPublisherConfig("tcp://127.0.0.1:1", None))
    finally:
        worker.front.shutdown()


def test_a_log_that_keeps_tokens_speaks_the_same_json() -> None:
    """The tokens are for the vLLM-format publisher alone: HTTP and Redis readers see no change."""
    plain, keeping = KVEventLog(incarnation="i"), KVEventLog(incarnation="i", keep_tokens=True)
    plain.on_stored([1, 2], 9)
    keeping.on_stored_tokens([1, 2], 9, list(range(2 * BLOCK_SIZE)))
    assert plain.seal().to_json() == keeping.seal().to_json()  # type: ignore[union-attr]
    assert plain.snapshot() == keeping.snapshot()


def test_the_command_line_refuses_an_address_that_is_not_zmqs() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--sim", "--kv-events-zmq", "http://127.0.0.1:5557"])
