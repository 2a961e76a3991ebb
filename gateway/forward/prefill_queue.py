"""Prompts held at the gateway while their replica computes others (`limits.prefill_depth`).

A replica serves its queue first come, first served, so a short prompt on a cached history waits
behind a long one that came a moment earlier; on agent sessions through real vLLM three fifths of
every router's time to first token was such waiting (docs/benchmarks.md). With a depth, the gateway
sends a replica at most that many prompts at once that have not yet produced a first token; the rest
wait here, and each freed place goes to the waiting request whose prefill would end first had it
started when it arrived: the least `arrived + own prefill seconds`. Requests of one size go in
arrival order; a short one passes a long one that came no more than the difference of their
prefills before it, so none waits behind later arrivals for longer than its own prefill.

A place is freed at the request's first output, or when its attempt ends however it ends (an answer,
a failure, a client gone). A non-streaming answer shows no first output, so its place is freed once
its predicted prefill has passed. Per gateway process: N processes send a replica up to N x depth.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Line:
    """One replica's places taken and the requests waiting for one, as (key, arrival order, waker)."""

    busy: int = 0
    waiting: list[tuple[float, int, asyncio.Future[None]]] = field(default_factory=list)


class PrefillQueue:
    def __init__(self, depth: int = 1) -> None:
        if depth < 1:
            raise ValueError(f"a prefill depth must be at least 1, got {depth}")
        self.depth = depth
        self._lines: dict[str, _Line] = {}
        self._order = itertools.count()

    async def enter(self, replica: str, arrived: float, prefill_s: float) -> Place:
        """A place on `replica`, at once where one is free and no one waits, else in key order."""
        line = self._lines.setdefault(replica, _Line())
        if line.busy < self.depth and not line.waiting:
            line.busy += 1
            return Place(self, replica)
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(line.waiting, (arrived + prefill_s, next(self._order), woken))
        try:
            await woken
        except asyncio.CancelledError:
            # Given a place in the same turn as it was cancelled: handed on, not lost.
            if woken.done() and not woken.cancelled():
                self._free(replica)
            raise
        return Place(self, replica)

    def _free(self, replica: str) -> None:
        """A place given back: to the first waiting request still there, else free."""
        line = self._lines[replica]
        while line.waiting:
            _, _, woken = heapq.heappop(line.waiting)
            if not woken.done():
                woken.set_result(None)
                return
        line.busy -= 1
        if line.busy == 0:
            del self._lines[replica]


@dataclass(slots=True)
class Place:
    """A request's place on a replica, given back once whatever calls `free` first."""

    queue: PrefillQueue
    replica: str
    freed: bool = False

    def free(self) -> None:
        if not self.freed:
            self.freed = True
            self.queue._free(self.replica)
