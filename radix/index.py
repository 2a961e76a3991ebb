"""Which replica holds which cached prefix, and how much of a request's prefix each one holds.

Block hashes are chained (radix.hashing), so a hash names a whole root-to-node path of the radix
tree of prefixes. That lets the tree live flattened in one map, hash -> bitmask of the replicas
holding that node: a match walks the request's hashes from the root and narrows the bitmask, which
costs one dict lookup and two integer operations per matched block whatever the fleet size.

Each replica also keeps its blocks in LRU order, for the two places that need to forget: a capacity
bound per replica (approximate mode, where the gateway predicts a foreign backend's cache and has
no eviction events to follow) and a global bound on entries that caps the gateway's memory.
Predicted entries can expire; exact entries (from KV events) live until removed. A prompt in flight
to a replica is pinned there until its request ends: the replica computes it before it answers and
holds it while the request runs. So an exact replica keeps it whatever its events say meanwhile (an
older copy evicted while the request queues), and a capacity bound evicts around it, as an engine
evicts only blocks no running sequence uses: under load, the requests running on a replica hold much
of its pool, and what it keeps of the sessions between their turns is only the rest.

A predicted replica's capacity bound is learned from what the replica reports it reused: the
model and its evidence are radix.capacity's; the LRU it acts on is this index's.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from radix.capacity import Learner, Predicted

NEVER = math.inf
# Hashes of removed entries the deadline rows may hold beyond half the live timed entries before they
# are trimmed, and beyond all of them before the rows are rebuilt whole.
DEADLINE_SLACK = 1024


@dataclass(slots=True)
class _Replica:
    bit: int
    capacity: int | None
    # hash -> expiry time (NEVER for exact entries); least recently used first.
    blocks: OrderedDict[int, float] = field(default_factory=OrderedDict)
    # Learning replicas only (approximate mode): the evidence their capacity bound is learned from.
    learner: Learner | None = None
    # Blocks of prompts in flight to it (hash -> requests): held whatever its events say until unpinned.
    pinned: dict[int, int] = field(default_factory=dict)


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
        # Rows of (expiry, order, replica, hashes): one per timed insert, holding the blocks it added,
        # so a prompt's hundreds of blocks cost one heap push. A block refreshed since is not pushed
        # again: its row, when due, finds the later expiry and reschedules it then (a row per expiry),
        # so touching a known prefix costs no heap work at all. A block removed leaves its hash in a
        # row, skipped when due; `_deadline_refs` counts the hashes the rows hold.
        self._deadlines: list[tuple[float, int, str, tuple[int, ...]]] = []
        self._deadline_order = itertools.count()
        self._deadline_refs = 0
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
            state.learner = Learner()
        self._replicas[replica] = state

    def drop_replica(self, replica: str) -> None:
        """Forget a replica and everything it held or had pinned (its bit goes to the next replica)."""
        self.clear(replica)
        state = self._replicas.pop(replica)
        pinned = list(state.pinned)
        state.pinned.clear()
        for h in pinned:
            self._release(h, state)
        self._names[state.bit] = None
        self._free_bits.append(state.bit)

    def clear(self, replica: str) -> None:
        """The replica's cache was flushed or it restarted: it holds nothing now but the prompts still in
        flight to it, which it will compute again."""
        state = self._state(replica)
        for h, expiry in state.blocks.items():
            self._release(h, state)
            if expiry != NEVER:
                self._timed -= 1
        self._entries -= len(state.blocks)
        state.blocks.clear()
        if state.learner is not None:
            state.learner.clear()

    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def blocks_of(self, replica: str) -> int:
        return len(self._state(replica).blocks)

    def learns(self, replica: str) -> bool:
        """Whether the replica's capacity bound is learned (approximate mode)."""
        return self._state(replica).learner is not None

    def bound_entries(self, max_entries: int) -> None:
        """A new global bound, enforced now (the largest replicas' least recently used go)."""
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self._evict_past_bound()

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
            if expires_at == NEVER and state.learner is None:
                self._insert_exact(state, hashes)
            else:
                self._insert_timed(replica, state, hashes, expires_at)
        finally:
            self._bound(state, len(hashes))

    def _bound(self, state: _Replica, added: int) -> None:
        if state.capacity is not None and len(state.blocks) > state.capacity:
            self._evict_unpinned(state, len(state.blocks) - state.capacity)
        self._evict_past_bound()
        if self._deadline_refs > self._timed + self._timed // 2 + DEADLINE_SLACK:
            self._trim_deadlines(max(2 * added, DEADLINE_SLACK // 16))
        if self._deadline_refs > 2 * self._timed + DEADLINE_SLACK:
            self._compact_deadlines()

    def remove(self, replica: str, hashes: Iterable[int]) -> None:
        """A `removed` event: the replica evicted these blocks. Unknown hashes are ignored."""
        state = self._state(replica)
        pop = state.blocks.pop
        self._drop(state, ((h, e) for h in hashes if (e := pop(h, None)) is not None), ghost=False)

    def pin(self, replica: str, hashes: Sequence[int]) -> None:
        """A request was sent to the replica: its prompt's blocks count as held there until it ends
        (unpin), since the replica computes them before it answers. Until then a `removed` event for them
        only says that an older copy went, and requests sharing the prompt still follow it there; the
        capacity bound does not evict them (a predicted replica's prompt is inserted as well: pinning
        does not make a block one of the replica's LRU entries, it only keeps it held)."""
        state = self._state(replica)
        pinned, holders, blocks = state.pinned, self._holders, state.blocks
        bit = 1 << state.bit
        for h in hashes:
            pinned[h] = pinned.get(h, 0) + 1
            if h not in blocks:  # its entries have their holder bit (a predicted prompt is inserted first)
                holders[h] = holders.get(h, 0) | bit

    def unpin(self, replica: str, hashes: Iterable[int]) -> None:
        """The request pinned with these blocks ended: what the replica's events did not store, it does
        not hold. A replica no longer in the index is ignored."""
        state = self._replicas.get(replica)
        if state is None:
            return
        pinned = state.pinned
        for h in hashes:
            count = pinned.get(h, 0)
            if count > 1:
                pinned[h] = count - 1
            elif count == 1:
                del pinned[h]
                if h not in state.blocks:
                    self._release(h, state)

    def expire(self, now: float) -> int:
        """Drop predicted entries whose expiry is at or before `now`; returns how many."""
        deadlines = self._deadlines
        dropped = 0
        while deadlines and deadlines[0][0] <= now:
            _, _, replica, hashes = heapq.heappop(deadlines)
            self._deadline_refs -= len(hashes)
            state = self._replicas.get(replica)
            if state is None:
                continue
            blocks = state.blocks
            later: dict[float, list[int]] = {}
            due: list[tuple[int, float]] = []
            for h in hashes:
                expiry = blocks.get(h)
                if expiry is None or expiry == NEVER:
                    continue  # removed, or confirmed exact, since
                if expiry > now:
                    later.setdefault(expiry, []).append(h)
                    continue
                del blocks[h]
                due.append((h, expiry))
            self._drop(state, due, ghost=False)
            dropped += len(due)
            for expiry, kept in later.items():
                self._push_deadline(expiry, replica, kept)
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
        return self._learner(replica).tick

    def predicted(self, replica: str, hashes: Sequence[int], horizon: float = math.inf) -> Predicted:
        """What `correct` will check a learning replica's report on this request against (`horizon`:
        see Predicted)."""
        return self._learner(replica).predicted(hashes, horizon)

    def set_capacity(self, replica: str, capacity_blocks: int) -> None:
        """A capacity learned elsewhere (another gateway's `correct`): the bound, enforced now."""
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        state = self._state(replica)
        state.capacity = capacity_blocks
        if len(state.blocks) > capacity_blocks:
            self._evict_unpinned(state, len(state.blocks) - capacity_blocks)

    # -- learning ---------------------------------------------------------------------------

    def correct(self, replica: str, predicted: Predicted, realised: int) -> None:
        """A request was `predicted` to find its first `predicted.blocks` blocks cached on `replica`,
        and the replica reports it reused the first `realised` (radix.capacity says what that implies).

        Fewer: the first block it lacked, and every block last used before it, are not there: they
        go (but those a request in flight pins, which it is using now), and the capacity is at most
        what is left. More: the replica held blocks the capacity bound had dropped, and the capacity
        is at least what that takes.
        """
        state = self._state(replica)
        learner = self._learner(replica)
        lacked = learner.lacked(predicted, realised) if realised < predicted.blocks else None
        if lacked is not None:
            blocks, ticks, pinned = state.blocks, learner.ticks, state.pinned
            while blocks and ticks[oldest := next(iter(blocks))] <= lacked:
                if oldest in pinned:
                    self._used_now(state, oldest)
                else:
                    self._evict_oldest(state, ghost=False)
            state.capacity = learner.bound(len(blocks))
            return
        regained = learner.regained(predicted, realised, state.capacity, len(state.blocks))
        if regained is not None:
            state.capacity = regained

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
        an exact one included). Counts, ticks and the deadline row cover the blocks inserted before a
        hash that cannot be a key stops the loop, so the index stays consistent."""
        blocks = state.blocks
        get, move = blocks.get, blocks.move_to_end
        holders = self._holders
        held = holders.get
        bit = 1 << state.bit
        timed = expires_at != NEVER
        order = hashes[::-1]
        done = made_exact = 0
        new: list[int] = []
        try:
            for h in order:
                old = get(h)
                if old is None:
                    blocks[h] = expires_at
                    holders[h] = held(h, 0) | bit
                    new.append(h)
                else:
                    move(h)
                    if expires_at > old:
                        blocks[h] = expires_at
                        made_exact += not timed  # a predicted entry, now exact
                done += 1
        finally:
            inserted = order[:done]
            self._entries += len(new)
            self._timed += len(new) * timed - made_exact
            learner = state.learner
            if learner is not None:
                learner.ticks.update(zip(inserted, itertools.count(learner.tick)))
                learner.tick += done
                for h in learner.ghosts.keys() & inserted:  # a set operation: C, not a loop of pops
                    del learner.ghosts[h]
            if timed and new:
                self._push_deadline(expires_at, replica, new)

    def _push_deadline(self, expiry: float, replica: str, hashes: Sequence[int]) -> None:
        heapq.heappush(self._deadlines, (expiry, next(self._deadline_order), replica, tuple(hashes)))
        self._deadline_refs += len(hashes)

    def _state(self, replica: str) -> _Replica:
        state = self._replicas.get(replica)
        if state is None:
            raise KeyError(f"replica {replica!r} is not in the index")
        return state

    def _learner(self, replica: str) -> Learner:
        learner = self._state(replica).learner
        if learner is None:
            raise ValueError(f"replica {replica!r} does not learn its capacity")
        return learner

    def _evict_past_bound(self) -> None:
        """Past the global bound, the largest replica gives up its least recently used entries until it
        is down to the next largest (at least one, at most what is past the bound), and so on. The same
        entries go as one at a time from whichever is largest, with the largest found once a batch, not
        once an entry."""
        while self.max_entries is not None and self._entries > self.max_entries:
            largest = max(self._replicas.values(), key=lambda state: len(state.blocks))
            runner_up = max((len(s.blocks) for s in self._replicas.values() if s is not largest), default=0)
            excess = self._entries - self.max_entries
            self._evict_oldest(largest, max(min(excess, len(largest.blocks) - runner_up), 1), ghost=False)

    def _evict_oldest(self, state: _Replica, count: int = 1, ghost: bool = True) -> None:
        """Drop the `count` least recently used blocks (at most as many as it holds); a learning
        replica's capacity bound remembers them as ghosts."""
        popitem = state.blocks.popitem
        self._drop(state, (popitem(last=False) for _ in range(count)), ghost)

    def _evict_unpinned(self, state: _Replica, count: int) -> None:
        """The capacity bound: the `count` least recently used blocks that no request in flight pins
        go (as ghosts, on a learning replica). A pinned one met on the way is in use: it becomes the
        most recently used. Fewer go when fewer are unpinned."""
        if not state.pinned:
            self._evict_oldest(state, count)
            return
        blocks, pinned = state.blocks, state.pinned
        dropped: list[tuple[int, float]] = []
        for _ in range(len(blocks)):
            if len(dropped) == count:
                break
            h = next(iter(blocks))
            if h in pinned:
                self._used_now(state, h)
            else:
                dropped.append((h, blocks.pop(h)))
        self._drop(state, dropped, ghost=True)

    @staticmethod
    def _used_now(state: _Replica, h: int) -> None:
        """`h`, which the replica holds, becomes its most recently used block."""
        state.blocks.move_to_end(h)
        learner = state.learner
        if learner is not None:
            learner.ticks[h] = learner.tick
            learner.tick += 1

    def _drop(self, state: _Replica, dropped: Iterable[tuple[int, float]], ghost: bool) -> None:
        """Account for (hash, expiry) entries taken out of `state.blocks`: their holder bits cleared
        unless pinned, their ticks and counts gone, each a ghost if `ghost`. The one way entries leave
        (expiry, eviction, a `removed` event): this loop runs for every block a fleet evicts, and at the
        bound for every new one."""
        holders, pinned = self._holders, state.pinned
        keep = ~(1 << state.bit)
        learner = state.learner
        ticks = learner.ticks if learner is not None else None
        count = timed = 0
        try:
            for h, expiry in dropped:
                count += 1
                timed += expiry != NEVER
                if h not in pinned:
                    rest = holders[h] & keep
                    if rest:
                        holders[h] = rest
                    else:
                        del holders[h]
                if ticks is not None:
                    del ticks[h]
                    if ghost:
                        learner.evicted(h, state.capacity)  # type: ignore[union-attr]
        finally:
            # Settled even when a hash that cannot be a key stops the loop: the counts stay exact.
            self._entries -= count
            self._timed -= timed

    def _release(self, h: int, state: _Replica) -> None:
        """The replica no longer holds `h` in its blocks: clear its holder bit, unless a request in
        flight still pins it there."""
        if h in state.pinned:
            return
        rest = self._holders[h] & ~(1 << state.bit)
        if rest:
            self._holders[h] = rest
        else:
            del self._holders[h]

    def _trim_deadlines(self, budget: int) -> None:
        """The rows due first rid of the hashes their replica no longer holds, until `budget` hashes were
        looked at. Where entries leave by a bound, the least recently used go first, and their rows are
        the ones due first: trimmed a little at each insert, the rows stay bounded without a rebuild,
        which at millions of entries stalls every request for seconds."""
        heap, replicas = self._deadlines, self._replicas
        kept = []
        seen = 0
        while heap and seen < budget:
            row = heapq.heappop(heap)
            expiry, order, name, hashes = row
            seen += len(hashes)
            state = replicas.get(name)
            blocks = state.blocks if state is not None else {}
            live = tuple(h for h in hashes if blocks.get(h, NEVER) != NEVER)
            self._deadline_refs -= len(hashes) - len(live)
            if live:
                kept.append(row if len(live) == len(hashes) else (expiry, order, name, live))
        for row in kept:
            heapq.heappush(heap, row)

    def _compact_deadlines(self) -> None:
        """Rebuild the deadline heap from live entries, a row per replica and expiry, when stale
        hashes outnumber them."""
        rows: dict[tuple[float, str], list[int]] = {}
        for name, state in self._replicas.items():
            for h, expiry in state.blocks.items():
                if expiry != NEVER:
                    rows.setdefault((expiry, name), []).append(h)
        order = self._deadline_order
        self._deadlines = [(expiry, next(order), name, tuple(hs)) for (expiry, name), hs in rows.items()]
        heapq.heapify(self._deadlines)
        self._deadline_refs = sum(len(hs) for hs in rows.values())
