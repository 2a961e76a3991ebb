"""Keeps the gateway's RadixIndex exact for replicas that publish vLLM-format KV events over ZMQ
(docs/design.md §4): vLLM and SGLang started with their KV-events config, or bundled workers started with
`--kv-events-zmq`. The wire format is protocol.vllm_kv_events'.

Hashes. A backend's block hashes are its own (vLLM's depend on its hash function and seed, SGLang's
are not even chained), so every stored block is re-hashed from its token ids with docs/design.md §3, chained
from the replica's model root, and each replica keeps the map from the backend's hashes to ours.
A `BlockStored` whose parent is None starts at the root; one whose parent the map does not hold
cannot be placed — its chain began before what this follower saw (or in blocks it does not route on)
— so it is skipped, and with it every later block that chains from it, until the backend stores that
prefix again from its first block. The index then lacks what it cannot name, and never holds what
the backend does not: it is exact as far as the history reaches, and a subset of the truth beyond.

What is not routed on is skipped the same way, counted by reason in the follower's state: blocks of
another block size than the replica's configured `block_size` (the gateway hashes requests with that
one: set it to the backend's), of a LoRA adapter, keyed on more than their tokens (`extra_keys`:
multimodal inputs, cache salt), on a medium other than the GPU (offloaded copies), or in a KV cache
group that is not full attention (hybrid models). Removals of skipped blocks find nothing to remove.
A backend may cache one hash in several blocks: a removal drops one copy, and the index forgets the
block when the last copy goes.

Sequence. The publisher numbers its batches from 0 and keeps the latest ones for replay. A batch
applies when it is the next one. On a gap the follower asks the replay socket for everything from
the last batch it applied, and checks that the publisher still has that batch, with the same bytes:
that tells a publisher that restarted (its numbers start over, its batches differ) from one that
did not, whatever the numbers say. The same check runs when the connection comes back (a restart,
or a network blip) and, as a probe, after `idle_check_s` of silence. A publisher that went back in
its numbers restarted. Whenever the follower cannot account for what it missed (the publisher
restarted, its buffer moved past, or no replay socket answers), the replica's entries are cleared,
since a stale index is worse than an empty one, and rebuilt from the replay buffer from seq 0 (the
publisher's whole history, if it still holds it), then from the live stream.

Everything runs on the gateway's event loop (zmq.asyncio): a batch is applied between two awaits,
so a lookup never sees half of one. A follower never gives up: failures are kept in its state and
retried with bounded backoff, and only cancellation ends it.

What a publisher sends is bounded and validated before it is applied. Each frame is bounded by
ZMQ_MAXMSGSIZE (libzmq drops the connection of a peer that sends a larger one: the follower reconnects
and catches up, as after any blip), and a whole message by the same size; a message over it, in frames
that are not vLLM's, or whose payload does not decode as a batch of well-typed events is counted
(gateway.rejections) and handled as a malformed batch: it may have removed blocks, so the replica's
entries are cleared, and following goes on with the next message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.rejections import Rejections
from gateway.sync.bundled_events import RETRY_MAX_S, Backoff
from gateway.sync.followers import Followers
from protocol.vllm_kv_events import (
    MAX_PAYLOAD_BYTES,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    MalformedEvents,
    decode_batch,
    read_pub_frames,
    read_replay_answer,
    replay_request,
)
from radix.hashing import chain_hashes, root_hash
from radix.index import RadixIndex

log = logging.getLogger("prefixgate.gateway.zmq_sync")

# How long the replay socket may take for each answer before the replay counts as failed.
REPLAY_TIMEOUT_S = 2.0
# Silence after which the follower checks with the replay socket that it missed nothing.
IDLE_CHECK_S = 5.0
# Live messages handled per wake-up, so that a backlog does not hold the event loop.
READ_COUNT = 256
# Digests of the latest batches applied: a live batch the replay already applied is recognised.
RECENT_BATCHES = 1024
# ZMTP heartbeats: a publisher gone silently (host down, cable cut) is noticed as a disconnect.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 2000
# vLLM's PUB high-water mark: a gateway that lags holds as much as the publisher would send.
RCVHWM = 100_000
FULL_ATTENTION = "full_attention"

SkipReason = Literal["block_size", "lora", "extra_keys", "medium", "group", "unknown_parent", "token_count"]


def _digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


@dataclass(frozen=True, slots=True)
class ZmqSource:
    """Where a replica publishes: its PUB endpoint and its replay (ROUTER) endpoint, if any."""

    endpoint: str
    replay: str | None


@dataclass(slots=True)
class ZmqSyncState:
    """Where one replica's ZMQ follower stands, for metrics and the admin API (shaped as
    gateway.sync.bundled_events.SyncState's). Times are Unix seconds."""

    replica: str
    source: ZmqSource
    transport: Literal["zmq"] = "zmq"
    # The publisher's seq of the last batch the index reflects; None when nothing is followed yet
    # (before the first batch, or right after the entries were cleared).
    seq: int | None = None
    connected: bool = False
    batches_applied: int = 0
    # Times the follower started afresh, the first included: the replica's entries cleared and rebuilt
    # from the replay buffer and the live stream (a start, a restarted publisher, a gap that could
    # not be replayed, a malformed batch).
    resyncs: int = 0
    # Gaps (or reconnects) repaired from the replay socket without clearing anything.
    repairs: int = 0
    errors: int = 0
    # Blocks stored but not placed in the index, by reason (module docstring).
    skipped: Counter[str] = field(default_factory=Counter)
    last_applied_at: float | None = None
    # Since when the index may miss changes (a disconnect, a gap not yet repaired, an outage).
    behind_since: float | None = None
    last_error: str | None = None

    @property
    def synced(self) -> bool:
        return self.seq is not None

    def lag_s(self, now: float | None = None) -> float:
        """0 when caught up; otherwise how long the index may have been missing changes."""
        if self.behind_since is None:
            return 0.0
        return max(0.0, (time.time() if now is None else now) - self.behind_since)

    def behind(self) -> None:
        if self.behind_since is None:
            self.behind_since = time.time()

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "url": self.source.endpoint,
            "replay": self.source.replay,
            "transport": self.transport,
            "synced": self.synced,
            "connected": self.connected,
            "incarnation": None,
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


class Chains:
    """One replica's map from the backend's block hashes to ours (module docstring), each with the
    number of copies the backend caches. Pure: no I/O."""

    def __init__(self, model: str, block_size: int, skipped: Counter[str]) -> None:
        self.root = root_hash(model)
        self.block_size = block_size
        self.skipped = skipped
        # backend hash -> {our hash: copies}; more than one of ours only from a backend whose hashes
        # are not chained (SGLang hashes a page's tokens alone).
        self._ours: dict[BlockHash, dict[int, int]] = {}
        # KV cache groups seen to be other than full attention: their removals are not ours either.
        self._other_groups: set[int] = set()

    def __len__(self) -> int:
        return len(self._ours)

    def clear(self) -> None:
        self._ours.clear()
        self._other_groups.clear()

    def _skip(self, event: BlockStored) -> SkipReason | None:
        if event.kv_cache_spec_kind not in (None, FULL_ATTENTION):
            if event.group_idx is not None:
                self._other_groups.add(event.group_idx)
            return "group"
        if event.medium not in (None, MEDIUM_GPU):
            return "medium"
        if event.block_size != self.block_size:
            return "block_size"
        if event.lora_id is not None or event.lora_name is not None:
            return "lora"
        if event.extra_keys and any(key is not None for key in event.extra_keys):
            return "extra_keys"
        if len(event.token_ids) != len(event.block_hashes) * self.block_size:
            return "token_count"
        return None

    def _parent(self, backend: BlockHash | None) -> int | None:
        if backend is None:
            return self.root
        ours = self._ours.get(backend)
        return next(iter(ours)) if ours is not None and len(ours) == 1 else None

    def stored(self, event: BlockStored) -> list[int]:
        """Our hashes of the event's blocks, now mapped; [] when they cannot be placed (counted)."""
        reason = self._skip(event)
        parent = self._parent(event.parent_block_hash) if reason is None else None
        if parent is None:
            self.skipped[reason or "unknown_parent"] += len(event.block_hashes)
            return []
        ours = chain_hashes(parent, event.token_ids, self.block_size)
        for backend, h in zip(event.block_hashes, ours, strict=True):
            copies = self._ours.setdefault(backend, {})
            copies[h] = copies.get(h, 0) + 1
        return ours

    def removed(self, event: BlockRemoved) -> list[int]:
        """Our hashes of which the backend no longer caches any copy."""
        if event.medium not in (None, MEDIUM_GPU) or event.group_idx in self._other_groups:
            return []
        gone: list[int] = []
        for backend in event.block_hashes:
            copies = self._ours.get(backend)
            if copies is None:
                continue
            if len(copies) == 1:
                ((h, count),) = copies.items()
                if count > 1:
                    copies[h] = count - 1
                    continue
            # The last copy, or an ambiguous hash: forgetting too much is safe, keeping too much is not.
            gone.extend(copies)
            del self._ours[backend]
        return gone


class ReplayFailed(Exception):
    """The replay socket did not answer in time, or answered something else than replay frames."""


class ZmqFollower:
    """Follows one replica's publisher until cancelled (module docstring)."""

    def __init__(
        self,
        state: ZmqSyncState,
        index: RadixIndex,
        chains: Chains,
        ctx: zmq.asyncio.Context,
        *,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        idle_check_s: float = IDLE_CHECK_S,
        retry_max_s: float = RETRY_MAX_S,
        max_message_bytes: int = MAX_PAYLOAD_BYTES,
        rejections: Rejections | None = None,
    ) -> None:
        self.state = state
        self.index = index
        self.chains = chains
        self.ctx = ctx
        self.max_message_bytes = max_message_bytes
        self.rejections = rejections or Rejections()
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self.idle_check_ms = int(idle_check_s * 1000)
        self.retry_max_s = retry_max_s
        self._recent: OrderedDict[int, int] = OrderedDict()
        self._replay_socket: zmq.asyncio.Socket | None = None
        # Whether the replay socket has answered since the last failure: only then is silence probed.
        self._replay_answers = False

    @property
    def replica(self) -> str:
        return self.state.replica

    async def run(self) -> None:
        backoff = Backoff(most_s=self.retry_max_s)
        while True:
            try:
                await self._session(backoff)
            except Exception as error:
                self._failed(error, backoff)
                await asyncio.sleep(backoff.failed())
            else:  # ended by a disconnect: connect afresh, as libzmq would have
                await asyncio.sleep(RECONNECT_IVL_MS / 1000)

    def _failed(self, error: Exception, backoff: Backoff) -> None:
        if backoff.delay == 0.0:
            log.warning("zmq sync: replica %s failed: %r; retrying with backoff", self.replica, error)
        self.state.errors += 1
        self.state.last_error = f"{type(error).__name__}: {error}"
        self.state.connected = False
        self.state.behind()

    # -- sockets ----------------------------------------------------------------------------------

    async def _session(self, backoff: Backoff) -> None:
        """One SUB connection with its monitor, until a disconnect, an error or cancellation closes
        both. A disconnect ends it because libzmq does not reconnect a peer it dropped for a protocol
        error (a frame over ZMQ_MAXMSGSIZE): a fresh socket does, whatever the cause."""
        sub = self.ctx.socket(zmq.SUB)
        monitor: zmq.asyncio.Socket | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, RCVHWM)
            sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            sub.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sub.connect(self.state.source.endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll(self.idle_check_ms))
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        while await sub.poll(0):  # what arrived before it
                            await self._drain(sub)
                        self._disconnected()
                        return
                    await self._on_connected(backoff)
                if sub in ready:
                    await self._drain(sub)
                if not ready:
                    await self._idle()
        finally:
            if monitor is not None:
                sub.disable_monitor()
                monitor.close(linger=0)
            sub.close(linger=0)
            self._close_replay()

    def _disconnected(self) -> None:
        log.info("zmq sync: replica %s: publisher %s disconnected", self.replica, self.state.source.endpoint)
        self.state.connected = False
        self.state.behind()

    async def _on_connected(self, backoff: Backoff) -> None:
        self.state.connected = True
        if backoff.delay:
            log.info("zmq sync: replica %s follows again", self.replica)
        backoff.succeeded()
        self.state.last_error = None
        # Connected anew: the publisher may have restarted meanwhile, and messages were missed.
        if self.state.seq is None:
            await self._resync("connected: following from the publisher's replay buffer")
        else:
            await self._catch_up("reconnected", lost=True)

    async def _drain(self, sub: zmq.asyncio.Socket) -> None:
        for _ in range(READ_COUNT):
            try:
                frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            await self._receive(frames)

    def _close_replay(self) -> None:
        if self._replay_socket is not None:
            self._replay_socket.close(linger=0)
            self._replay_socket = None

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        """Every batch the publisher holds from `start` on, as (seq, payload), oldest first."""
        if self._replay_socket is None:
            assert self.state.source.replay is not None
            self._replay_socket = self.ctx.socket(zmq.DEALER)
            self._replay_socket.setsockopt(zmq.LINGER, 0)
            self._replay_socket.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            self._replay_socket.connect(self.state.source.replay)
        sock = self._replay_socket
        try:
            await sock.send_multipart(replay_request(start))
            answers: list[tuple[int, bytes]] = []
            while await sock.poll(self.replay_timeout_ms):
                answer = read_replay_answer(await sock.recv_multipart())
                if answer is None:
                    self._replay_answers = True
                    return answers
                answers.append(answer)
        except MalformedEvents as error:
            self._close_replay()
            raise ReplayFailed(f"replay from {self.state.source.replay}: {error}") from None
        # A late answer to this request must not be read as the next one's: a new socket next time.
        self._close_replay()
        self._replay_answers = False
        raise ReplayFailed(f"no answer from {self.state.source.replay} within {self.replay_timeout_ms} ms")

    # -- following ---------------------------------------------------------------------------------

    async def _receive(self, frames: list[bytes]) -> None:
        size = sum(len(frame) for frame in frames)
        try:
            if size > self.max_message_bytes:
                raise MalformedEvents(f"a message of {size} bytes, over the {self.max_message_bytes} allowed")
            _, seq, payload = read_pub_frames(frames)
        except MalformedEvents as error:
            self._malformed(error)
            return
        state = self.state
        if state.seq is not None and seq <= state.seq:
            if self._recent.get(seq) == _digest(payload):
                return  # applied already, from the replay that overtook the live stream
            await self._resync(f"the publisher went back from seq {state.seq} to {seq}: it restarted")
        elif state.seq is not None and seq > state.seq + 1:
            state.behind()
            await self._catch_up(f"batches {state.seq + 1}..{seq - 1} missed", lost=True)
        if state.seq is not None and seq <= state.seq:
            return
        if state.seq is not None and seq > state.seq + 1:
            # The replay did not reach it: what lies between is lost for good.
            self._clear(f"batches {state.seq + 1}..{seq - 1} could not be replayed")
        self._apply(seq, payload)

    async def _idle(self) -> None:
        """Silence: check that nothing was missed (messages dropped, a publisher that restarted and
        has sent nothing since), where a replay socket has answered before."""
        if self.state.connected and self.state.seq is not None and self._replay_answers:
            await self._catch_up("idle check", lost=False)

    async def _catch_up(self, reason: str, *, lost: bool) -> None:
        """Replay from the last batch applied, checking that the publisher still holds it. `lost`:
        messages may have been missed, so a replay that fails clears the entries."""
        state = self.state
        assert state.seq is not None
        if state.source.replay is None:
            if lost:
                self._clear(f"{reason}, and the replica has no replay socket")
            return
        try:
            answers = await self._replay(state.seq)
        except ReplayFailed as error:
            self._replay_error(error)
            if lost:
                self._clear(f"{reason}, and the replay failed")
            return
        first = answers[0] if answers else None
        if first is None or first[0] != state.seq or _digest(first[1]) != self._recent.get(state.seq):
            await self._resync(
                f"{reason}: the publisher no longer holds batch {state.seq} as applied (it restarted, or "
                "its buffer moved past it)"
            )
            return
        resyncs = state.resyncs
        self._apply_run(answers[1:])
        if len(answers) > 1 and state.resyncs == resyncs:
            log.info("zmq sync: replica %s: %d batches replayed (%s)", self.replica, len(answers) - 1, reason)
            state.repairs += 1
        state.behind_since = None

    async def _resync(self, reason: str) -> None:
        """Clear the replica's entries and rebuild them from the publisher's whole replay buffer."""
        self._clear(reason)
        if self.state.source.replay is None:
            return
        try:
            answers = await self._replay(0)
        except ReplayFailed as error:
            self._replay_error(error)
            return
        if answers and answers[0][0] > 0:
            log.info(
                "zmq sync: replica %s: the publisher's history starts at seq %d; prefixes stored before "
                "it stay unknown until stored again",
                self.replica,
                answers[0][0],
            )
        self._apply_run(answers)

    def _apply_run(self, answers: list[tuple[int, bytes]]) -> None:
        """Apply replayed batches in order. A hole among them (batches the publisher itself lost)
        clears the entries, and following goes on after it."""
        for seq, payload in answers:
            if self.state.seq is not None and seq != self.state.seq + 1:
                self._clear(f"batches {self.state.seq + 1}..{seq - 1} are lost")
            self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        state = self.state
        try:
            batch = decode_batch(payload, self.max_message_bytes)
        except MalformedEvents as error:
            self._malformed(error)
            batch = None
        if batch is not None:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self.index.insert(self.replica, self.chains.stored(event))
                elif isinstance(event, BlockRemoved):
                    self.index.remove(self.replica, self.chains.removed(event))
                elif isinstance(event, AllBlocksCleared):
                    self.chains.clear()
                    self.index.clear(self.replica)
            state.batches_applied += 1
            state.last_applied_at = time.time()
            state.last_error = None
        state.seq = seq
        self._recent[seq] = _digest(payload)
        if len(self._recent) > RECENT_BATCHES:
            self._recent.popitem(last=False)

    def _clear(self, reason: str) -> None:
        level = logging.WARNING if self.index.blocks_of(self.replica) else logging.INFO
        log.log(level, "zmq sync: replica %s: %s; its index entries are cleared", self.replica, reason)
        self.index.clear(self.replica)
        self.chains.clear()
        self._recent.clear()
        self.state.seq = None
        self.state.resyncs += 1
        self.state.behind_since = None

    def _malformed(self, error: MalformedEvents) -> None:
        """A batch that cannot be read may have removed blocks: the entries are cleared, loudly."""
        self.rejections.reject("zmq", f"a malformed KV event message from replica {self.replica}", error)
        self.state.errors += 1
        self.state.last_error = f"MalformedEvents: {error}"
        self._clear("a batch could not be read")

    def _replay_error(self, error: ReplayFailed) -> None:
        log.warning("zmq sync: replica %s: %s", self.replica, error)
        self.state.errors += 1
        self.state.last_error = f"ReplayFailed: {error}"


class ZmqSync:
    """One ZMQ follower task per replica that publishes vLLM-format KV events, all feeding one index
    and sharing one ZMQ context. Used as gateway.sync.bundled_events.IndexSync is: the replica set calls
    `index.add_replica` before `start`, and `stop` before `index.drop_replica`."""

    def __init__(
        self,
        index: RadixIndex,
        *,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        idle_check_s: float = IDLE_CHECK_S,
        retry_max_s: float = RETRY_MAX_S,
        max_message_bytes: int = MAX_PAYLOAD_BYTES,
        rejections: Rejections | None = None,
    ) -> None:
        self.index = index
        self.replay_timeout_s = replay_timeout_s
        self.idle_check_s = idle_check_s
        self.retry_max_s = retry_max_s
        self.max_message_bytes = max_message_bytes
        self.rejections = rejections or Rejections()
        self._ctx: zmq.asyncio.Context | None = None
        self._followers: Followers[ZmqSyncState] = Followers()

    @property
    def states(self) -> dict[str, ZmqSyncState]:
        """The followed replicas' states by id (a copy; the states themselves are live)."""
        return self._followers.states

    def follows(self, replica_id: str) -> bool:
        return self._followers.get(replica_id) is not None

    def start(self, replica_id: str, model: str, block_size: int, source: ZmqSource) -> ZmqSyncState:
        """Follow a replica (already in the index) whose blocks hash under `model` in `block_size`
        tokens. A replica followed already keeps its follower."""
        state = self._followers.get(replica_id)
        if state is not None:
            return state
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        state = ZmqSyncState(replica_id, source)
        follower = ZmqFollower(
            state,
            self.index,
            Chains(model, block_size, state.skipped),
            self._ctx,
            replay_timeout_s=self.replay_timeout_s,
            idle_check_s=self.idle_check_s,
            retry_max_s=self.retry_max_s,
            max_message_bytes=self.max_message_bytes,
            rejections=self.rejections,
        )
        return self._followers.start(replica_id, state, follower.run(), "zmq-sync")

    def stop(self, replica_id: str) -> None:
        """Stop following a replica: it may be dropped from the index once this returns."""
        self._followers.stop(replica_id)

    async def close(self) -> None:
        await self._followers.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
