"""Which replica holds which cached prefix, and how much of a request's prefix each one holds.

Block hashes are chained (radix.hashing), so a hash names a whole root-to-node path of the radix
tree of prefixes. That lets the tree live flattened in one map, hash -> bitmask of the replicas
holding that node: a match walks the request's hashes from the root and narrows the bitmask, which
costs one dict lookup and two integer operations per matched block whatever the fleet size.

Each replica also keeps its blocks in LRU order, for the two places that need to forget: a capacity
bound per replica (approximate mode, where the gateway predicts a foreign backend's cache and has
no eviction events to follow) and a global bound on entries that caps the gateway's memory.
Predicted entries can expire; exact entries (from KV events) live until removed.

A predicted replica's capacity is learned (`correct`) from what the replica reports it reused, so a
configured capacity is only a prior, in whatever unit it was given, or none at all. The model is the
replica's own LRU, in which a block's use is when a sequence lets go of it (the gateway touches a
request's blocks when it is sent and again when it ends): a block it lacked was evicted, and so was
every block used before it, so those go and the capacity is at most what is left (the median of the
latest few such bounds, which err both ways); a block it held that the capacity bound had dropped (a
"ghost", remembered as ARC remembers them) says that it holds at least what the bound kept plus every
block the bound dropped since that one.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

NEVER = math.inf
# A learned capacity never goes below this many blocks: one odd report (a replica that restarted)
# must not leave the gateway predicting nothing.
MIN_LEARNED_CAPACITY = 64
# A guessed capacity (a foreign backend's configured one) is taken this many times over (capacity_prior).
PRIOR_SLACK = 4
# A learned capacity is the median of this many latest bounds from reports (RadixIndex.correct).
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
        (r.recorded_tick for r in requests if not r.started and r.recorded_tick is not None), default=NEVER
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
    # computed yet (still waiting for their first token): lacking one of those is no eviction.
    horizon: float = math.inf

    @property
    def blocks(self) -> int:
        return len(self.ticks)


@dataclass(slots=True)
class _Replica:
    bit: int
    capacity: int | None
    # hash -> expiry time (NEVER for exact entries); least recently used first.
    blocks: OrderedDict[int, float] = field(default_factory=OrderedDict)
    # Learning replicas only (approximate mode): when each block was last used, by a counter of uses
    # that grows along `blocks`' order, and the blocks the capacity bound evicted lately.
    ticks: dict[int, int] | None = None
    # Dropped hash -> the count of drops when it was dropped.
    ghosts: OrderedDict[int, int] | None = None
    # The latest upper bounds on the capacity that reports gave (see correct).
    bounds: deque[int] | None = None
    tick: int = 0
    dropped: int = 0


class RadixIndex:
    """Cached prefixes per replica, matched by leading block hashes. Pure: no clock, no I/O."""

    def __init__(self, max_entries: int | None = None) -> None:
        if max_entries is not None and max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self._holders: dict[int, int] = {}
        self._replicas: dict[str, _Replica] = {}
        self._names: list[str | None] = []
        self._free_bits: list[int] = []
        self._entries = 0
        # (expiry, hash, replica) for entries with a finite expiry; stale rows are skipped lazily.
        self._deadlines: list[tuple[float, int, str]] = []
        self._timed = 0

    # -- replicas ---------------------------------------------------------------------------

    def add_replica(self, replica: str, capacity_blocks: int | None = None, *, learn: bool = False) -> None:
        """Start tracking a replica; `capacity_blocks` bounds its entries with LRU eviction. A `learn`ing
        replica (one whose cache is predicted) has that bound corrected by `correct`."""
        if replica in self._replicas:
            raise ValueError(f"replica {replica!r} is already in the index")
        if capacity_blocks is not None and capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        bit = self._free_bits.pop() if self._free_bits else len(self._names)
        if bit == len(self._names):
            self._names.append(replica)
        else:
            self._names[bit] = replica
        state = _Replica(bit=bit, capacity=capacity_blocks)
        if learn:
            state.ticks, state.ghosts, state.bounds = {}, OrderedDict(), deque(maxlen=BOUNDS_KEPT)
        self._replicas[replica] = state

    def drop_replica(self, replica: str) -> None:
        """Forget a replica and everything it held."""
        self.clear(replica)
        state = self._replicas.pop(replica)
        self._names[state.bit] = None
        self._free_bits.append(state.bit)

    def clear(self, replica: str) -> None:
        """The replica's cache was flushed or it restarted: it holds nothing now."""
        state = self._state(replica)
        mask = ~(1 << state.bit)
        holders = self._holders
        for h, expiry in state.blocks.items():
            rest = holders[h] & mask
            if rest:
                holders[h] = rest
            else:
                del holders[h]
            if expiry != NEVER:
                self._timed -= 1
        self._entries -= len(state.blocks)
        state.blocks.clear()
        if state.ticks is not None and state.ghosts is not None:
            state.ticks.clear()
            state.ghosts.clear()

    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def blocks_of(self, replica: str) -> int:
        return len(self._state(replica).blocks)

    def learns(self, replica: str) -> bool:
        """Whether the replica's capacity bound is learned (approximate mode)."""
        return self._state(replica).ticks is not None

    def capacity_of(self, replica: str) -> int | None:
        """The replica's capacity bound in blocks, as configured or learned (None: unbounded)."""
        return self._state(replica).capacity

    def holds(self, replica: str, block_hash: int) -> bool:
        return block_hash in self._state(replica).blocks

    def __len__(self) -> int:
        """(block, replica) entries held, the unit of the memory bound."""
        return self._entries

    # -- updates ----------------------------------------------------------------------------

    def insert(self, replica: str, hashes: Sequence[int], expires_at: float = NEVER) -> None:
        """Record that `replica` holds these blocks (a `stored` event, or a routing prediction).

        Blocks are touched from the last to the first, so a prefix's root ends up the most
        recently used and eviction takes leaves before the roots other requests still share.

        An expiry that is NaN is refused (ValueError) before anything changes: it would sit at the
        top of the deadline heap and stop every expiry. Hashes that cannot be keys (a list where an int
        belongs) raise TypeError, with what was inserted before them counted and bounded as usual, so
        the index stays consistent whatever its callers pass.
        """
        if not expires_at <= NEVER:
            raise ValueError(f"expires_at must be a time or NEVER, got {expires_at!r}")
        state = self._state(replica)
        try:
            if expires_at == NEVER and state.ticks is None:
                self._insert_exact(state, hashes)
            else:
                self._insert_timed(replica, state, hashes, expires_at)
        finally:
            self._bound(replica, state)

    def _bound(self, replica: str, state: _Replica) -> None:
        blocks = state.blocks
        if state.capacity is not None:
            while len(blocks) > state.capacity:
                self._evict_oldest(replica, state)
        if self.max_entries is not None:
            while self._entries > self.max_entries:
                largest = max(self._replicas.items(), key=lambda item: len(item[1].blocks))
                self._evict_oldest(*largest, ghost=False)
        if len(self._deadlines) > 2 * self._timed + 1024:
            self._compact_deadlines()

    def remove(self, replica: str, hashes: Iterable[int]) -> None:
        """A `removed` event: the replica evicted these blocks. Unknown hashes are ignored."""
        state = self._state(replica)
        pop = state.blocks.pop
        holders = self._holders
        keep = ~(1 << state.bit)
        removed = timed = 0
        ticks = state.ticks
        try:
            for h in hashes:
                expiry = pop(h, None)
                if expiry is None:
                    continue
                if ticks is not None:
                    del ticks[h]
                rest = holders[h] & keep
                if rest:
                    holders[h] = rest
                else:
                    del holders[h]
                removed += 1
                if expiry != NEVER:
                    timed += 1
        finally:
            # Settled even when a hash that cannot be a key stops the loop: the counts stay exact.
            self._entries -= removed
            self._timed -= timed

    def settle(self, replica: str, hashes: Iterable[int]) -> None:
        """A request that was recorded on an exact replica as in flight (timed entries, until its KV
        events confirm them) has ended: what its events did not confirm, the replica does not hold.
        A replica no longer in the index is ignored."""
        state = self._replicas.get(replica)
        if state is None:
            return
        blocks = state.blocks
        for h in hashes:
            expiry = blocks.get(h)
            if expiry is not None and expiry != NEVER:
                del blocks[h]
                if state.ticks is not None:
                    del state.ticks[h]
                self._forget(h, state.bit, expiry)

    def expire(self, now: float) -> int:
        """Drop predicted entries whose expiry is at or before `now`; returns how many."""
        deadlines = self._deadlines
        dropped = 0
        while deadlines and deadlines[0][0] <= now:
            expiry, h, replica = heapq.heappop(deadlines)
            state = self._replicas.get(replica)
            if state is not None and state.blocks.get(h) == expiry:
                del state.blocks[h]
                if state.ticks is not None:
                    del state.ticks[h]
                self._forget(h, state.bit, expiry)
                dropped += 1
        return dropped

    # -- lookup -----------------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of `hashes` held by each replica, for the replicas that hold at least one."""
        holders = self._holders
        names = self._names
        alive = holders.get(hashes[0], 0) if hashes else 0
        depth = 1
        result: dict[str, int] = {}
        while alive and depth < len(hashes):
            held = holders.get(hashes[depth], 0) & alive
            if held != alive:
                lost = alive ^ held
                while lost:
                    low = lost & -lost
                    result[names[low.bit_length() - 1]] = depth  # type: ignore[index]
                    lost ^= low
                alive = held
            depth += 1
        while alive:
            low = alive & -alive
            result[names[low.bit_length() - 1]] = depth  # type: ignore[index]
            alive ^= low
        return result

    def tick_now(self, replica: str) -> int:
        """A learning replica's use counter: blocks recorded from now on are last used at or after it."""
        return self._state(replica).tick

    def predicted(self, replica: str, hashes: Sequence[int], horizon: float = math.inf) -> Predicted:
        """What `correct` will check a learning replica's report on this request against (`horizon`:
        see Predicted)."""
        state = self._state(replica)
        ticks, ghosts = state.ticks, state.ghosts
        if ticks is None or ghosts is None:
            raise ValueError(f"replica {replica!r} does not learn its capacity")
        held = []
        for h in hashes:
            tick = ticks.get(h)
            if tick is None:
                break
            held.append(tick)
        ghosted = []
        for h in hashes[len(held) :]:
            when = ghosts.get(h)
            if when is None:
                break
            ghosted.append(state.dropped - when + 1)
        return Predicted(tuple(held), tuple(ghosted), horizon)

    def set_capacity(self, replica: str, capacity_blocks: int) -> None:
        """A capacity learned elsewhere (another gateway's `correct`): the bound, enforced now."""
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        state = self._state(replica)
        state.capacity = capacity_blocks
        while len(state.blocks) > capacity_blocks:
            self._evict_oldest(replica, state)

    # -- learning ---------------------------------------------------------------------------

    def correct(self, replica: str, predicted: Predicted, realised: int) -> None:
        """A request was `predicted` to find its first `predicted.blocks` blocks cached on `replica`,
        and the replica reports it reused the first `realised`.

        Fewer: the first block it lacked, and every block last used before it, are not there: they
        go, and the capacity is at most what is left. That bound errs both ways, so the capacity is
        the median of the latest BOUNDS_KEPT: too low when a block went while the request that would
        have used it waited in the replica's queue (a replica touches a prefix when it schedules the
        request, not when the router sends it), which under load came often enough that keeping the
        tightest bound shrank the capacity to a fraction of the pool (the Mooncake conversation trace
        in `bench fleet`: a hit rate of 0.107, 0.118 with the median); too high when a loose prior let
        predictions the replica never held pile up (the loosest bound kept them, and in front of real
        processes piled requests onto one replica: imbalance up to 1.28 against 1.05).
        More: the replica held blocks the capacity bound had dropped: it holds at least what the
        bound keeps and every block the bound dropped since the earliest of them, and the bounds
        reported before are stale.
        """
        state = self._state(replica)
        ticks, bounds = state.ticks, state.bounds
        if ticks is None or bounds is None:
            raise ValueError(f"replica {replica!r} does not learn its capacity")
        if realised < predicted.blocks:
            lacked = predicted.ticks[realised]
            if lacked >= predicted.horizon:  # recorded by a request still on its way: not evidence
                return
            blocks = state.blocks
            while blocks and ticks[next(iter(blocks))] <= lacked:
                self._evict_oldest(replica, state, ghost=False)
            bounds.append(max(len(blocks), MIN_LEARNED_CAPACITY))
            state.capacity = statistics.median_high(bounds)
        elif state.capacity is not None and realised > predicted.blocks and predicted.ghosted:
            regained = predicted.ghosted[: realised - predicted.blocks]
            state.capacity = max(state.capacity, len(state.blocks) + max(regained))
            bounds.clear()

    # -- internals --------------------------------------------------------------------------

    def _insert_exact(self, state: _Replica, hashes: Sequence[int]) -> None:
        """The KV-event path, taken for every block a worker stores: locals only in the loop, counts
        settled once at the end."""
        blocks = state.blocks
        get, move = blocks.get, blocks.move_to_end
        holders = self._holders
        held = holders.get
        bit = 1 << state.bit
        added = made_exact = 0
        try:
            for h in reversed(hashes):
                old = get(h)
                if old is None:
                    blocks[h] = NEVER
                    holders[h] = held(h, 0) | bit
                    added += 1
                else:
                    move(h)
                    if old != NEVER:  # a predicted entry, now confirmed
                        blocks[h] = NEVER
                        made_exact += 1
        finally:
            # Settled even when a hash that cannot be a key stops the loop: the counts stay exact.
            self._entries += added
            self._timed -= made_exact

    def _insert_timed(self, replica: str, state: _Replica, hashes: Sequence[int], expires_at: float) -> None:
        """Predicted entries, and any entry of a learning replica (whose every block needs its tick,
        an exact one included)."""
        blocks = state.blocks
        holders = self._holders
        bit = 1 << state.bit
        ticks, ghosts = state.ticks, state.ghosts
        timed = expires_at != NEVER
        for h in reversed(hashes):
            if ticks is not None and ghosts is not None:
                ticks[h] = state.tick
                state.tick += 1
                ghosts.pop(h, None)
            old = blocks.get(h)
            if old is None:
                blocks[h] = expires_at
                holders[h] = holders.get(h, 0) | bit
                self._entries += 1
                self._timed += timed
            else:
                blocks.move_to_end(h)
                if expires_at > old:
                    blocks[h] = expires_at
                    self._timed -= not timed  # a predicted entry, now exact
            if timed:
                heapq.heappush(self._deadlines, (expires_at, h, replica))

    def _state(self, replica: str) -> _Replica:
        state = self._replicas.get(replica)
        if state is None:
            raise KeyError(f"replica {replica!r} is not in the index")
        return state

    def _evict_oldest(self, replica: str, state: _Replica, ghost: bool = True) -> None:
        """Drop the least recently used block; a learning replica's capacity bound remembers it."""
        h, expiry = state.blocks.popitem(last=False)
        self._forget(h, state.bit, expiry)
        if state.ticks is not None:
            del state.ticks[h]
        ghosts = state.ghosts
        if ghost and ghosts is not None:
            state.dropped += 1
            ghosts[h] = state.dropped
            ghosts.move_to_end(h)
            while len(ghosts) > GHOSTS_PER_BLOCK * max(state.capacity or 0, MIN_LEARNED_CAPACITY):
                ghosts.popitem(last=False)

    def _forget(self, h: int, bit: int, expiry: float) -> None:
        rest = self._holders[h] & ~(1 << bit)
        if rest:
            self._holders[h] = rest
        else:
            del self._holders[h]
        self._entries -= 1
        if expiry != NEVER:
            self._timed -= 1

    def _compact_deadlines(self) -> None:
        """Rebuild the deadline heap from live entries when stale rows outnumber them."""
        self._deadlines = [
            (expiry, h, name)
            for name, state in self._replicas.items()
            for h, expiry in state.blocks.items()
            if expiry != NEVER
        ]
        heapq.heapify(self._deadlines)
