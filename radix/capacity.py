"""How big a predicted replica's cache is, learned from what the replica reports it reused.

In approximate mode the gateway predicts what a foreign backend caches and has no eviction events to
follow, so it bounds each replica's predicted blocks by a capacity, which a configured value only
starts (a prior, in whatever unit it was given, or none at all). The model is the replica's own LRU,
in which a block's use is when a sequence lets go of it (the gateway touches a request's blocks when
it is sent and again when it ends):

- a block the replica lacked was evicted, and so was every block used before it: those go, and the
  capacity is at most what is left (the median of the latest few such bounds, which err both ways);
- a block it held that the capacity bound had dropped (a "ghost", remembered as ARC remembers them)
  says that it holds at least what the bound kept plus every block the bound dropped since that one.

The LRU itself is the index's (radix.index); this module keeps, per learning replica, when each block
was last used, the ghosts and the bounds, and says what a report implies.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# A learned capacity never goes below this many blocks: one odd report (a replica that restarted)
# must not leave the gateway predicting nothing.
MIN_LEARNED_CAPACITY = 64
# A guessed capacity (a foreign backend's configured one) is taken this many times over (capacity_prior).
PRIOR_SLACK = 4
# A learned capacity is the median of this many latest bounds from reports (Learner.bound).
BOUNDS_KEPT = 8
# Evicted blocks remembered per block of capacity: a bound set this many times too tight can still
# see the evidence that it is (a reuse of a block it dropped) and grow.
GHOSTS_PER_BLOCK = 4


def capacity_prior(configured: int | None, *, guessed: bool) -> int | None:
    """Where a learning replica's capacity bound starts. A known pool (a bundled worker's) is taken as
    it is; a guess (a foreign backend's configured capacity) PRIOR_SLACK times over: a bound too loose
    is learned down within a few requests (each prediction it turns out to lack tightens it), but one
    too tight is learned up only when routing happens to send a request where the bound had dropped
    its prefix, which a tight bound makes rare."""
    if configured is None:
        return None
    return configured * (PRIOR_SLACK if guessed else 1)


class Pending(Protocol):
    """A request routed to a learning replica: whether its first token came, and the index tick its
    prompt was recorded at (None: not recorded)."""

    started: bool
    recorded_tick: int | None


def pending_horizon(requests: Iterable[Pending]) -> float:
    """A replica's Predicted.horizon: the earliest tick a request still waiting for its first token
    was recorded at, since blocks used from then on may not be computed on the replica yet."""
    return min(
        (r.recorded_tick for r in requests if not r.started and r.recorded_tick is not None),
        default=math.inf,
    )


@dataclass(frozen=True, slots=True)
class Predicted:
    """What a learning replica was predicted to hold of a request's prefix, taken before the request
    was recorded there (which touches its blocks again): when each leading block held was last used,
    and how many blocks after those the capacity bound had dropped."""

    ticks: tuple[int, ...]
    # For each block after the held ones that the capacity bound had dropped, in order: how many
    # blocks it has dropped since (1 for the latest).
    ghosted: tuple[int, ...]
    # Blocks last used at or after this tick were recorded by requests the replica may not have
    # computed yet (still waiting for their first token): lacking one of those is no evidence.
    horizon: float = math.inf

    @property
    def blocks(self) -> int:
        return len(self.ticks)


@dataclass(slots=True)
class Learner:
    """One learning replica's evidence: when each block it holds was last used (a counter of uses that
    grows along the index's LRU order), the blocks its bound dropped lately, and the latest upper
    bounds on its capacity that reports gave."""

    ticks: dict[int, int] = field(default_factory=dict)
    # Dropped hash -> the count of drops when it was dropped.
    ghosts: OrderedDict[int, int] = field(default_factory=OrderedDict)
    bounds: deque[int] = field(default_factory=lambda: deque(maxlen=BOUNDS_KEPT))
    tick: int = 0
    dropped: int = 0

    def clear(self) -> None:
        self.ticks.clear()
        self.ghosts.clear()

    def predicted(self, hashes: Sequence[int], horizon: float) -> Predicted:
        held = []
        for h in hashes:
            tick = self.ticks.get(h)
            if tick is None:
                break
            held.append(tick)
        ghosted = []
        for h in hashes[len(held) :]:
            when = self.ghosts.get(h)
            if when is None:
                break
            ghosted.append(self.dropped - when + 1)
        return Predicted(tuple(held), tuple(ghosted), horizon)

    def evicted(self, h: int, capacity: int | None) -> None:
        """The capacity bound dropped `h`: remembered, within GHOSTS_PER_BLOCK per block of capacity."""
        self.dropped += 1
        ghosts = self.ghosts
        ghosts[h] = self.dropped
        ghosts.move_to_end(h)
        while len(ghosts) > GHOSTS_PER_BLOCK * max(capacity or 0, MIN_LEARNED_CAPACITY):
            ghosts.popitem(last=False)

    def lacked(self, predicted: Predicted, realised: int) -> int | None:
        """When the first block a replica lacked, against its prediction, was last used: every block
        used at or before it is gone. None when the report is no evidence of that (it lacked nothing,
        or only what a request still on its way recorded)."""
        if realised >= predicted.blocks:
            return None
        tick = predicted.ticks[realised]
        return None if tick >= predicted.horizon else tick

    def bound(self, left: int) -> int:
        """The capacity once an eviction left `left` blocks: the median of the latest BOUNDS_KEPT such
        bounds. One bound errs both ways: too low when a block went while the request that would
        have used it waited in the replica's queue (a replica touches a prefix when it schedules the
        request, not when the router sends it), which under load came often enough that keeping the
        tightest bound shrank the capacity to a fraction of the pool (the Mooncake conversation trace
        in `bench fleet`: a hit rate of 0.107, 0.118 with the median); too high when a loose prior let
        predictions the replica never held pile up (the loosest bound kept them, and in front of real
        processes piled requests onto one replica: imbalance up to 1.28 against 1.05)."""
        self.bounds.append(max(left, MIN_LEARNED_CAPACITY))
        return statistics.median_high(self.bounds)

    def regained(self, predicted: Predicted, realised: int, capacity: int | None, held: int) -> int | None:
        """The capacity once a replica reused blocks its bound had dropped: at least what the bound
        keeps (`held`) and every block it dropped since the earliest of them; the bounds reported
        before are stale. None when the report says no such thing."""
        if capacity is None or realised <= predicted.blocks or not predicted.ghosted:
            return None
        self.bounds.clear()
        return max(capacity, held + max(predicted.ghosted[: realised - predicted.blocks]))
