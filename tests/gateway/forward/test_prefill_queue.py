"""gateway.forward.prefill_queue: who gets a replica's place, and that no place is lost."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.forward.prefill_queue import Place, PrefillQueue
from tests.support.gateways import RunningGateway, foreign_backend
from tests.support.raw_replicas import MODEL, gateway_for


async def _waiters(
    queue: PrefillQueue, replica: str, rows: list[tuple[str, float, float]]
) -> dict[str, asyncio.Task[Place]]:
    tasks = {
        name: asyncio.ensure_future(queue.enter(replica, arrived, prefill_s))
        for name, arrived, prefill_s in rows
    }
    await asyncio.sleep(0)
    return tasks


def test_places_go_to_the_earliest_end_had_each_started_on_arrival() -> None:
    async def scenario() -> list[str]:
        queue = PrefillQueue(depth=1)
        first = await queue.enter("r", 0.0, 5.0)
        # long: would end at 1 + 9 = 10; short: 2 + 1 = 3; same: 1.5 + 3 = 4.5; late: 8 + 0.1.
        tasks = await _waiters(
            queue, "r", [("long", 1.0, 9.0), ("short", 2.0, 1.0), ("same", 1.5, 3.0), ("late", 8.0, 0.1)]
        )
        order = []
        place = first
        for _ in tasks:
            place.free()
            await asyncio.sleep(0)
            done = [name for name, t in tasks.items() if t.done() and name not in order]
            assert len(done) == 1, done
            order.append(done[0])
            place = tasks[done[0]].result()
        place.free()
        return order

    assert asyncio.run(scenario()) == ["short", "same", "late", "long"]


def test_a_depth_lets_that_many_through_and_replicas_queue_apart() -> None:
    async def scenario() -> None:
        queue = PrefillQueue(depth=2)
        held = [await queue.enter("a", 0.0, 1.0), await queue.enter("a", 0.0, 1.0)]
        other = await asyncio.wait_for(queue.enter("b", 0.0, 1.0), 1.0)
        third = asyncio.ensure_future(queue.enter("a", 0.0, 1.0))
        await asyncio.sleep(0)
        assert not third.done()
        held[0].free()
        held[0].free()  # twice is once
        place = await asyncio.wait_for(third, 1.0)
        fourth = asyncio.ensure_future(queue.enter("a", 0.0, 1.0))
        await asyncio.sleep(0)
        assert not fourth.done()
        for p in (held[1], place, other):
            p.free()
        (await asyncio.wait_for(fourth, 1.0)).free()
        # Everything given back: the next request goes at once.
        (await asyncio.wait_for(queue.enter("a", 0.0, 1.0), 1.0)).free()

    asyncio.run(scenario())


def test_a_waiter_that_leaves_loses_no_place() -> None:
    """One cancelled while waiting (a client gone, a timeout) is skipped; one cancelled in the turn it was
    given a place hands the place on."""

    async def scenario() -> None:
        queue = PrefillQueue(depth=1)
        first = await queue.enter("r", 0.0, 1.0)
        tasks = await _waiters(queue, "r", [("gone", 0.0, 0.1), ("woken", 0.1, 0.1), ("next", 0.2, 0.1)])
        tasks["gone"].cancel()
        await asyncio.sleep(0)
        first.free()  # skips "gone", wakes "woken"
        tasks["woken"].cancel()  # cancelled before it ran with its place: the place goes on
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert tasks["gone"].cancelled() and tasks["woken"].cancelled()
        (await asyncio.wait_for(tasks["next"], 1.0)).free()
        with pytest.raises(TimeoutError):
            held = await queue.enter("r", 0.0, 1.0)
            await asyncio.wait_for(queue.enter("r", 0.0, 1.0), 0.01)
        held.free()
        (await asyncio.wait_for(queue.enter("r", 0.0, 1.0), 1.0)).free()

    asyncio.run(scenario())


def test_a_depth_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        PrefillQueue(depth=0)


# -- through a gateway, in front of a replica that streams ---------------------------------------------


@dataclass
class Streaming:
    """A foreign replica whose streamed completions compute for `prefill_s` before their first output,
    counting how many it computes at once."""

    prefill_s: float = 0.2
    computing: int = 0
    most: int = 0

    async def complete(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.computing += 1
        self.most = max(self.most, self.computing)
        await asyncio.sleep(self.prefill_s)
        self.computing -= 1
        chunk = {"object": "text_completion", "choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await asyncio.sleep(self.prefill_s)  # decoding: its place is already given back
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _most_computed_at_once(
    start_gateway: Callable[..., RunningGateway], clients: int, **limits: Any
) -> tuple[int, float | None]:
    """The most prompts the replica computed at once, and how many requests the gateway counted as
    waiting for a place (None: none counted)."""
    replica = Streaming()
    with foreign_backend(MODEL, replica.complete) as url:
        gateway = gateway_for(start_gateway, [url], **limits)
        body = {"model": MODEL, "prompt": "Say hi", "max_tokens": 2, "stream": True}

        def send(_: int) -> str:
            with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=30.0) as response:
                assert response.status_code == 200
                return response.read().decode()

        with ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(send, range(clients)))
    assert all('"hi"' in a and a.rstrip().endswith("[DONE]") for a in answers)
    replica_id = gateway.state.replicas.by_url(url)
    assert replica_id is not None
    labels = {"model": MODEL, "replica": replica_id.id}
    counted = gateway.state.metrics.registry.get_sample_value(
        "prefixgate_gateway_prefill_queue_wait_seconds_count", labels
    )
    return replica.most, counted


def test_a_gateway_with_a_depth_sends_a_replica_that_many_prompts_at_once(
    start_gateway: Callable[..., RunningGateway],
) -> None:
    """Four streams at once: with a depth of 1 the replica computes one prompt at a time, each sent once
    the one before has its first output; with none it computes them all together."""
    assert _most_computed_at_once(start_gateway, 4, prefill_depth=1) == (1, 4)
    most, counted = _most_computed_at_once(start_gateway, 4)
    assert most > 1 and counted is None
