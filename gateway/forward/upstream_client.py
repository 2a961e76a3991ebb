"""The gateway's HTTP/1.1 client for the forward path (docs/design.md §2 step 6).

Every routed request crosses it twice (request out, answer back), so it does only what a reverse
proxy needs: keep-alive connections per replica, the request head and body in one write, the answer
parsed by llhttp (httptools) and handed on as the bytes arrive. aiohttp's ClientSession, which the
gateway keeps for health checks, KV sync and load polls, spent about as much CPU per request as the
rest of the request path together (URL objects, cookie and tracing hooks, a StreamReader and a timer
per response).

Timeouts: `connect_s` to open a connection; `read_s` for the replica's silence (gateway.forward.upstream,
where the answer is read).

A replica is not trusted to frame its answers well. A connection is pooled only when exactly one answer
came back on it: a byte past the end of the answer, or one while no request is outstanding, closes it,
so that nothing a replica sends can complete the next client's answer. Informational answers (`103
Early Hints`) are skipped, a `101` is a failure, and a head, a skipped answer count and a read body
have bounds. A body framed by the connection's end (neither a length nor chunked) ends at a clean close.
"""

from __future__ import annotations

import asyncio
import select
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

import httptools

from gateway.forward.upstream import UpstreamError, UpstreamResponse

SENT_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
# Methods whose repetition has the effect of one request (RFC 9110 §9.2.2): the only ones resent after
# a connection failed once the request was written.
IDEMPOTENT_METHODS = frozenset({"GET", "PUT", "DELETE"})
# An answer's head (its status line and headers, any informational answers' before it) past this size
# is no answer: llhttp sets no bound of its own.
MAX_HEAD_BYTES = 64 * 1024
# Informational answers skipped before the final one, at most.
MAX_INFORMATIONAL = 16
# Idle connections kept per replica: a burst's extra connections are closed once it has passed.
MAX_IDLE_PER_ORIGIN = 128


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


def _framed(headers: list[tuple[str, str]]) -> bool:
    """Whether an answer's head says where its body ends (a length, or chunked as the last coding);
    without either, the connection's close ends it (RFC 9112 §6.3)."""
    for name, value in headers:
        lowered = name.lower()
        if lowered == "content-length" or (
            lowered == "transfer-encoding" and value.rsplit(",", 1)[-1].strip().lower() == "chunked"
        ):
            return True
    return False


class _Stop(Exception):
    """Raised from a parser callback to stop parsing: the reason is the connection's `_problem`."""


class Connection(asyncio.Protocol):
    """One keep-alive connection to a replica; its parser's callbacks feed the current answer."""

    def __init__(self, pool: UpstreamClient, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.closed = False
        # Whether the gateway closed it (a connection the replica closed may have ended a body).
        self._closing = False
        self._headers: list[tuple[str, str]] = []
        self._head_bytes = 0
        self._informational = 0
        # Parsing an informational answer, which is skipped.
        self._interim = False
        # The final answer's body ends where the connection does (no length, not chunked).
        self._until_eof = False
        # Why parsing stopped: a failure, or None for bytes past the answer's end.
        self._problem: UpstreamError | None = None
        self._paused = False

    def send(self, data: bytes, read_s: float) -> tuple[UpstreamResponse, bool]:
        """The request written: its answer to come, and whether the write reached the socket (a write
        that fails at once, the replica's end having been reset, sent nothing)."""
        assert self.transport is not None
        self.response = UpstreamResponse(self, self.pool.loop, read_s)
        self._head_bytes = self._informational = 0
        self._interim = self._until_eof = False
        self._problem = None
        self.transport.write(data)
        return self.response, not self.transport.is_closing()

    def usable(self) -> bool:
        """Whether an idle connection can carry a request. The replica's close (its keep-alive timeout),
        or bytes it sent unasked, wait in the socket until the event loop's next turn: a zero-timeout
        poll sees them before a request is written to a connection that is already gone."""
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            return False
        sock = transport.get_extra_info("socket")
        if sock is None:
            return True
        poll = select.poll()
        poll.register(sock.fileno(), select.POLLIN | select.POLLPRI)
        return not poll.poll(0)

    def idle(self) -> None:
        self.response = None
        self.pool.give_back(self)

    def close(self) -> None:
        self.closed = self._closing = True
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
        if response is None or response.complete:
            # Bytes nothing asked for: on an idle connection, or past the end of the answer.
            if response is not None:
                response.on_overrun()
            self.close()
            return
        response.on_bytes()
        if not response.head_read:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as error:
            if self._problem is not None:
                response.fail(self._problem)
            elif not response.complete:
                response.fail(UpstreamError("bad_response", f"malformed HTTP answer: {error}"))
            else:
                response.on_overrun()
            self.close()
            return
        if not response.head_read and self._head_bytes > MAX_HEAD_BYTES:
            # httptools holds a header until it ends: what it holds is bounded here, a read past the bound.
            response.fail(UpstreamError("bad_response", f"the answer's head is over {MAX_HEAD_BYTES} bytes"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is None:
            self.pool.forget(self)
        elif exc is None and not self._closing and self._until_eof and response.head_read:
            response.on_end(False)  # the replica's close is the end of a body framed by it
        else:
            reason = f": {exc!r}" if exc is not None else ""
            response.fail(UpstreamError("disconnected", f"the connection closed mid-answer{reason}"))

    # -- httptools callbacks -------------------------------------------------------------------

    def _stop(self, problem: UpstreamError | None) -> None:
        self._problem = problem
        raise _Stop

    def on_message_begin(self) -> None:
        assert self.response is not None
        if self.response.complete:
            self._stop(None)
        self._headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        assert self.response is not None
        status = self.parser.get_status_code()
        if status == 101:
            self._stop(UpstreamError("bad_response", "the replica switched protocols (101)"))
        if 100 <= status < 200:
            # An informational answer (103 Early Hints, 100 Continue): not the answer, which follows.
            self._informational += 1
            if self._informational > MAX_INFORMATIONAL:
                self._stop(UpstreamError("bad_response", f"over {MAX_INFORMATIONAL} informational answers"))
            self._interim = True
            return
        self._until_eof = not _framed(self._headers)
        self.response.on_head(status, self._headers)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response.on_body(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        if self._interim:
            self._interim = False
            return
        self.response.on_end(self.parser.should_keep_alive())


class UpstreamClient:
    """Keep-alive connections per replica origin, reused most-recent first."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._ssl: ssl.SSLContext | None = None
        self._idle: dict[Origin, list[Connection]] = {}

    async def request(
        self,
        method: str,
        url: str,
        target: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        connect_s: float,
        read_s: float,
        leaving: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """Send a request (`target`: path and query) and wait for the answer's head. HEAD is not sent:
        its answer has no body to frame by, and no API route needs it. `leaving` is called once, before
        this first waits: right after the request is written to a pooled connection, else before a new
        one is opened; what it does is done before any other task runs, off the request's way out.

        A request is resent (once, on a new connection) only when the replica cannot have acted on it
        twice. An idle connection the replica has closed is seen before the write (`usable`) and not
        used. One that fails after the request was written, with no byte of an answer back, is resent
        only for an idempotent method, or when the write itself failed: a replica may read a request
        and then close without answering (a crash mid-request), and a POST — a generation, a file
        upload — resent then would be done twice. A failed POST fails this attempt instead, which the
        proxy treats as any replica's failure before output (gateway.forward.proxy)."""
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
            conn = None if fresh else self._pooled(origin)
            reused = conn is not None
            if conn is None:
                if leaving is not None:
                    leaving()
                    leaving = None
                conn = await self._connect(origin, connect_s)
            response, written = conn.send(data, read_s)
            if leaving is not None:
                leaving()
                leaving = None
            try:
                await response.wait_head()
            except UpstreamError:
                response.release()
                unanswered = reused and not response.got_bytes
                if unanswered and (not written or method in IDEMPOTENT_METHODS):
                    continue
                raise
            except BaseException:
                response.release()
                raise
            return response
        raise AssertionError("unreachable: the second attempt uses a new connection")

    def _pooled(self, origin: Origin) -> Connection | None:
        """An idle connection to `origin` that the replica has not closed, if any."""
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn
            conn.close()
        return None

    async def _connect(self, origin: Origin, connect_s: float) -> Connection:
        secure = origin.scheme == "https"
        if secure and self._ssl is None:
            self._ssl = ssl.create_default_context()
        context = self._ssl if secure else None
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await self.loop.create_connection(
                    lambda: Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=context,
                    server_hostname=origin.host if secure else None,
                )
        except TimeoutError:
            raise TimeoutError(f"no connection to {origin.authority} within {connect_s:g} s") from None
        except OSError as error:
            raise UpstreamError("connect_failed", f"cannot connect to {origin.authority}: {error}") from None
        return conn

    def give_back(self, conn: Connection) -> None:
        if conn.closed:
            return
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) < MAX_IDLE_PER_ORIGIN:
            idle.append(conn)
        else:
            conn.close()

    def forget(self, conn: Connection) -> None:
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
