"""A gateway process's link to its siblings, in-process over a real socket pair: what it tells them of
its own accounting (batched into one frame per loop turn), what their messages change here, and a
malformed message skipped and counted while the ones beside it still apply."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field
from typing import Any

import msgspec
from redis.asyncio import Redis

from gateway.fleet.predictions import Predictions
from gateway.fleet.replicas import Replica, Source
from gateway.fleet.response_owners import ResponseOwners
from gateway.gateway_config import ReplicaEntry, parse_config
from gateway.gateway_state import GatewayState
from gateway.sync.sibling_wire import EVERYONE, HEADER, frame, read_frame
from gateway.sync.siblings import Siblings
from tests.support.replicas import replica


@dataclass
class Lifecycle:
    """The part of gateway.gateway.Gateway a sibling's messages act on, recording the calls."""

    state: GatewayState
    redis: Redis | None = None
    added: list[ReplicaEntry] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    async def add_entry(self, entry: ReplicaEntry, source: Source) -> Replica | None:
        self.added.append(entry)
        return None

    async def deactivate(self, replica_id: str) -> Replica | None:
        self.removed.append(replica_id)
        return None

    def refresh_metrics(self) -> None:
        return None


def _gateway() -> Lifecycle:
    state = GatewayState(parse_config({"models": {"m": {"tokenizer": "none"}}}), "g")
    state.predictions = Predictions(state.index, ttl_s=60)
    state.response_owners = ResponseOwners(ttl_s=60, max_entries=10)
    for rid in ("a", "b"):
        state.replicas.add(replica(rid))
        state.index.add_replica(rid, capacity_blocks=100, learn=True)
    return Lifecycle(state)


async def _connected() -> tuple[Lifecycle, Siblings, asyncio.StreamReader, asyncio.StreamWriter]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    gw = _gateway()
    siblings = Siblings(0, 3, ours)
    await siblings.start(gw)
    reader, writer = await asyncio.open_unix_connection(sock=theirs)
    return gw, siblings, reader, writer


async def _until(check: Any) -> None:
    async with asyncio.timeout(5):
        while not check():
            await asyncio.sleep(0.005)


async def _its_own_accounting_goes_out_in_one_frame_per_turn() -> None:
    gw, siblings, reader, writer = await _connected()
    replicas = gw.state.replicas
    a = replicas.get("a")
    assert a is not None
    handle = replicas.dispatched(a, now=5.0, prefill_tokens=64, kv_blocks=4)
    replicas.started(a, handle, ttft_s=0.1, alpha=0.1, min_tokens=1)
    replicas.finished(a, handle)
    gw.state.predictions.record("a", [11, 12, 13])
    to, payload = await read_frame(reader)
    messages = msgspec.msgpack.decode(payload)
    assert to == EVERYONE
    assert [m[:2] for m in messages] == [
        ["dispatched", 0],
        ["started", 0],
        ["finished", 0],
        ["prediction", 0],
    ]
    assert messages[0][2:] == ["a", handle, 5.0, 64, 4]
    assert messages[3][2]["replica"] == "a" and messages[3][2]["hashes"] == "[11,12,13]"
    writer.close()
    await siblings.close()


async def _their_messages_change_this_process_and_a_bad_one_is_only_counted() -> None:
    gw, siblings, _, writer = await _connected()
    expires = 4_102_444_800.0  # 2100: alive
    writer.write(
        frame(
            [
                ("dispatched", 2, "a", 9, 1.0e12, 500, 3),
                ("dispatched", 1, "a", 9, 1.0e12, 100, 1),
                ("started", 1, "a", 9),
                ("nonsense", 1),  # an unknown kind: skipped, counted
                ("dispatched", 1, "a"),  # too short: skipped, counted
                ("dispatched", 1, "a", "9", 1.0e12, 100, 1),  # a handle of the wrong type: the same
                ("finished", "1", "a", 9),  # a sender that is no index: the same
                (
                    "prediction",
                    1,
                    {"gateway": "other", "replica": "b", "expires_at": repr(expires), "hashes": "[7,8]"},
                ),
                ("owner", 1, "resp_1", "b", expires),
                ("admin", 1, "drain", "a", True),
                ("admin", 1, "remove", "b"),
                ("admin", 1, "add", {"url": "http://c:1"}),
            ]
        )
    )
    writer.write(HEADER.pack(EVERYONE, 3) + b"\xc1\xc1\xc1")  # not msgpack: skipped, counted
    a = gw.state.replicas.get("a")
    assert a is not None
    await _until(lambda: siblings.received == 12 and siblings.malformed == 5)
    await _until(lambda: gw.added and gw.removed)
    assert a.load()[:3] == (1, 1, 500) and a.draining
    assert gw.state.index.match([7, 8]) == {"b": 2}
    assert await gw.state.response_owners.owner("resp_1") == "b"
    assert gw.removed == ["b"] and [e.url for e in gw.added] == ["http://c:1"]
    writer.write(frame([("gone", 2)]))
    await _until(lambda: a.load()[:3] == (1, 0, 0))
    writer.close()
    await siblings.close()


async def _a_scrape_gathers_the_others_metrics_and_answers_theirs() -> None:
    _, siblings, reader, writer = await _connected()
    scrape = asyncio.create_task(siblings.scrape())
    _, payload = await read_frame(reader)
    ((kind, sender, ask),) = msgspec.msgpack.decode(payload)
    assert (kind, sender) == ("scrape", 0)
    writer.write(frame([("metrics", 1, ask, b"one"), ("metrics", 2, ask, b"two")]))
    assert await scrape == {1: b"one", 2: b"two"}
    writer.write(frame([("scrape", 2, 77)]))
    to, payload = await read_frame(reader)
    ((kind, sender, ask, text),) = msgspec.msgpack.decode(payload)
    assert (to, kind, sender, ask) == (2, "metrics", 0, 77)
    assert b"prefixgate_gateway_replica_healthy" in text
    writer.close()
    await siblings.close()


def test_its_own_accounting_goes_out_in_one_frame_per_turn() -> None:
    asyncio.run(_its_own_accounting_goes_out_in_one_frame_per_turn())


def test_their_messages_change_this_process_and_a_bad_one_is_only_counted() -> None:
    asyncio.run(_their_messages_change_this_process_and_a_bad_one_is_only_counted())


def test_a_scrape_gathers_the_others_metrics_and_answers_theirs() -> None:
    asyncio.run(_a_scrape_gathers_the_others_metrics_and_answers_theirs())
