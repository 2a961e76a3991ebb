"""Client traffic for the chaos scenarios and the fault tests: steady closed-loop load in threads, a
burst of concurrent requests, and a disconnect storm of streams all dropped at once, each request's
answer kept as an Outcome for the checks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx

from bench.chaos_fleet import MODEL
from bench.probes import wait_for


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request: when it left (monotonic), how long its answer took, and what it was."""

    start: float
    latency_s: float
    # HTTP status; 0 when no answer came (connection failure, client timeout).
    status: int
    replica: str | None = None
    retry_after: str | None = None
    # OpenAI error code of a refusal, or the client-side exception.
    error: str | None = None


def completion(prompt: Sequence[int], max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": list(prompt), "max_tokens": max_tokens, "ignore_eos": True, **extra}


def family_prompt(i: int, families: int = 6, prefix_tokens: int = 64, tail_tokens: int = 40) -> list[int]:
    """A prompt sharing one of `families` prefixes, with a tail of its own: routing has prefixes to
    follow and the workers keep storing (and evicting) blocks, so KV events keep flowing."""
    family = i % families
    prefix = [1000 + 97 * family + t for t in range(prefix_tokens)]
    # Ids below 49,152 (SmolLM2's vocabulary, which gateways that tokenize check them against).
    return prefix + [20_000 + (i * tail_tokens + t) % 29_000 for t in range(tail_tokens)]


def _outcome(start: float, status: int, headers: Mapping[str, str], payload: bytes) -> Outcome:
    """What an answer was, from either client (httpx in the traffic threads, aiohttp in bursts); a
    refusal named by its OpenAI error code, or by the start of its body when it has none."""
    error = None
    if status != 200:
        try:
            error = json.loads(payload)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            error = payload[:80].decode(errors="replace")
    return Outcome(
        start,
        time.monotonic() - start,
        status,
        headers.get("x-prefixgate-replica"),
        headers.get("Retry-After"),
        error,
    )


class Traffic:
    """Steady closed-loop load: `concurrency` threads sending completions in turn to `targets` (base
    URLs) until stopped, each waiting for its answer; every request's Outcome is kept."""

    def __init__(
        self,
        targets: Sequence[str],
        body: Callable[[int], dict[str, Any]] = lambda i: completion(family_prompt(i)),
        *,
        concurrency: int = 2,
        timeout_s: float = 30.0,
        pause_s: float = 0.01,
    ) -> None:
        self.targets = list(targets)
        self.body = body
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.pause_s = pause_s
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._count = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Traffic:
        for n in range(self.concurrency):
            thread = threading.Thread(target=self._loop, name=f"traffic-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout_s + 5)

    def _next(self) -> int:
        with self._lock:
            self._count += 1
            return self._count

    def _loop(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                i = self._next()
                target = self.targets[i % len(self.targets)]
                start = time.monotonic()
                try:
                    answer = client.post(f"{target}/v1/completions", json=self.body(i))
                    outcome = _outcome(start, answer.status_code, answer.headers, answer.content)
                except httpx.HTTPError as error:
                    outcome = Outcome(start, time.monotonic() - start, 0, error=repr(error))
                self.outcomes.append(outcome)
                self._stop.wait(self.pause_s)

    def between(self, start: float, end: float = float("inf")) -> list[Outcome]:
        return [o for o in list(self.outcomes) if start <= o.start < end]

    def wait_for_requests(self, count: int, timeout_s: float = 30.0) -> None:
        wait_for(lambda: len(self.outcomes) >= count, f"{count} requests", timeout=timeout_s)


async def burst(
    url: str, bodies: Sequence[dict[str, Any]], timeout_s: float = 60.0, spacing_s: float = 0.0
) -> list[Outcome]:
    """Every body sent at once (or `spacing_s` apart, all in flight together), each on a connection of
    its own; one Outcome each, in order."""

    async def one(session: aiohttp.ClientSession, body: dict[str, Any], delay_s: float) -> Outcome:
        await asyncio.sleep(delay_s)
        start = time.monotonic()
        try:
            async with session.post(f"{url}/v1/completions", json=body) as response:
                return _outcome(start, response.status, response.headers, await response.read())
        except (aiohttp.ClientError, TimeoutError) as error:
            return Outcome(start, time.monotonic() - start, 0, error=repr(error))

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return list(await asyncio.gather(*(one(session, b, i * spacing_s) for i, b in enumerate(bodies))))


@dataclass(slots=True)
class Storm:
    """What a disconnect storm did: clients whose stream started (and which then dropped it), and the
    statuses of those that got no stream."""

    clients: int
    streaming: int = 0
    refused: Counter[int] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    # Monotonic time at which the clients dropped their streams.
    dropped_at: float = 0.0
    # Slowest first chunk among the streams that started.
    max_first_chunk_s: float = 0.0
    # What `before_drop` returned, called with every stream started.
    at_peak: Any = None


async def disconnect_storm_clients(
    url: str,
    bodies: Sequence[dict[str, Any]],
    hold_timeout_s: float = 30.0,
    before_drop: Callable[[], Any] | None = None,
) -> Storm:
    """Each body is sent as a streaming request by a client of its own; every client that gets its
    first chunk holds its stream until all have answered (or `hold_timeout_s`), then (after
    `before_drop()`, run in a thread) all of them drop their connections at once, mid-stream."""
    storm = Storm(len(bodies))
    answered = 0
    everyone = asyncio.Event()
    drop = asyncio.Event()

    def settled() -> None:
        nonlocal answered
        answered += 1
        if answered == len(bodies):
            everyone.set()

    async def one(session: aiohttp.ClientSession, body: dict[str, Any]) -> None:
        start = time.monotonic()
        try:
            response = await session.post(f"{url}/v1/completions", json={**body, "stream": True})
        except (aiohttp.ClientError, TimeoutError) as error:
            storm.errors.append(repr(error))
            settled()
            return
        try:
            if response.status != 200:
                storm.refused[response.status] += 1
                await response.read()
                settled()
                return
            await response.content.readany()
            storm.max_first_chunk_s = max(storm.max_first_chunk_s, time.monotonic() - start)
            storm.streaming += 1
            settled()
            await drop.wait()
        except (aiohttp.ClientError, TimeoutError) as error:
            storm.errors.append(repr(error))
            settled()
        finally:
            response.close()  # mid-stream: the connection is cut, not returned to a pool

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        clients = [asyncio.create_task(one(session, b)) for b in bodies]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(everyone.wait(), hold_timeout_s)
        if before_drop is not None:
            storm.at_peak = await asyncio.to_thread(before_drop)
        storm.dropped_at = time.monotonic()
        drop.set()
        await asyncio.gather(*clients)
    return storm
