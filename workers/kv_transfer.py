"""Moving a prompt's KV blocks from a prefill worker to a decode worker (docs/design.md §4, disaggregation).

A protocol of our own over one TCP connection (asyncio streams) per transfer, pushed by the sender:

    sender -> receiver   b"PGKV", u32 header length, header JSON:
                         {"id": transfer id, "layout": KV layout, "block_bytes": n,
                          "group_blocks": g, "hashes": [...], "mac": HMAC}
                         then len(hashes) * block_bytes bytes, in groups of g blocks (the last one
                         shorter): each group's K and V for every layer as raw tensor bytes, in the
                         order the store reads and writes a group (no pickling)
    receiver -> sender   u32 length, JSON {"ok": true, "received": n} or {"ok": false, "error": ...}

The receiver has reserved a block for each hash it expects (BlockManager.reserve) before the sender
is even asked, so the bytes go straight from the socket into a staging buffer (pinned host memory on
CUDA) and from there into the reserved blocks, a group of blocks at a time: never a whole prompt's
KV in host memory at once. The hashes must be the reservation's, in order (a prefix of them when the
sender lost some of its copy to eviction): a block is only ever written where its hash says it goes.

Only a holder of the fleet's transfer secret can push (protocol.transfer_auth): the header's `mac` is
its HMAC over the transfer id, layout and hashes, checked before anything of the transfer is touched,
so a push that fails it (a guessed or observed id, another secret) changes nothing, not even the
transfer it names, which its real sender can still complete. The port is open to the network, so it
bounds what one connection may cost: a header no longer than the longest expected transfer's hashes
need, a deadline on the header and on each group of blocks, and a cap on connections at once. A bad
frame ends its own connection only.

On CUDA this stages through host memory on both sides; a production deployment would replace the two
copies and the TCP hop with NCCL or NIXL (GPU to GPU over NVLink or RDMA) behind the same calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import orjson

from protocol.transfer_auth import push_signature, verify

MAGIC = b"PGKV"
_LENGTH = struct.Struct("<I")
# Blocks read, sent, staged and written to the cache at once: bounds host memory per transfer, and
# what a receiver accepts at most.
GROUP_BLOCKS = 32
MAX_GROUP_BLOCKS = 256
# A header's size beyond its hashes (id, layout, numbers, mac), and per hash (a u64 in decimal, a comma).
HEADER_BASE_BYTES = 4096
HEADER_BYTES_PER_HASH = 21
MAX_REPLY_BYTES = 64 * 1024
# How long a header, a group of blocks, or the receiver's answer may take to arrive (or a group to be
# taken by a receiver), and how many connections a receiver serves at once.
READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64


class TransferError(RuntimeError):
    """A transfer that did not complete: refused, cut off, or late."""


@runtime_checkable
class KVStore(Protocol):
    """What a transfer reads from and writes to: an engine's KV cache, block by block."""

    @property
    def kv_layout(self) -> str:
        """Dtype and shape of one block's bytes: both ends must agree on it."""
        ...

    @property
    def kv_block_bytes(self) -> int: ...

    def staging(self, num_bytes: int) -> memoryview:
        """A writable host buffer the receiver fills from the socket (pinned memory on CUDA)."""
        ...

    def read_blocks(self, blocks: list[int]) -> memoryview:
        """The blocks' bytes, block-major, in host memory."""
        ...

    def write_blocks(self, blocks: list[int], data: memoryview) -> None:
        """Copy `data` (read_blocks' format) into the blocks."""
        ...


class NoKV:
    """The simulated engine's cache: it has no tensors, so a transfer moves hashes and no bytes."""

    kv_layout = "sim"
    kv_block_bytes = 0

    def staging(self, num_bytes: int) -> memoryview:
        return memoryview(bytearray(num_bytes))

    def read_blocks(self, blocks: list[int]) -> memoryview:
        return memoryview(b"")

    def write_blocks(self, blocks: list[int], data: memoryview) -> None:
        return None


@dataclass(slots=True)
class Incoming:
    """A transfer the receiver expects: where each hash's bytes go, and how it ends."""

    transfer_id: str
    hashes: list[int]
    blocks: list[int]
    done: asyncio.Future[int]
    received: int = 0
    closed: bool = False
    # An authenticated push for it is being read: another one is refused.
    receiving: bool = False
    # Blocks per group, as the sender announced.
    group: int = GROUP_BLOCKS


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> dict[str, Any]:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > limit:
        raise TransferError(f"a {length}-byte frame header exceeds {limit}")
    parsed = orjson.loads(await reader.readexactly(length))
    if not isinstance(parsed, dict):
        raise TransferError("a frame header is not a JSON object")
    return parsed


def _frame(obj: dict[str, Any]) -> bytes:
    data = orjson.dumps(obj)
    return _LENGTH.pack(len(data)) + data


@dataclass(slots=True)
class TransferServer:
    """The receiving end, on a decode worker: accepts authenticated pushes for the transfers it was told
    to expect.

    Bytes land in the reserved blocks on the event loop thread, so a transfer given up (`forget`,
    when its client leaves or it times out) is never written to after: its reservation can be
    released at once.
    """

    store: KVStore
    secret: bytes
    host: str = "127.0.0.1"
    port: int = 0
    read_timeout_s: float = READ_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    _expected: dict[str, Incoming] = field(default_factory=dict)
    _server: asyncio.Server | None = None
    _connections: int = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        for incoming in self._expected.values():
            self._end(incoming, TransferError("the receiving worker is shutting down"))
        self._expected.clear()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def expect(self, transfer_id: str, hashes: list[int], blocks: list[int]) -> asyncio.Future[int]:
        """Accept a push of `hashes` into `blocks`; the future gives the number of blocks received."""
        if transfer_id in self._expected:
            raise ValueError(f"transfer {transfer_id} is already expected")
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._expected[transfer_id] = Incoming(transfer_id, list(hashes), list(blocks), done)
        return done

    def forget(self, transfer_id: str) -> None:
        """Give a transfer up: whatever still arrives for it is refused, and nothing is written."""
        incoming = self._expected.pop(transfer_id, None)
        if incoming is not None:
            self._end(incoming, TransferError(f"transfer {transfer_id} was given up"))

    def header_limit(self) -> int:
        """The largest header an expected transfer's push needs: the bound on what one is read."""
        longest = max((len(incoming.hashes) for incoming in self._expected.values()), default=0)
        return HEADER_BASE_BYTES + HEADER_BYTES_PER_HASH * longest

    @staticmethod
    def _end(incoming: Incoming, outcome: int | BaseException) -> None:
        incoming.closed = True
        if incoming.done.done():
            return
        if isinstance(outcome, BaseException):
            incoming.done.set_exception(outcome)
            incoming.done.exception()  # retrieved here: nobody may be waiting any more
        else:
            incoming.done.set_result(outcome)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._connections >= self.max_connections:
            writer.close()
            return
        self._connections += 1
        incoming: Incoming | None = None
        try:
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    if await reader.readexactly(len(MAGIC)) != MAGIC:
                        raise TransferError("not a prefixgate KV transfer")
                    header = await _read_frame(reader, self.header_limit())
            except TimeoutError:
                raise TransferError(f"no whole header within {self.read_timeout_s:g} s") from None
            incoming = self._authorised(header)
            self._check(header, incoming)
            await self._receive(reader, incoming)
            writer.write(_frame({"ok": True, "received": incoming.received}))
            self._end(incoming, incoming.received)
        except (TransferError, ValueError, OSError, asyncio.IncompleteReadError) as error:
            message = f"{type(error).__name__}: {error}"
            if incoming is not None:
                self._end(incoming, TransferError(message))
            writer.write(_frame({"ok": False, "error": message}))
        finally:
            self._connections -= 1
            if incoming is not None:
                self._expected.pop(incoming.transfer_id, None)
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.close()

    def _authorised(self, header: dict[str, Any]) -> Incoming:
        """The expected transfer a header is for, once its MAC proves a secret holder sent it; until
        then nothing of that transfer is touched, so a forged push cannot fail a real one."""
        transfer_id = header.get("id")
        incoming = self._expected.get(transfer_id) if isinstance(transfer_id, str) else None
        fields = (header.get("layout"), header.get("block_bytes"), header.get("group_blocks"))
        hashes = header.get("hashes")
        if (
            incoming is None
            or incoming.closed
            or not isinstance(hashes, list)
            or not verify(self.secret, header.get("mac"), "push", transfer_id, *fields, hashes)
        ):
            raise TransferError(f"no transfer {str(transfer_id)[:64]!r} is expected here from this sender")
        if incoming.receiving:
            raise TransferError(f"transfer {transfer_id} is already being received")
        incoming.receiving = True
        return incoming

    def _check(self, header: dict[str, Any], incoming: Incoming) -> None:
        """Refuse bytes of another shape, or for other blocks than the ones reserved for them."""
        store = self.store
        if header.get("layout") != store.kv_layout or header.get("block_bytes") != store.kv_block_bytes:
            raise TransferError(
                f"KV layout {header.get('layout')!r} ({header.get('block_bytes')} bytes a block) does not "
                f"match this worker's {store.kv_layout!r} ({store.kv_block_bytes})"
            )
        hashes = header["hashes"]
        if hashes != incoming.hashes[: len(hashes)]:
            raise TransferError("the blocks sent are not the ones reserved for them")
        group = header.get("group_blocks")
        if type(group) is not int or not 0 < group <= MAX_GROUP_BLOCKS:
            raise TransferError(f"group_blocks must be an integer in [1, {MAX_GROUP_BLOCKS}], got {group!r}")
        incoming.hashes = hashes
        incoming.group = group

    async def _receive(self, reader: asyncio.StreamReader, incoming: Incoming) -> None:
        block_bytes = self.store.kv_block_bytes
        count, step = len(incoming.hashes), incoming.group
        staging = self.store.staging(min(count, step) * block_bytes)
        for start in range(0, count, step):
            group = incoming.blocks[start : min(start + step, count)]
            size = len(group) * block_bytes
            view = staging[:size]
            filled = 0
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    while filled < size:
                        chunk = await reader.read(min(size - filled, 2**20))
                        if not chunk:
                            raise TransferError(
                                f"the sender closed after {start * block_bytes + filled} bytes"
                            )
                        view[filled : filled + len(chunk)] = chunk
                        filled += len(chunk)
            except TimeoutError:
                raise TransferError(
                    f"a group of {len(group)} blocks did not arrive within {self.read_timeout_s:g} s"
                ) from None
            if incoming.closed:
                raise TransferError("the transfer was given up while it ran")
            self.store.write_blocks(group, view)
            incoming.received = start + len(group)


async def send_blocks(
    host: str,
    port: int,
    transfer_id: str,
    hashes: list[int],
    blocks: list[int],
    store: KVStore,
    *,
    secret: bytes,
    timeout_s: float = READ_TIMEOUT_S,
) -> int:
    """Push `blocks` (holding `hashes`, held so that nothing overwrites them meanwhile) to a receiver,
    signed with the fleet's secret; the number of blocks it acknowledged. Each step (connecting, a
    group taken, the answer) has `timeout_s`: a stalled receiver ends the push, not holds it."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError) as error:
        raise TransferError(f"cannot reach the receiver at {host}:{port}: {error!r}") from error
    try:
        header = {
            "id": transfer_id,
            "layout": store.kv_layout,
            "block_bytes": store.kv_block_bytes,
            "group_blocks": GROUP_BLOCKS,
            "hashes": hashes,
        }
        header["mac"] = push_signature(
            secret, transfer_id, store.kv_layout, store.kv_block_bytes, GROUP_BLOCKS, hashes
        )
        writer.write(MAGIC + _frame(header))
        for start in range(0, len(blocks), GROUP_BLOCKS):
            writer.write(store.read_blocks(blocks[start : start + GROUP_BLOCKS]))
            async with asyncio.timeout(timeout_s):
                await writer.drain()
        async with asyncio.timeout(timeout_s):
            reply = await _read_frame(reader, MAX_REPLY_BYTES)
    except TimeoutError:
        raise TransferError(f"the receiver at {host}:{port} stalled for {timeout_s:g} s") from None
    except (asyncio.IncompleteReadError, OSError) as error:
        raise TransferError(f"the receiver closed the connection without an answer: {error!r}") from error
    finally:
        writer.close()
    received = reply.get("received")
    if reply.get("ok") is not True or type(received) is not int:
        raise TransferError(f"the receiver refused the transfer: {str(reply.get('error'))[:300]}")
    return received
