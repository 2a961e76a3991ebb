"""A replica's KV-event publisher cannot break the gateway's ZMQ follower (issue 20, item 8): messages
over the size bound, garbage, ill-typed or nested msgpack and frames that are not vLLM's are counted
and skipped, and the good event after them is applied.

The publisher is a real PUB socket with a ROUTER answering replays, run by a thread of the test; the
gateway follows it for a foreign backend declared with `kv_events`, as it would a vLLM server."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import msgspec
import zmq
from aiohttp import web

from bench.probes import wait_for
from protocol.vllm_kv_events import MAX_PAYLOAD_BYTES, REPLAY_END
from radix.hashing import block_hashes
from tests.support.gateways import SIM_MODEL, RunningGateway, foreign_backend
from tests.support.servers import distinct_ports

BS = 16


class Publisher:
    """vLLM's publisher, by hand: `[topic, seq, payload]` on a PUB, numbered from 0, each kept for the
    ROUTER that answers replays. Sends from the test's thread; a thread of its own serves replays."""

    def __init__(self, pub_port: int, replay_port: int) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self.replay_port = replay_port
        self.buffer: list[tuple[int, bytes]] = []
        self.next_seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def send(self, *frames: bytes) -> None:
        self.pub.send_multipart(list(frames))

    def publish(self, payload: bytes, topic: bytes = b"kv-events") -> None:
        with self._lock:
            seq, self.next_seq = self.next_seq, self.next_seq + 1
            self.buffer.append((seq, payload))
        self.send(topic, seq.to_bytes(8, "big"), payload)

    def _serve(self) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                client, _, start = router.recv_multipart()
                with self._lock:
                    held = [(s, p) for s, p in self.buffer if s >= int.from_bytes(start, "big")]
                for seq, payload in held:
                    router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
                router.send_multipart([client, b"", REPLAY_END, b""])
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.close(linger=0)
        self.ctx.term()


@contextmanager
def publisher() -> Iterator[tuple[Publisher, int, int]]:
    pub_port, replay_port = distinct_ports(2)
    pub = Publisher(pub_port, replay_port)
    try:
        yield pub, pub_port, replay_port
    finally:
        pub.close()


def batch(*events: Any) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events), 0])


def stored(tokens: list[int], hashes: list[Any], parent: Any = None, **fields: Any) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    } | fields


def rejected(gateway: RunningGateway) -> float:
    response = httpx.get(f"{gateway.url}/metrics", timeout=10)
    assert response.status_code == 200
    found = re.search(
        r'^prefixgate_gateway_rejected_entries_total\{source="zmq"\} (\S+)$', response.text, re.M
    )
    return float(found.group(1)) if found else 0.0


def holds(gateway: RunningGateway, tokens: list[int]) -> bool:
    index = gateway.state.index
    return all(index.holds("vllm", h) for h in block_hashes(tokens, BS, SIM_MODEL))


def test_bad_messages_are_counted_and_the_next_good_event_is_applied(
    start_gateway: Callable[..., RunningGateway],
) -> None:
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"id": "c", "object": "text_completion", "model": SIM_MODEL, "choices": []})

    first, second, third = (list(range(base, base + 2 * BS)) for base in (1000, 2000, 3000))
    with publisher() as (pub, pub_port, replay_port), foreign_backend(SIM_MODEL, answer) as url:
        entry = {
            "url": url,
            "id": "vllm",
            "kind": "openai",
            "kv_events": f"tcp://127.0.0.1:{pub_port}",
            "kv_events_replay": f"tcp://127.0.0.1:{replay_port}",
        }
        gateway = start_gateway([], wait_for=1, replicas=[entry])
        state = gateway.gw.zmq_sync.states["vllm"]
        wait_for(lambda: state.connected, "the follower to connect")
        time.sleep(0.2)  # the subscription reaches the publisher
        pub.publish(batch(stored(first, [1, 2])))
        wait_for(lambda: holds(gateway, first), "the first good event")

        deep = b"\x93\xcb" + msgspec.msgpack.encode(1.0)[1:] + b"\x91" * 100_000 + b"\xc0" + b"\x00"
        bad_payloads = [
            b"\xc1 not msgpack",
            msgspec.msgpack.encode({"not": "a batch"}),
            batch(stored(first, "not a list")),
            batch(stored([-1] * BS, [3])),
            batch(stored(first, [3, 4], block_size="sixteen")),
            batch(["BlockStored", [[1, 2]], None, first, BS, None]),
            batch(["NoSuchEvent", 1]),
            deep,
        ]
        for payload in bad_payloads:
            pub.publish(payload)
        pub.send(b"kv-events", b"\x00" * 3, batch())  # a seq that is not 8 bytes
        pub.send(b"kv-events", b"\x00" * 8)  # two frames
        pub.send(
            b"t" * (MAX_PAYLOAD_BYTES // 2 + 1), (99).to_bytes(8, "big"), b"p" * (MAX_PAYLOAD_BYTES // 2)
        )
        pub.publish(batch(stored(second, [5, 6])))
        wait_for(lambda: holds(gateway, second), "the good event after the bad ones")
        assert not holds(gateway, first), (
            "a malformed batch may have removed blocks: the entries were cleared"
        )
        assert rejected(gateway) == len(bad_payloads) + 3

        # A frame over the socket's bound: libzmq drops the connection, the follower comes back.
        pub.publish(b"x" * (MAX_PAYLOAD_BYTES + 1))
        wait_for(lambda: not state.connected, "the oversize frame to drop the connection")
        wait_for(lambda: state.connected, "the follower to reconnect")
        wait_for(lambda: state.seq is None, "the replay that cannot be read to clear the entries")
        time.sleep(0.2)
        pub.publish(batch(stored(third, [7, 8])))
        wait_for(lambda: holds(gateway, third), "the good event after the oversize one")

        body = {"model": SIM_MODEL, "prompt": [*third, 1, 2, 3], "max_tokens": 1}
        response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=10)
        assert response.status_code == 200
        assert response.headers["x-prefixgate-matched-blocks"] == "2"
        index = gateway.state.index
        assert len(index) == index.blocks_of("vllm") == 2
