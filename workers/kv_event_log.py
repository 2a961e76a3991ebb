"""KV events (docs/design.md §4): the block manager's callbacks as numbered batches that an index can replay.

The callbacks fire on the engine thread in the middle of a step, so they only append to a pending
list under a lock; whoever serves readers seals that list into the next numbered batch. The log keeps
its own mirror of the cached set, built from sealed batches alone, so a snapshot names exactly the
sequence number it is consistent with, and nothing ever reads the block manager across threads.

The batches are protocol.kv_events' wire format. A log that keeps tokens (for the vLLM-format
publisher, workers/zmq_publisher.py) records its stored events as `StoredBlocks`, which also carry
their blocks' token ids; their JSON is the same.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice

from protocol.kv_events import EventBatch, KVEvent, Snapshot, apply_event
from radix.hashing import pack_tokens


class EventsGone(LookupError):
    """The batches a reader asked for are not retained (too old, or from another incarnation):
    it must resync from a snapshot."""

    def __init__(self, incarnation: str, seq: int, after: int) -> None:
        super().__init__(
            f"batches after seq {after} are not available in incarnation {incarnation} "
            f"(now at seq {seq}); resync from the snapshot"
        )
        self.incarnation = incarnation
        self.seq = seq


@dataclass(frozen=True, slots=True)
class StoredBlocks(KVEvent):
    """A `stored` event with its blocks' token ids, packed as radix.hashing packs them (4 bytes a
    token): the ring holds thousands of batches, and a Python int per token would cost 9 times more."""

    packed_tokens: bytes = b""


def new_incarnation() -> str:
    """A fresh id per process start, so a reader can tell a restarted worker from a gap."""
    return secrets.token_hex(8)


class KVEventLog:
    """Pending events from the engine thread, sealed into a bounded ring of numbered batches.

    Thread-safe: the `on_*` callbacks may run on any thread while another seals and reads.
    `on_pending` (if set) is called, on the appending thread, when the first event lands in an empty
    pending list: the server uses it to schedule a seal on its event loop, one wake-up per burst.
    """

    def __init__(
        self,
        incarnation: str | None = None,
        capacity: int = 4096,
        on_pending: Callable[[], None] | None = None,
        *,
        keep_tokens: bool = False,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.incarnation = incarnation or new_incarnation()
        self.on_pending = on_pending
        self.keep_tokens = keep_tokens
        self._lock = threading.Lock()
        self._pending: list[KVEvent] = [KVEvent("cleared")]
        self._batches: deque[EventBatch] = deque(maxlen=capacity)
        self._seq = 0
        self._cached: set[int] = set()
        self.seal()

    # -- engine side (the block manager's callbacks) -------------------------------------------

    def on_stored(self, hashes: list[int], parent: int | None) -> None:
        self._append(KVEvent("stored", tuple(hashes), parent))

    def on_stored_tokens(self, hashes: list[int], parent: int | None, token_ids: Sequence[int]) -> None:
        self._append(StoredBlocks("stored", tuple(hashes), parent, pack_tokens(token_ids)))

    def on_removed(self, hashes: list[int]) -> None:
        self._append(KVEvent("removed", tuple(hashes)))

    def on_cleared(self) -> None:
        self._append(KVEvent("cleared"))

    def callbacks(self) -> dict[str, Callable[..., None]]:
        """The keyword arguments that wire an engine (real or simulated) to this log."""
        stored = (
            {"on_stored_tokens": self.on_stored_tokens} if self.keep_tokens else {"on_stored": self.on_stored}
        )
        return stored | {"on_removed": self.on_removed, "on_cleared": self.on_cleared}

    def _append(self, event: KVEvent) -> None:
        with self._lock:
            first = not self._pending
            self._pending.append(event)
        wake = self.on_pending
        if first and wake is not None:
            wake()

    # -- reader side ---------------------------------------------------------------------------

    @property
    def seq(self) -> int:
        """The sequence number of the latest sealed batch."""
        return self._seq

    def seal(self) -> EventBatch | None:
        """Turn the pending events into the next batch; None when there were none."""
        with self._lock:
            if not self._pending:
                return None
            events, self._pending = tuple(self._pending), []
            self._seq += 1
            batch = EventBatch(self.incarnation, self._seq, events)
            self._batches.append(batch)
            for event in events:
                apply_event(self._cached, event)
            return batch

    def after(self, seq: int, limit: int | None = None) -> list[EventBatch]:
        """The sealed batches numbered above `seq`, oldest first (at most `limit` of them).

        Raises EventsGone when some of them have left the ring, or when `seq` lies beyond the latest
        batch (a reader still on a previous incarnation's numbers).
        """
        if seq < 0:
            raise ValueError(f"seq must be >= 0, got {seq}")
        with self._lock:
            oldest = self._batches[0].seq
            if seq < oldest - 1 or seq > self._seq:
                raise EventsGone(self.incarnation, self._seq, seq)
            start = seq - oldest + 1
            stop = len(self._batches) if limit is None else min(len(self._batches), start + limit)
            return list(islice(self._batches, start, stop))

    @property
    def num_cached(self) -> int:
        """Hashes in the cached set as of the latest sealed batch."""
        return len(self._cached)

    def snapshot(self) -> Snapshot:
        """The cached set as of the latest sealed batch (pending events are not in it)."""
        with self._lock:
            return Snapshot(self.incarnation, self._seq, frozenset(self._cached))
