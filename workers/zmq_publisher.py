"""Publishes a worker's KV events in vLLM's wire format over ZMQ (protocol.vllm_kv_events), as vLLM
does with `--kv-events-config`: `prefixgate worker --kv-events-zmq tcp://*:5557`.

A gateway then follows a bundled worker exactly as it follows vLLM or SGLang (gateway/sync/zmq_events.py),
and any consumer written for vLLM's events reads the worker's. Each sealed batch of the worker's
event log becomes one message numbered `log seq - 1`, so that a fresh worker starts at 0 with its
lone `cleared` batch, as a fresh vLLM publisher starts at 0. The last `buffer_steps` messages are
kept, encoded, for the replay socket. Batches that left the log's ring before they were published
are skipped: subscribers see the hole, cannot replay it, and start afresh, which is what they should.

Unlike vLLM, which binds only wildcard addresses and connects otherwise, the worker always binds both
sockets: it is the stable end, and gateways connect to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import zmq
import zmq.asyncio
from aiohttp import web

from protocol.cancellation import check_cancelled
from protocol.kv_events import EventBatch, KVEvent
from protocol.vllm_kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
    MalformedEvents,
    encode_batch,
    pub_frames,
    read_replay_request,
    replay_answer,
    replay_end,
)
from workers.app_state import RUNTIME, Context, Runtime
from workers.kv_event_log import EventsGone, StoredBlocks

log = logging.getLogger("prefixgate.worker.zmq")

# Batches read from the log at a time, and how long one read waits for the next batch.
MAX_BATCHES_PER_READ = 256
WAIT_S = 1.0
# At shutdown: how long the last messages may take to leave.
LINGER_MS = 500


@dataclass(frozen=True, slots=True)
class ZmqPublisherConfig:
    # Both bound (protocol.vllm_kv_events.check_endpoint with bind=True).
    endpoint: str
    replay_endpoint: str | None
    topic: str = ""
    # vLLM's defaults: messages kept for replay, and the PUB socket's high-water mark.
    buffer_steps: int = 10_000
    hwm: int = 100_000


def vllm_event(event: KVEvent, block_size: int) -> Event:
    """One event of the worker's log in vLLM's terms; the worker's chain hashes are its block hashes."""
    if event.type == "removed":
        return BlockRemoved(list(event.hashes), MEDIUM_GPU)
    if event.type == "cleared":
        return AllBlocksCleared()
    if not isinstance(event, StoredBlocks):
        raise TypeError("a stored event without its tokens: the log must be made with keep_tokens=True")
    return BlockStored(
        block_hashes=list(event.hashes),
        parent_block_hash=event.parent,
        token_ids=np.frombuffer(event.packed_tokens, "<u4").tolist(),
        block_size=block_size,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=None,
    )


class ZmqPublisher:
    """A PUB socket fed from the worker's event log, and a ROUTER answering replay requests from the
    buffer; two tasks on the worker's event loop."""

    def __init__(self, runtime: Runtime, config: ZmqPublisherConfig) -> None:
        if not runtime.worker.events.keep_tokens:
            raise ValueError("vLLM's events carry token ids: make the worker's KVEventLog with keep_tokens")
        self.runtime = runtime
        self.config = config
        self.topic = config.topic.encode()
        self.block_size = runtime.worker.info.block_size
        # (seq, payload) of the last messages sent, for replay.
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        # The log seq of the last batch published (or skipped as lost).
        self.published_seq = 0
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, config.hwm)
        self.pub.bind(config.endpoint)
        self.replay: zmq.asyncio.Socket | None = None
        if config.replay_endpoint is not None:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.bind(config.replay_endpoint)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow_log(), name="zmq-publish")]
        if self.replay is not None:
            self._tasks.append(asyncio.create_task(self._serve_replay(self.replay), name="zmq-replay"))

    async def stop(self) -> None:
        """Stop both tasks, send what the log sealed since, and close the sockets."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.runtime.feed.flush()
        with contextlib.suppress(EventsGone):
            while batches := self.runtime.worker.events.after(self.published_seq, MAX_BATCHES_PER_READ):
                await self._send_all(batches)
        self.pub.close(linger=LINGER_MS)
        if self.replay is not None:
            self.replay.close(linger=0)
        self.ctx.term()

    def encode(self, batch: EventBatch) -> bytes:
        events = [vllm_event(e, self.block_size) for e in batch.events]
        return encode_batch(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))

    async def publish(self, seq: int, payload: bytes) -> None:
        """Buffer one message for replay and send it (vLLM buffers it once sent; here the buffer
        comes first, so that a subscriber that saw it can always replay up to it)."""
        self.buffer.append((seq, payload))
        await self.pub.send_multipart(pub_frames(self.topic, seq, payload))

    async def _send_all(self, batches: list[EventBatch]) -> None:
        for batch in batches:
            await self.publish(batch.seq - 1, self.encode(batch))
            self.published_seq = batch.seq

    async def _follow_log(self) -> None:
        feed = self.runtime.feed
        loop = asyncio.get_running_loop()
        while True:
            check_cancelled()
            asked = loop.time()
            try:
                batches = await feed.wait_after(self.published_seq, WAIT_S, MAX_BATCHES_PER_READ)
            except EventsGone as gone:
                log.warning(
                    "zmq: batches %d..%d left the event ring unpublished; subscribers start afresh",
                    self.published_seq + 1,
                    gone.seq,
                )
                self.published_seq = gone.seq
                continue
            if not batches and loop.time() - asked < WAIT_S / 2:
                return  # the feed closed early: the worker is stopping, and stop() sends the rest
            await self._send_all(batches)

    async def _serve_replay(self, replay: zmq.asyncio.Socket) -> None:
        while True:
            frames = await replay.recv_multipart()
            try:
                client, start = read_replay_request(frames)
            except MalformedEvents as error:
                log.warning("zmq: replay request refused: %s", error)
                continue
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await replay.send_multipart(replay_answer(client, seq, payload))
            await replay.send_multipart(replay_end(client))


def zmq_context(config: ZmqPublisherConfig) -> Context:
    """The aiohttp cleanup context that runs a publisher for the app's worker."""

    async def publish(app: web.Application) -> AsyncIterator[None]:
        publisher = ZmqPublisher(app[RUNTIME], config)
        log.info("zmq: publishing KV events on %s (replay: %s)", config.endpoint, config.replay_endpoint)
        publisher.start()
        yield
        await publisher.stop()

    return publish
