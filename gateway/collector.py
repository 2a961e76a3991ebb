"""Python's cyclic garbage collector under the gateway: its long-lived state kept out of full
collections, its young collections spaced out, and its pauses counted.

A full collection walks every tracked container, and the index keeps each replica's blocks in an
OrderedDict, which the collector tracks whatever it holds: with a few million blocks one full
collection took 120-135 ms here (a stall of every request in flight), and under load one came every few
seconds. They came that often because young collections, by default every 700 net allocations (every
~30 requests), promoted the objects of the requests then in flight, and enough promotions set off a
full collection. So, once the gateway is up and each time a replica joins the index, what is alive is
collected once and frozen (`gc.freeze`: a permanent generation no collection walks), and young
collections wait for YOUNG_THRESHOLD allocations. What each part buys: docs/benchmarks.md, "The
collector" (`prefixgate bench throughput`'s GC columns). Objects frozen stay as they are: they are
still freed when their last reference goes; only a cycle among them is never collected, and a
collection just before each freeze leaves none then.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

# Net allocations of tracked objects between young collections (Python's default: 700).
YOUNG_THRESHOLD = 10_000
GENERATIONS = 3


def space_young_collections(threshold: int | None) -> None:
    """Young collections every `threshold` net allocations (None: Python's default, left alone)."""
    if threshold is not None:
        gc.set_threshold(threshold)


def freeze_long_lived() -> None:
    """Collect what is garbage now, then keep what is alive out of every later collection."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """What was frozen back under the collector (a gateway that closes leaves nothing it cannot free)."""
    gc.unfreeze()


@dataclass
class Pauses:
    """The collector's pauses, per generation, counted by a gc callback (gc.callbacks) while installed:
    each collection stops the event loop and every request on it."""

    collections: list[int] = field(default_factory=lambda: [0] * GENERATIONS)
    seconds: list[float] = field(default_factory=lambda: [0.0] * GENERATIONS)
    longest: list[float] = field(default_factory=lambda: [0.0] * GENERATIONS)
    _started: float = 0.0

    def install(self) -> None:
        gc.callbacks.append(self._on_collection)

    def uninstall(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = info["generation"]
        self.collections[generation] += 1
        self.seconds[generation] += pause
        self.longest[generation] = max(self.longest[generation], pause)
