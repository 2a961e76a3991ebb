"""Moving a prompt's KV blocks from a prefill worker to a decode worker (DESIGN §4, disaggregation).

A protocol of our own over one TCP connection (asyncio streams) per transfer, pushed by the sender:

    sender -> receiver   b"PGKV", u32 header length, header JSON:
                         {"id": transfer id, "layout": KV layout, "block_bytes": n,
                          "group_blocks": g, "hashes": [...]}
                         then len(hashes) * block_bytes bytes, in groups of g blocks (the last one
                         shorter): each group's K and V for every layer as raw tensor bytes, in the
                         order the store reads and writes a group (no pickling)
    receiver -> sender   u32 length, JSON {"ok": true, "received": n} or {"ok": false, "error": ...}

The receiver has reserved a block for each hash it expects (BlockManager.reserve) before the sender
is even asked, so the bytes go straight from the socket into a staging buffer (pinned host memory on
CUDA) and from there into the reserved blocks, a group of blocks at a time: never a whole prompt's
KV in host memory at once. The hashes must be the reservation's, in order (a prefix of them when the
sender lost some of its copy to eviction): a block is only ever written where its hash says it goes.

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

MAGIC = b"PGKV"
_LENGTH = struct.Struct("<I")
# Blocks read, sent, staged and written to the cache at once: bounds host memory per transfer, and
# what a receiver accepts at most.
GROUP_BLOCKS = 32
MAX_GROUP_BLOCKS = 256
MAX_HEADER_BYTES = 16 * 2**20


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
    """The receiving end, on a decode worker: accepts pushes for the transfers it was told to expect.

    Bytes land in the reserved blocks on the event loop thread, so a transfer given up (`forget`,
    when its client leaves or it times out) is never written to after: its reservation can be
    released at once.
    """

    store: KVStore
    host: str = "127.0.0.1"
    port: int = 0
    _expected: dict[str, Incoming] = field(default_factory=dict)
    _server: asyncio.Server | None = None

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
        incoming: Incoming | None = None
        try:
            if await reader.readexactly(len(MAGIC)) != MAGIC:
                raise TransferError("not a prefixgate KV transfer")
            header = await _read_frame(reader, MAX_HEADER_BYTES)
            incoming = self._expected_for(header)
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
            if incoming is not None:
                self._expected.pop(incoming.transfer_id, None)
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.close()

    def _expected_for(self, header: dict[str, Any]) -> Incoming:
        transfer_id = str(header.get("id"))
        incoming = self._expected.get(transfer_id)
        if incoming is None or incoming.closed:
            raise TransferError(f"no transfer {transfer_id} is expected here")
        return incoming

    def _check(self, header: dict[str, Any], incoming: Incoming) -> None:
        """Refuse bytes of another shape, or for other blocks than the ones reserved for them."""
        store = self.store
        if header.get("layout") != store.kv_layout or header.get("block_bytes") != store.kv_block_bytes:
            raise TransferError(
                f"KV layout {header.get('layout')!r} ({header.get('block_bytes')} bytes a block) does not "
                f"match this worker's {store.kv_layout!r} ({store.kv_block_bytes})"
            )
        hashes = header.get("hashes")
        if not isinstance(hashes, list) or hashes != incoming.hashes[: len(hashes)]:
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
            while filled < size:
                chunk = await reader.read(min(size - filled, 2**20))
                if not chunk:
                    raise TransferError(f"the sender closed after {start * block_bytes + filled} bytes")
                view[filled : filled + len(chunk)] = chunk
                filled += len(chunk)
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
) -> int:
    """Push `blocks` (holding `hashes`, held so that nothing overwrites them meanwhile) to a receiver;
    the number of blocks it acknowledged."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as error:
        raise TransferError(f"cannot reach the receiver at {host}:{port}: {error}") from error
    try:
        header = {
            "id": transfer_id,
            "layout": store.kv_layout,
            "block_bytes": store.kv_block_bytes,
            "group_blocks": GROUP_BLOCKS,
            "hashes": hashes,
        }
        writer.write(MAGIC + _frame(header))
        for start in range(0, len(blocks), GROUP_BLOCKS):
            writer.write(store.read_blocks(blocks[start : start + GROUP_BLOCKS]))
            await writer.drain()
        reply = await _read_frame(reader, MAX_HEADER_BYTES)
    except (asyncio.IncompleteReadError, OSError) as error:
        raise TransferError(f"the receiver closed the connection without an answer: {error!r}") from error
    finally:
        writer.close()
    if reply.get("ok") is not True:
        raise TransferError(f"the receiver refused the transfer: {reply.get('error')}")
    return int(reply.get("received", 0))
