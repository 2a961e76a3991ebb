"""The processes of one `prefixgate serve --workers N`, routing as one gateway.

Each process routes the connections its socket accepts (SO_REUSEPORT: the kernel spreads them) and
keeps its own index, followers and tokenizers. What one process decides changes what the others should
decide, so each tells its siblings, through the parent's relay (gateway.process_group):

- its requests in flight on each replica (placed, first token, ended), counted in the replica's load
  by every process (gateway.fleet.replicas);
- without Redis, its approximate-mode predictions and learned capacities (gateway.fleet.predictions)
  and the owners of the responses it relayed (gateway.fleet.response_owners); with Redis those go
  through Redis, as between gateways on different hosts;
- replicas added, drained or removed through its admin API;
- its metrics, when a scrape reaches another process (that one answers for all of them).

Messages are tuples (kind, sender, ...), many to a frame (gateway.sync.sibling_wire). A process
sends at most one frame per turn of its event loop, so the relay costs a write per turn, not per
request. The relay tells the others when a process exits ("gone"), which ends its requests in their
accounting. When the relay goes away (the parent died), the process stops itself: nobody supervises it
any more.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
import time
from typing import Any, Protocol

import msgspec
from redis.asyncio import Redis

from gateway.fleet.replicas import Replica, Source
from gateway.gateway_config import ReplicaEntry
from gateway.gateway_state import GatewayState
from gateway.sync.sibling_wire import EVERYONE, SEND_BUFFER_BYTES, decode_messages, frame, read_frame

log = logging.getLogger("prefixgate.gateway.siblings")

# How long a scrape waits for the siblings' metrics.
SCRAPE_WAIT_S = 1.0
# The fields after (kind, sender) of the messages that feed a replica's load: checked before they
# reach it, where a wrong type would fail every later decision on that replica.
_ACCOUNTING: dict[str, tuple[type | tuple[type, ...], ...]] = {
    "dispatched": (str, int, (int, float), int, int),
    "started": (str, int),
    "finished": (str, int),
}


class Gateway(Protocol):
    """What of the gateway's lifecycle (gateway.gateway.Gateway) a sibling's messages act on."""

    state: GatewayState
    redis: Redis | None

    async def add_entry(self, entry: ReplicaEntry, source: Source) -> Replica | None: ...

    async def deactivate(self, replica_id: str) -> Replica | None: ...

    def refresh_metrics(self) -> None: ...


class Siblings:
    """This process's link to the others: what it tells them, and what it takes from them."""

    def __init__(self, index: int, count: int, sock: socket.socket) -> None:
        self.index = index
        self.count = count
        self._sock = sock
        self._gw: Gateway | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[int, list[tuple[Any, ...]]] = {}
        self._flush_scheduled = False
        self._asks = itertools.count(1)
        self._scrapes: dict[int, tuple[asyncio.Future[None], dict[int, bytes]]] = {}
        self._admin_tasks: set[asyncio.Task[None]] = set()
        self.sent = 0
        self.received = 0
        self.dropped = 0
        self.malformed = 0

    async def start(self, gw: Gateway) -> None:
        """Connect to the relay and hook into the state's accounting (on the gateway's loop, once its
        predictions and response owners exist)."""
        self._gw = gw
        state = gw.state
        reader, self._writer = await asyncio.open_unix_connection(sock=self._sock)
        state.replicas.announce = self._announce
        if gw.redis is None:
            state.predictions.share = lambda fields: self.send(("prediction", self.index, fields))
            state.response_owners.share = lambda rid, replica, expires: self.send(
                ("owner", self.index, rid, replica, expires)
            )
        self._reader_task = asyncio.create_task(self._read(reader), name="siblings:read")

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, *self._admin_tasks, return_exceptions=True)
        if self._writer is not None:
            self._flush()
            self._writer.close()

    def stats(self) -> dict[str, int]:
        return {
            "process": self.index,
            "processes": self.count,
            "sent": self.sent,
            "received": self.received,
            "dropped": self.dropped,
            "malformed": self.malformed,
        }

    # -- sending -----------------------------------------------------------------------------

    def send(self, message: tuple[Any, ...], to: int = EVERYONE) -> None:
        """Queue `message` for the next frame (sent once the loop's current turn is done)."""
        self._pending.setdefault(to, []).append(message)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _announce(self, message: tuple[object, ...]) -> None:
        kind, *rest = message
        self.send((kind, self.index, *rest))

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        writer = self._writer
        for to, messages in pending.items():
            if writer is None or writer.is_closing():
                self.dropped += len(messages)
            elif writer.transport.get_write_buffer_size() > SEND_BUFFER_BYTES:
                if self.dropped == 0:
                    log.warning("the sibling relay is not keeping up: dropping messages (counted)")
                self.dropped += len(messages)
            else:
                writer.write(frame(messages, to))
                self.sent += len(messages)

    # -- taking -------------------------------------------------------------------------------

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                _, payload = await read_frame(reader)
                try:
                    messages = decode_messages(payload)
                except msgspec.DecodeError as error:
                    self._malformed(payload[:64], error)
                    continue
                for message in messages:
                    self.received += 1
                    try:
                        self._take(message)
                    except (ValueError, TypeError, KeyError, IndexError) as error:
                        self._malformed(message, error)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as error:
            # The parent is gone, or speaks nonsense: without a supervisor this process stops.
            log.error("the sibling relay closed (%r): stopping this gateway process", error)
            os.kill(os.getpid(), signal.SIGTERM)

    def _malformed(self, what: object, error: Exception) -> None:
        self.malformed += 1
        log.warning("a malformed sibling message %.200r: %r", what, error)

    def _take(self, message: list[Any]) -> None:
        gw = self._gw
        assert gw is not None
        state = gw.state
        kind, sender, *rest = message
        if not isinstance(sender, int):
            raise TypeError(f"sender {sender!r} is not a process index")
        types = _ACCOUNTING.get(kind)
        if types is not None and (
            len(rest) != len(types) or not all(isinstance(v, t) for v, t in zip(rest, types, strict=True))
        ):
            raise TypeError(f"{kind} takes {len(types)} fields of types {types}")
        if kind == "dispatched":
            state.replicas.sibling_dispatched(sender, *rest)
        elif kind == "started":
            state.replicas.sibling_started(sender, *rest)
        elif kind == "finished":
            state.replicas.sibling_finished(sender, *rest)
        elif kind == "gone":
            state.replicas.sibling_gone(sender)
        elif kind == "prediction":
            (fields,) = rest
            state.predictions.take(fields)
        elif kind == "owner":
            response_id, replica_id, expires_at = rest
            if expires_at > time.time():
                state.response_owners.keep(str(response_id), str(replica_id), float(expires_at))
        elif kind == "admin":
            self._admin(gw, *rest)
        elif kind == "scrape":
            (ask,) = rest
            gw.refresh_metrics()
            self.send(("metrics", self.index, ask, state.metrics.render()), to=sender)
        elif kind == "metrics":
            ask, text = rest
            waiting = self._scrapes.get(ask)
            if waiting is not None:
                future, parts = waiting
                parts[sender] = bytes(text)
                if len(parts) >= self.count - 1 and not future.done():
                    future.set_result(None)
        else:
            raise ValueError(f"unknown kind {kind!r}")

    def _admin(self, gw: Gateway, action: str, *args: Any) -> None:
        """A change made through a sibling's admin API, made here too."""
        if action == "add":
            (body,) = args
            entry = ReplicaEntry.model_validate(body, strict=True)
            task = asyncio.create_task(gw.add_entry(entry, "admin"), name="siblings:add")
        elif action == "remove":
            (replica_id,) = args
            task = asyncio.create_task(gw.deactivate(replica_id), name="siblings:remove")
        elif action == "drain":
            replica_id, draining = args
            replica = gw.state.replicas.get(replica_id)
            if replica is not None:
                replica.draining = bool(draining)
            return
        else:
            raise ValueError(f"unknown admin action {action!r}")
        self._admin_tasks.add(task)
        task.add_done_callback(self._admin_tasks.discard)

    # -- metrics ------------------------------------------------------------------------------

    async def scrape(self) -> dict[int, bytes]:
        """The other processes' metrics, by process: those that answered within SCRAPE_WAIT_S."""
        if self.count <= 1:
            return {}
        ask = next(self._asks)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        parts: dict[int, bytes] = {}
        self._scrapes[ask] = (future, parts)
        self.send(("scrape", self.index, ask))
        try:
            await asyncio.wait_for(future, SCRAPE_WAIT_S)
        except TimeoutError:
            missing = sorted(set(range(self.count)) - set(parts) - {self.index})
            log.warning("metrics: processes %s did not answer in %.1f s", missing, SCRAPE_WAIT_S)
        finally:
            del self._scrapes[ask]
        return dict(parts)
