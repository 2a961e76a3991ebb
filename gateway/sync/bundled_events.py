"""Keeps the gateway's RadixIndex exact for its bundled workers by replaying their KV events
(docs/design.md §4).

One follower task per replica applies the worker's event batches in sequence order, read either from
Redis (the stream `prefixgate:kv:{id}`, shared by every gateway) or, in the embedded mode without
Redis, from the worker itself over HTTP (the /kv/events long-poll). Whatever either transport cannot
account for (a late start, a gap, an unknown incarnation) it settles the same way: the worker's
/kv/snapshot replaces the replica's entries and names the sequence number it is consistent with, so
following resumes right after it.

Everything runs on the gateway's event loop, as does the routing that reads the index: a batch or a
resync is applied between two awaits, so a lookup never sees half of one. A follower never gives up:
failures are kept in its state and retried with bounded backoff, and only cancellation ends it.

Stream entries, batches and snapshots are validated before anything is applied
(gateway.sync.bundled_wire): one that fails is skipped and counted (gateway.rejections), and the cursor
moves past it, so one bad entry never stalls a follower; the hole it leaves in the seqs resyncs as any
other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any

import aiohttp
import msgspec
from redis.asyncio import Redis

from gateway.rejections import Rejections
from gateway.sync.bundled_wire import MALFORMED, decode_poll, decode_snapshot, parse_entry
from gateway.sync.followers import Followers
from gateway.sync.redis_streams import BLOCK_MS, READ_COUNT, entry_time, read_stream, stream_tail
from gateway.sync.state import SyncState, Transport
from protocol.backoff import RETRY_MAX_S, Backoff
from protocol.cancellation import check_cancelled
from protocol.kv_events import EventBatch
from protocol.redis_keys import kv_stream_key
from radix.index import RadixIndex

log = logging.getLogger("prefixgate.gateway.sync")

# How long one /kv/events long-poll waits for a batch, and the extra allowed for the reply itself.
POLL_TIMEOUT_S = 10.0
POLL_SLACK_S = 5.0
# A snapshot holds every cached hash of a worker: allow it time, but not a hung connect.
SNAPSHOT_TIMEOUT = aiohttp.ClientTimeout(total=30.0, sock_connect=5.0)
# The least time between two reads of one worker's events. Under load a worker seals a batch every
# step, and a read per batch cost the gateway as much CPU as the requests it routed; waiting this long
# takes them in bursts, for an index at most this much staler.
MIN_READ_INTERVAL_S = 0.02
# Incarnations seen to end: their late stream entries (a stopping worker flushes its last batches) are
# skipped instead of each one setting off a resync.
RETIRED_INCARNATIONS = 8


class MalformedSnapshot(ValueError):
    """A worker's /kv/snapshot is not one: following waits for a good one, with backoff."""


# -- applying ---------------------------------------------------------------------------------------


def apply_batch(index: RadixIndex, replica: str, batch: EventBatch) -> None:
    for event in batch.events:
        if event.type == "stored":
            index.insert(replica, event.hashes)
        elif event.type == "removed":
            index.remove(replica, event.hashes)
        else:
            index.clear(replica)


def _next_seq(state: SyncState) -> int:
    """The seq that applies next; the state is synced by then (a snapshot, or a new incarnation's
    first batch, set it)."""
    assert state.seq is not None
    return state.seq + 1


def _apply(state: SyncState, index: RadixIndex, batch: EventBatch) -> None:
    apply_batch(index, state.replica, batch)
    state.seq = batch.seq
    state.batches_applied += 1
    state.last_applied_at = time.time()


async def resync(
    state: SyncState, index: RadixIndex, session: aiohttp.ClientSession, rejections: Rejections | None = None
) -> None:
    """Replace the replica's entries with the worker's snapshot; following resumes after its seq."""
    async with session.get(f"{state.url.rstrip('/')}/kv/snapshot", timeout=SNAPSHOT_TIMEOUT) as response:
        response.raise_for_status()
        body = await response.read()
    # Validated whole before touching the index, so a malformed reply leaves it as it was.
    try:
        snap = decode_snapshot(body)
    except msgspec.DecodeError as error:
        (rejections or Rejections()).reject("kv_events", f"{state.replica}'s /kv/snapshot", error)
        raise MalformedSnapshot(f"{state.replica}'s /kv/snapshot: {error}") from None
    index.clear(state.replica)
    index.insert(state.replica, snap.hashes)
    state.incarnation, state.seq = snap.incarnation, snap.seq
    state.resyncs += 1


def _failed(state: SyncState, backoff: Backoff, error: Exception) -> float:
    """Record a failure; the delay before the next attempt. Logs once per outage, not per attempt."""
    if not backoff.failing:
        log.warning(
            "kv sync: replica %s (%s, %s) failed: %r; retrying with backoff",
            state.replica,
            state.transport,
            state.url,
            error,
        )
    state.failed(error)
    return backoff.failed()


def _recovered(state: SyncState, backoff: Backoff) -> None:
    if backoff.failing:
        log.info("kv sync: replica %s follows again", state.replica)
    backoff.succeeded()
    state.last_error = None
    state.connected = True


async def _pace(started: float) -> None:
    """Hold the next read until MIN_READ_INTERVAL_S after this one began (a long-poll that waited
    that long already goes again at once)."""
    rest = MIN_READ_INTERVAL_S - (time.monotonic() - started)
    if rest > 0:
        await asyncio.sleep(rest)


# -- HTTP transport ---------------------------------------------------------------------------------


async def follow_http(
    state: SyncState,
    index: RadixIndex,
    session: aiohttp.ClientSession,
    *,
    poll_timeout_s: float = POLL_TIMEOUT_S,
    retry_max_s: float = RETRY_MAX_S,
    rejections: Rejections | None = None,
) -> None:
    """Follow the worker's /kv/events long-poll until cancelled.

    A state never synced starts from the snapshot (a gateway that starts late must hold the current
    set); one that was followed before resumes after its seq. A 410 (the worker's ring moved past
    that seq, or the worker restarted as a new incarnation), or a reply that is not one, resyncs.
    """
    backoff = Backoff(most_s=retry_max_s)
    rejections = rejections or Rejections()
    while True:
        started = time.monotonic()
        try:
            if not state.synced:
                await resync(state, index, session, rejections)
            await _poll(state, index, session, poll_timeout_s, rejections)
        except Exception as error:
            await asyncio.sleep(_failed(state, backoff, error))
            continue
        _recovered(state, backoff)
        await _pace(started)


async def _poll(
    state: SyncState,
    index: RadixIndex,
    session: aiohttp.ClientSession,
    timeout_s: float,
    rejections: Rejections,
) -> None:
    asked = time.time()
    params = {"after": state.seq, "timeout": timeout_s, "incarnation": str(state.incarnation)}
    timeout = aiohttp.ClientTimeout(
        total=timeout_s + POLL_SLACK_S, sock_connect=SNAPSHOT_TIMEOUT.sock_connect
    )
    async with session.get(f"{state.url.rstrip('/')}/kv/events", params=params, timeout=timeout) as response:
        gone = response.status == 410
        if not gone:
            response.raise_for_status()
            raw = await response.read()
    reply = None
    if not gone:
        try:
            reply = decode_poll(raw)
        except msgspec.DecodeError as error:
            # What it held is unknown, removals included: only a snapshot accounts for it.
            rejections.reject("kv_events", f"{state.replica}'s /kv/events reply", error)
            state.errors += 1
    if reply is None:
        state.behind(asked)
        await resync(state, index, session, rejections)
        state.behind_since = None
        return
    newest, batches = reply
    for batch in batches:
        if batch.incarnation != state.incarnation or batch.seq != _next_seq(state):
            log.warning("kv sync: replica %s sent batch %d out of order; resyncing", state.replica, batch.seq)
            await resync(state, index, session, rejections)
            return
        _apply(state, index, batch)
    # A reply cut at the server's limit leaves a backlog, which the next poll takes at once.
    if newest < _next_seq(state):
        state.behind_since = None
    else:
        state.behind(asked)


# -- Redis transport --------------------------------------------------------------------------------


async def follow_redis(
    state: SyncState,
    index: RadixIndex,
    redis: Redis,
    session: aiohttp.ClientSession,
    *,
    block_ms: int = BLOCK_MS,
    count: int = READ_COUNT,
    retry_max_s: float = RETRY_MAX_S,
    rejections: Rejections | None = None,
) -> None:
    """Follow the worker's stream in Redis until cancelled; snapshots still come over HTTP.

    A state never followed notes the stream's newest entry, then loads the snapshot, then reads after
    that entry: whatever lands between the two is read and, where the snapshot covers it already, skipped
    by its seq. One that was followed before resumes after its last entry. A Redis that restarted
    empty, or a trimmed stream, shows as a hole in the seqs and resyncs; a new incarnation's batch 1
    (a lone `cleared`) just starts it afresh.
    """
    key = kv_stream_key(state.replica)
    backoff = Backoff(most_s=retry_max_s)
    retired: deque[str] = deque(maxlen=RETIRED_INCARNATIONS)
    rejections = rejections or Rejections()
    while True:
        check_cancelled()
        started = time.monotonic()
        try:
            if state.stream_id is None:
                tail = await stream_tail(redis, key)
                await resync(state, index, session, rejections)
                state.stream_id = tail
            entries = await read_stream(redis, key, state.stream_id, count, block_ms)
            for entry_id, fields in entries:
                try:
                    batch = parse_entry(fields)
                except MALFORMED as error:
                    # Skipped: if it was a batch, the next one shows the hole, which resyncs.
                    rejections.reject("kv_stream", f"{key} entry {entry_id}", error)
                    state.errors += 1
                else:
                    await _consume(state, index, session, retired, entry_id, batch, rejections)
                state.stream_id = entry_id
        except Exception as error:
            await asyncio.sleep(_failed(state, backoff, error))
            continue
        _recovered(state, backoff)
        # A full read may have left more behind it, the next of them newer than the last one read.
        state.behind_since = entry_time(entries[-1][0]) if len(entries) >= count else None
        await _pace(started)


async def _consume(
    state: SyncState,
    index: RadixIndex,
    session: aiohttp.ClientSession,
    retired: deque[str],
    entry_id: str,
    batch: EventBatch,
    rejections: Rejections,
) -> None:
    if batch.incarnation in retired:
        return
    if batch.incarnation != state.incarnation and batch.seq == 1:
        if state.incarnation is not None:
            retired.append(state.incarnation)
        state.incarnation, state.seq = batch.incarnation, 0
    elif batch.incarnation != state.incarnation or batch.seq > _next_seq(state):
        state.behind(entry_time(entry_id))
        before = state.incarnation
        await resync(state, index, session, rejections)
        for ended in (before, batch.incarnation):
            if ended is not None and ended != state.incarnation and ended not in retired:
                retired.append(ended)
    if batch.incarnation == state.incarnation and batch.seq == _next_seq(state):
        _apply(state, index, batch)


# -- the runner -------------------------------------------------------------------------------------


class IndexSync:
    """One follower task per bundled replica, all feeding one index: through Redis when the gateway
    has a client, else over HTTP from each worker.

    The replica set owns the index's replicas: it calls `index.add_replica` before `start`, and `stop`
    before `index.drop_replica`.
    """

    def __init__(
        self,
        index: RadixIndex,
        session: aiohttp.ClientSession,
        redis: Redis | None = None,
        *,
        poll_timeout_s: float = POLL_TIMEOUT_S,
        block_ms: int = BLOCK_MS,
        retry_max_s: float = RETRY_MAX_S,
        rejections: Rejections | None = None,
    ) -> None:
        self.index = index
        self.session = session
        self.redis = redis
        self.poll_timeout_s = poll_timeout_s
        self.block_ms = block_ms
        self.retry_max_s = retry_max_s
        self.rejections = rejections or Rejections()
        self._followers = Followers()

    @property
    def transport(self) -> Transport:
        return "http" if self.redis is None else "redis"

    @property
    def states(self) -> dict[str, SyncState]:
        """The followed replicas' states by id (a copy; the states themselves are live)."""
        return self._followers.states

    def start(self, replica_id: str, url: str) -> SyncState:
        """Follow a replica (already in the index). For a replica followed already this only updates
        its url (a worker that restarted elsewhere under the same id): its follower keeps its place."""
        state = self._followers.get(replica_id)
        if state is not None:
            state.url = url
            return state
        state = SyncState(replica_id, url, self.transport)
        follow: Coroutine[Any, Any, None]
        if self.redis is None:
            follow = follow_http(
                state,
                self.index,
                self.session,
                poll_timeout_s=self.poll_timeout_s,
                retry_max_s=self.retry_max_s,
                rejections=self.rejections,
            )
        else:
            follow = follow_redis(
                state,
                self.index,
                self.redis,
                self.session,
                block_ms=self.block_ms,
                retry_max_s=self.retry_max_s,
                rejections=self.rejections,
            )
        return self._followers.start(replica_id, state, follow, "kv-sync")

    def stop(self, replica_id: str) -> None:
        """Stop following a replica: it may be dropped from the index once this returns."""
        self._followers.stop(replica_id)

    async def close(self) -> None:
        await self._followers.close()
