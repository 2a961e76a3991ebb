"""Keeps the gateway's RadixIndex exact for replicas that publish vLLM-format KV events over ZMQ
(docs/design.md §4): vLLM and SGLang started with their KV-events config, or bundled workers started with
`--kv-events-zmq`. The wire format is protocol.vllm_kv_events'.

Hashes. Every stored block is re-hashed from its token ids, chained from the replica's model root
(gateway.sync.zmq_chains, which also says what is skipped and why): the index is exact as far as the
history reaches, and a subset of the truth beyond.

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
from collections import OrderedDict
from dataclasses import dataclass

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.rejections import Rejections
from gateway.sync.followers import Followers
from gateway.sync.state import SyncState
from gateway.sync.zmq_chains import Chains
from protocol.backoff import RETRY_MAX_S, Backoff
from protocol.vllm_kv_events import (
    MAX_PAYLOAD_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedEvents,
    decode_batch,
    read_pub_frames,
    read_replay_answer,
    replay_request,
)
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


def _digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


@dataclass(frozen=True, slots=True)
class ZmqSource:
    """Where a replica publishes: its PUB endpoint and its replay (ROUTER) endpoint, if any."""

    endpoint: str
    replay: str | None


@dataclass(frozen=True, slots=True)
class ZmqSettings:
    """How every ZMQ follower of a gateway waits, retries and bounds what it reads."""

    replay_timeout_s: float = REPLAY_TIMEOUT_S
    idle_check_s: float = IDLE_CHECK_S
    retry_max_s: float = RETRY_MAX_S
    max_message_bytes: int = MAX_PAYLOAD_BYTES


class ReplayFailed(Exception):
    """The replay socket did not answer in time, or answered something else than replay frames."""


class ZmqFollower:
    """Follows one replica's publisher until cancelled (module docstring)."""

    def __init__(
        self,
        state: SyncState,
        index: RadixIndex,
        chains: Chains,
        ctx: zmq.asyncio.Context,
        settings: ZmqSettings,
        rejections: Rejections,
    ) -> None:
        self.state = state
        self.index = index
        self.chains = chains
        self.ctx = ctx
        self.max_message_bytes = settings.max_message_bytes
        self.rejections = rejections
        self.replay_timeout_ms = int(settings.replay_timeout_s * 1000)
        self.idle_check_ms = int(settings.idle_check_s * 1000)
        self.retry_max_s = settings.retry_max_s
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
        if not backoff.failing:
            log.warning("zmq sync: replica %s failed: %r; retrying with backoff", self.replica, error)
        self.state.failed(error)

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
            sub.connect(self.state.url)
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
        log.info("zmq sync: replica %s: publisher %s disconnected", self.replica, self.state.url)
        self.state.connected = False
        self.state.behind()

    async def _on_connected(self, backoff: Backoff) -> None:
        self.state.connected = True
        if backoff.failing:
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
            assert self.state.replay is not None
            self._replay_socket = self.ctx.socket(zmq.DEALER)
            self._replay_socket.setsockopt(zmq.LINGER, 0)
            self._replay_socket.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            self._replay_socket.connect(self.state.replay)
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
            raise ReplayFailed(f"replay from {self.state.replay}: {error}") from None
        # A late answer to this request must not be read as the next one's: a new socket next time.
        self._close_replay()
        self._replay_answers = False
        raise ReplayFailed(f"no answer from {self.state.replay} within {self.replay_timeout_ms} ms")

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
        if state.replay is None:
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
        if self.state.replay is None:
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
        self, index: RadixIndex, settings: ZmqSettings | None = None, rejections: Rejections | None = None
    ) -> None:
        self.index = index
        self.settings = settings or ZmqSettings()
        self.rejections = rejections or Rejections()
        self._ctx: zmq.asyncio.Context | None = None
        self._followers = Followers()

    @property
    def states(self) -> dict[str, SyncState]:
        """The followed replicas' states by id (a copy; the states themselves are live)."""
        return self._followers.states

    def follows(self, replica_id: str) -> bool:
        return self._followers.get(replica_id) is not None

    def start(self, replica_id: str, model: str, block_size: int, source: ZmqSource) -> SyncState:
        """Follow a replica (already in the index) whose blocks hash under `model` in `block_size`
        tokens. A replica followed already keeps its follower."""
        state = self._followers.get(replica_id)
        if state is not None:
            return state
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        state = SyncState(replica_id, source.endpoint, "zmq", replay=source.replay)
        chains = Chains(model, block_size, state.skipped)
        follower = ZmqFollower(state, self.index, chains, self._ctx, self.settings, self.rejections)
        return self._followers.start(replica_id, state, follower.run(), "zmq-sync")

    def stop(self, replica_id: str) -> None:
        """Stop following a replica: it may be dropped from the index once this returns."""
        self._followers.stop(replica_id)

    async def close(self) -> None:
        await self._followers.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
