"""One replica's answer as the forward path reads it (docs/design.md §2 step 6): its head, then its body
as the bytes arrive, and the errors an exchange ends in. The connections it arrives on are
gateway.forward.upstream_client's.

Timeouts: `read_s` is the replica's silence while the gateway waits on it (for the head, or for the next
bytes of the body). A consumer that stops reading (a slow client) pauses the socket instead of buffering
without bound, and its pause is not the replica's silence.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from multidict import CIMultiDict

# Buffered answer bytes past which the socket is paused until the consumer catches up.
_HIGH_WATER = 256 * 1024
# A body read whole (an answer that is not a stream), at most.
MAX_BODY_BYTES = 256 * 1024 * 1024


def header_count(value: str | None) -> int | None:
    """A count a replica sent in a header (cached or transferred tokens), or None for anything but a
    plain decimal: headers are read as Latin-1, where `²` passes str.isdigit() and fails int()."""
    if value is None or not (value.isascii() and value.isdigit() and len(value) < 16):
        return None
    return int(value)


class UpstreamError(Exception):
    """The replica could not be reached, or broke off or garbled its answer. `kind` labels metrics."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def error_kind(error: TimeoutError | UpstreamError) -> str:
    """How an exchange failed, as metrics label it."""
    return error.kind if isinstance(error, UpstreamError) else "timeout"


class Carrier(Protocol):
    """The connection an answer arrives on, as the answer drives it."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def idle(self) -> None: ...

    def close(self) -> None: ...


class UpstreamResponse:
    """One answer on one connection: its status and headers once the head has arrived, then its body
    chunk by chunk. `release()` (always, in a finally) returns a fully read connection to the pool and
    closes any other, which is how a replica learns that the client left."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_error",
        "_keep_alive",
        "_last_data",
        "_loop",
        "_read_s",
        "_released",
        "_timer",
        "_waiter",
        "complete",
        "got_bytes",
        "head_read",
        "headers",
        "status",
    )

    def __init__(self, conn: Carrier, loop: asyncio.AbstractEventLoop, read_s: float) -> None:
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self._conn = conn
        self._loop = loop
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self.head_read = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self.complete = False
        self._keep_alive = False
        self._released = False
        self._read_s = read_s
        self._last_data = loop.time()
        self._timer = loop.call_at(self._last_data + read_s, self._check_silence)
        self.got_bytes = False

    # -- reading (the proxy's side) ------------------------------------------------------------

    async def read_chunk(self) -> bytes:
        """Every body byte buffered now, waiting for some if none is; b"" once the body has ended."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            await self._wait()
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if self._buffered > _HIGH_WATER:
            self._conn.resume()
        self._buffered = 0
        return data

    @property
    def at_end(self) -> bool:
        """Whether the body has ended and every byte of it was read."""
        return self.complete and not self._chunks

    async def read(self, limit: int = MAX_BODY_BYTES) -> bytes:
        """The whole body, failing past `limit` bytes instead of holding what a replica sends without end."""
        parts = []
        size = 0
        while chunk := await self.read_chunk():
            size += len(chunk)
            if size > limit:
                raise UpstreamError("too_large", f"the replica's answer is over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._timer.cancel()
        if self.complete and self._keep_alive and self._error is None:
            self._conn.idle()
        else:
            self._conn.close()

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        self._last_data = max(self._last_data, self._loop.time())
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def wait_head(self) -> None:
        while not self.head_read:
            if self._error is not None:
                raise self._error
            await self._wait()

    # -- events (the connection's side) --------------------------------------------------------

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def on_bytes(self) -> None:
        self.got_bytes = True
        self._last_data = self._loop.time()

    def on_head(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.status = status
        self.headers = CIMultiDict(headers)
        self.head_read = True
        self._wake()

    def on_body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER:
            self._conn.pause()
        self._wake()

    def on_end(self, keep_alive: bool) -> None:
        if self._error is not None:
            return
        self.complete = True
        self._keep_alive = keep_alive
        self._timer.cancel()
        self._wake()

    def on_overrun(self) -> None:
        """Bytes came past the end of this answer: it stands as it was, and its connection is not reused."""
        self._keep_alive = False

    def fail(self, error: BaseException) -> None:
        if self.complete or self._error is not None:
            return
        self._error = error
        self._timer.cancel()
        self._wake()

    def _check_silence(self) -> None:
        """The read timeout, one timer per answer: re-armed from the last data instead of being
        cancelled and rescheduled on every chunk; only a waiting reader can time out."""
        if self.complete or self._error is not None:
            return
        now = self._loop.time()
        if self._waiter is None:
            self._timer = self._loop.call_at(now + self._read_s, self._check_silence)
            return
        due = self._last_data + self._read_s
        if now < due:
            self._timer = self._loop.call_at(due, self._check_silence)
            return
        self.fail(TimeoutError(f"the replica sent nothing for {self._read_s:g} s"))
        self._conn.close()
