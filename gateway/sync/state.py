"""Where a replica's KV-event follower stands: one shape for every transport, so the admin API, the
metrics and the replica set read a follower the same way whichever feed it follows (the bundled
workers' over HTTP or Redis, gateway.sync.bundled_events; vLLM-format over ZMQ, gateway.sync.zmq_events;
how they retry is protocol.backoff)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

Transport = Literal["http", "redis", "zmq"]


@dataclass(slots=True)
class SyncState:
    """One follower's progress and health. Times are Unix seconds."""

    replica: str
    # Where the events come from: the worker's URL (http, redis: snapshots come from there too) or the
    # publisher's PUB endpoint (zmq).
    url: str
    transport: Transport
    # zmq: the publisher's replay (ROUTER) endpoint, if it has one.
    replay: str | None = None
    # Bundled workers: the worker incarnation the index reflects (a restart is a new one). ZMQ publishers
    # have none: a restart shows in their sequence numbers.
    incarnation: str | None = None
    # The last batch the index reflects; None while nothing is followed (before the first snapshot or
    # replay, or right after the entries were cleared).
    seq: int | None = None
    # Whether the last read (or, over ZMQ, the connection) works.
    connected: bool = False
    batches_applied: int = 0
    # Times the replica's entries were rebuilt from scratch, the first included (a snapshot load, or
    # over ZMQ a clear and replay: a restarted publisher, a gap not replayable, a malformed batch).
    resyncs: int = 0
    # zmq: gaps (or reconnects) repaired from the replay socket without clearing anything.
    repairs: int = 0
    errors: int = 0
    # zmq: blocks stored but not placed in the index, by reason (gateway.sync.zmq_chains).
    skipped: Counter[str] = field(default_factory=Counter)
    last_applied_at: float | None = None
    # When the oldest change the index may miss happened (see lag_s); None when caught up.
    behind_since: float | None = None
    # The latest failure, while it lasts: None again once a read succeeds.
    last_error: str | None = None
    # redis: the id of the last stream entry consumed; None until following starts.
    stream_id: str | None = None

    @property
    def synced(self) -> bool:
        return self.seq is not None

    def lag_s(self, now: float | None = None) -> float:
        """How stale the index may be for this replica: 0 when caught up; otherwise the age of the
        oldest change not applied yet (a stream entry's time, a poll that found a backlog, a
        disconnect, the first failure of an outage)."""
        if self.behind_since is None:
            return 0.0
        return max(0.0, (time.time() if now is None else now) - self.behind_since)

    def behind(self, since: float | None = None) -> None:
        """The index may miss changes from `since` (now by default), unless it already did earlier."""
        if self.behind_since is None:
            self.behind_since = time.time() if since is None else since

    def failed(self, error: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(error).__name__}: {error}"
        self.connected = False
        self.behind()

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "url": self.url,
            "replay": self.replay,
            "transport": self.transport,
            "synced": self.synced,
            "connected": self.connected,
            "incarnation": self.incarnation,
            "seq": self.seq,
            "batches_applied": self.batches_applied,
            "resyncs": self.resyncs,
            "repairs": self.repairs,
            "errors": self.errors,
            "skipped_blocks": dict(self.skipped),
            "last_applied_at": self.last_applied_at,
            "lag_s": round(self.lag_s(now), 3),
            "last_error": self.last_error,
        }
