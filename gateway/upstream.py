"""The gateway's HTTP/1.1 client for the forward path (DESIGN §2 step 6).

Every routed request crosses it twice (request out, answer back), so it does only what a reverse
proxy needs: keep-alive connections per replica, the request head and body in one write, the answer
parsed by llhttp (httptools) and handed on as the bytes arrive. aiohttp's ClientSession, which the
gateway keeps for health checks, KV sync and load polls, spent about as much CPU per request as the
rest of the request path together (URL objects, cookie and tracing hooks, a StreamReader and a timer
per response).

Timeouts: `connect_s` to open a connection; `read_s` for the replica's silence while the gateway waits
on it (for the head, or for the next bytes of the body). A consumer that stops reading (a slow client)
pauses the socket instead of buffering without bound, and its pause is not the replica's silence.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

# Buffered answer bytes past which the socket is paused until the consumer catches up.
_HIGH_WATER = 256 * 1024
SENT_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
# Idle connections kept per replica: a burst's extra connections are closed once it has passed.
MAX_IDLE_PER_ORIGIN = 128


class UpstreamError(Exception):
    """The replica could not be reached, or broke off or garbled its answer. `kind` labels metrics."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def error_kind(error: TimeoutError | UpstreamError) -> str:
    """How an exchange failed, as metrics label it."""
    return error.kind if isinstance(error, UpstreamError) else "timeout"


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str
    port: int
    # The URL's path, which every request path is appended to ("" for none).
    base: str
    # The Host header's value.
    authority: str


@lru_cache(maxsize=1024)
def origin_of(url: str) -> Origin:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"a replica URL must be http:// or https:// with a host, got {url!r}")
    default = 443 if parts.scheme == "https" else 80
    port = parts.port or default
    try:
        host = parts.hostname.encode("idna").decode("ascii")  # the Host header is ASCII
    except UnicodeError as error:
        raise ValueError(f"the host of {url!r} is not a valid name: {error}") from None
    shown = f"[{host}]" if ":" in host else host
    authority = shown if port == default else f"{shown}:{port}"
    return Origin(parts.scheme, host, port, parts.path.rstrip("/"), authority)


class UpstreamResponse:
    """One answer on one connection: its status and headers once the head has arrived, then its body
    chunk by chunk. `release()` (always, in a finally) returns a fully read connection to the pool and
    closes any other, which is how a replica learns that the client left."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_complete",
        "_conn",
        "_error",
        "_got_bytes",
        "_head",
        "_keep_alive",
        "_last_data",
        "_loop",
        "_read_s",
        "_released",
        "_timer",
        "_waiter",
        "headers",
        "status",
    )

    def __init__(self, conn: _Connection, loop: asyncio.AbstractEventLoop, read_s: float) -> None:
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self._conn = conn
        self._loop = loop
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._head = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._complete = False
        self._keep_alive = False
        self._released = False
        self._read_s = read_s
        self._last_data = loop.time()
        self._timer = loop.call_at(self._last_data + read_s, self._check_silence)
        self._got_bytes = False

    # -- reading (the proxy's side) ------------------------------------------------------------

    async def read_chunk(self) -> bytes:
        """Every body byte buffered now, waiting for some if none is; b"" once the body has ended."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._complete:
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
        return self._complete and not self._chunks

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.read_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._timer.cancel()
        if self._complete and self._keep_alive and self._error is None:
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

    async def _wait_head(self) -> None:
        while not self._head:
            if self._error is not None:
                raise self._error
            await self._wait()

    # -- events (the connection's side) --------------------------------------------------------

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _data(self) -> None:
        self._got_bytes = True
        self._last_data = self._loop.time()

    def _head_done(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.status = status
        self.headers = CIMultiDict(headers)
        self._head = True
        self._wake()

    def _body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _end(self, keep_alive: bool) -> None:
        self._complete = True
        self._keep_alive = keep_alive
        self._timer.cancel()
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self._complete or self._error is not None:
            return
        self._error = error
        self._timer.cancel()
        self._wake()

    def _check_silence(self) -> None:
        """The read timeout, one timer per answer: re-armed from the last data instead of being
        cancelled and rescheduled on every chunk; only a waiting reader can time out."""
        if self._complete or self._error is not None:
            return
        now = self._loop.time()
        if self._waiter is None:
            self._timer = self._loop.call_at(now + self._read_s, self._check_silence)
            return
        due = self._last_data + self._read_s
        if now < due:
            self._timer = self._loop.call_at(due, self._check_silence)
            return
        self._fail(TimeoutError(f"the replica sent nothing for {self._read_s:g} s"))
        self._conn.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a replica; its parser's callbacks feed the current answer."""

    def __init__(self, pool: UpstreamClient, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.closed = False
        self._headers: list[tuple[str, str]] = []
        self._paused = False

    def send(self, data: bytes, read_s: float) -> UpstreamResponse:
        assert self.transport is not None
        self.response = UpstreamResponse(self, self.pool.loop, read_s)
        self._headers = []
        self.transport.write(data)
        return self.response

    def idle(self) -> None:
        self.response = None
        self.pool.give_back(self)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes on an idle connection: nothing asked for them
            self.close()
            return
        response._data()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            response._fail(UpstreamError("bad_response", f"malformed HTTP answer: {error}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is None:
            self.pool.forget(self)
        else:
            reason = f": {exc!r}" if exc is not None else ""
            self.response._fail(UpstreamError("disconnected", f"the connection closed mid-answer{reason}"))

    # -- httptools callbacks -------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        assert self.response is not None
        self.response._head_done(self.parser.get_status_code(), self._headers)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._body(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        self.response._end(self.parser.should_keep_alive())


class UpstreamClient:
    """Keep-alive connections per replica origin, reused most-recent first."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._ssl: ssl.SSLContext | None = None
        self._idle: dict[Origin, list[_Connection]] = {}

    async def request(
        self,
        method: str,
        url: str,
        target: str,
        body: bytes,
        headers: dict[str, str],
        *,
        connect_s: float,
        read_s: float,
    ) -> UpstreamResponse:
        """Send a request (`target`: path and query) and wait for the answer's head. A kept-alive
        connection that the replica had closed before reading the request (an idle timeout racing the
        send) is retried once on a new connection: no byte of an answer came back, so nothing was
        done twice. HEAD is not sent: its answer has no body to frame by, and no API route needs it."""
        if method not in SENT_METHODS:
            raise ValueError(f"the upstream client sends {sorted(SENT_METHODS)}, not {method}")
        try:
            origin = origin_of(url)
        except ValueError as error:
            raise UpstreamError("bad_url", str(error)) from None
        length = f"Content-Length: {len(body)}\r\n" if body or method in ("POST", "PUT", "PATCH") else ""
        lines = [f"{method} {origin.base}{target} HTTP/1.1\r\nHost: {origin.authority}\r\n{length}"]
        lines += [f"{name}: {value}\r\n" for name, value in headers.items()]
        lines.append("\r\n")
        # aiohttp hands header values over as UTF-8 with surrogate escapes: this gives back their bytes.
        data = "".join(lines).encode("utf-8", "surrogateescape") + body
        for fresh in (False, True):
            conn, reused = await self._acquire(origin, connect_s, fresh)
            response = conn.send(data, read_s)
            try:
                await response._wait_head()
            except UpstreamError:
                response.release()
                if reused and not response._got_bytes:
                    continue
                raise
            except BaseException:
                response.release()
                raise
            return response
        raise AssertionError("unreachable: the second attempt uses a new connection")

    async def _acquire(self, origin: Origin, connect_s: float, fresh: bool) -> tuple[_Connection, bool]:
        idle = self._idle.get(origin)
        while idle and not fresh:
            conn = idle.pop()
            if not conn.closed:
                return conn, True
        secure = origin.scheme == "https"
        if secure and self._ssl is None:
            self._ssl = ssl.create_default_context()
        context = self._ssl if secure else None
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=context,
                    server_hostname=origin.host if secure else None,
                )
        except TimeoutError:
            raise TimeoutError(f"no connection to {origin.authority} within {connect_s:g} s") from None
        except OSError as error:
            raise UpstreamError("connect_failed", f"cannot connect to {origin.authority}: {error}") from None
        return conn, False

    def give_back(self, conn: _Connection) -> None:
        if conn.closed:
            return
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) < MAX_IDLE_PER_ORIGIN:
            idle.append(conn)
        else:
            conn.close()

    def forget(self, conn: _Connection) -> None:
        """An idle connection the replica closed (its keep-alive timeout)."""
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    def idle_connections(self) -> int:
        return sum(not c.closed for conns in self._idle.values() for c in conns)

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
