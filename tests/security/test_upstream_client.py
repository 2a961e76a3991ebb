"""A replica cannot poison the gateway's upstream client or its reading of server-sent events (issue
20, item 7). Each test puts a replica that misbehaves on purpose, written on raw sockets
(tests/support/raw_replicas.py), behind a real gateway: the client gets the replica's answer or a clean
error, and the next client on the same pooled connection gets its own answer."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from gateway.forward.sse_events import MAX_EVENT_BYTES, EventSplitter, OutputWatch, UsageStrip
from gateway.forward.upstream import UpstreamError
from gateway.forward.upstream_client import MAX_HEAD_BYTES, MAX_INFORMATIONAL, UpstreamClient
from tests.support.gateways import RunningGateway
from tests.support.raw_replicas import (
    MODEL,
    OK_JSON,
    OK_SSE,
    REQUEST_TIMEOUT_S,
    Answer,
    Posted,
    RawReplica,
    completion,
    events,
    framed,
    gateway_for,
    reply,
    said,
)


def chunked(head: bytes, pieces: list[bytes]) -> bytes:
    """A head and a body in chunked transfer coding, one chunk per piece."""
    chunks = b"".join(b"%x\r\n" % len(p) + p + b"\r\n" for p in pieces if p)
    return head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"


def answer_of(posted: Posted, text: str, line_end: bytes = b"\n") -> bytes:
    """The whole answer saying `text`, a stream or not as the request asked."""
    if posted.stream:
        return chunked(OK_SSE, events(posted, text, line_end))
    return framed(OK_JSON, completion(text))


@pytest.fixture
def raw_replica() -> Iterator[Callable[[Answer], tuple[RawReplica, str]]]:
    started: list[RawReplica] = []

    def start(answer: Answer) -> tuple[RawReplica, str]:
        replica = RawReplica(answer)
        started.append(replica)
        return replica, replica.start()

    yield start
    for replica in started:
        replica.stop()


def ask(gateway: RunningGateway, marker: str, stream: bool = False) -> tuple[int, str, bytes]:
    """One chat request carrying `marker`: (status, the text the client read, the raw body)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": marker}], "stream": stream}
    with httpx.stream(
        "POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S * 3
    ) as r:
        raw = r.read()
    return r.status_code, said(raw, stream) if r.status_code == 200 else "", raw


def assert_clean_error(status: int, raw: bytes, expected: int = 502) -> None:
    assert status == expected, raw[:300]
    error = json.loads(raw)["error"]
    assert error["message"] and error["type"], error


# -- bytes past the end of an answer ------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(
    "trailing", ["whole answer, same write", "partial head, same write", "later, while idle"]
)
def test_bytes_past_the_end_of_an_answer_never_reach_the_next_client(
    raw_replica: Callable[[Answer], tuple[RawReplica, str]],
    start_gateway: Callable[..., RunningGateway],
    stream: bool,
    trailing: str,
) -> None:
    injected = threading.Event()

    async def answer(posted: Posted) -> None:
        own = answer_of(posted, reply(posted.marker))
        if len(replica.posts) > 1:
            posted.send(own)
            return
        extra = answer_of(posted, "INJECTED")
        if trailing == "whole answer, same write":
            posted.send(own + extra)
        elif trailing == "partial head, same write":
            posted.send(own + extra[:40])
        else:
            posted.send(own)
            await posted.writer.drain()
            await asyncio.sleep(0.2)  # the gateway has read the answer and pooled the connection
            posted.send(extra)
        injected.set()

    replica, url = raw_replica(answer)
    gateway = gateway_for(start_gateway, [url])
    status, text, raw = ask(gateway, "first", stream)
    assert (status, text) == (200, reply("first")), raw
    assert b"INJECTED" not in raw
    assert injected.wait(5)
    time.sleep(0.2)
    start = time.monotonic()
    status, text, raw = ask(gateway, "second", stream)
    assert (status, text) == (200, reply("second")), raw
    assert time.monotonic() - start < REQUEST_TIMEOUT_S / 2  # answered, not left hanging
    # The connection that carried bytes past its answer was closed, not pooled: the next request
    # went on a new one, and reached the replica once.
    assert replica.posts[1].conn != replica.posts[0].conn
    assert replica.received("second") == 1


def test_an_answer_to_no_request_closes_the_idle_connection(
    raw_replica: Callable[[Answer], tuple[RawReplica, str]], start_gateway: Callable[..., RunningGateway]
) -> None:
    closed = threading.Event()

    async def answer(posted: Posted) -> None:
        posted.send(answer_of(posted, reply(posted.marker)))
        if len(replica.posts) == 1:
            await posted.writer.drain()
            await asyncio.sleep(0.2)
            posted.send(framed(OK_JSON, completion("UNASKED")))  # on an idle connection
            if await asyncio.wait_for(posted.reader.read(1), 5) == b"":
                closed.set()

    replica, url = raw_replica(answer)
    gateway = gateway_for(start_gateway, [url])
    assert ask(gateway, "first")[:2] == (200, reply("first"))
    assert closed.wait(5), "the gateway kept a connection that sent an answer to no request"
    status, text, raw = ask(gateway, "second")
    assert (status, text) == (200, reply("second")) and b"UNASKED" not in raw
    assert replica.posts[1].conn != replica.posts[0].conn


# -- informational answers -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("split", [False, True], ids=["one write", "hints first"])
def test_informational_answers_are_skipped_for_the_final_one(
    raw_replica: Callable[[Answer], tuple[RawReplica, str]],
    start_gateway: Callable[..., RunningGateway],
    stream: bool,
    split: bool,
) -> None:
    hints = (
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n"
    )

    async def answer(posted: Posted) -> None:
        final = answer_of(posted, reply(posted.marker))
        if split:
            posted.send(hints)
            await posted.writer.drain()
            await asyncio.sleep(0.1)
            posted.send(final)
        else:
            posted.send(hints + final)

    replica, url = raw_replica(answer)
    gateway = gateway_for(start_gateway, [url])
    for marker in ("first", "second"):
        status, text, raw = ask(gateway, marker, stream)
        assert (status, text) == (200, reply(marker)), raw
        assert b"preload" not in raw
    assert len(replica.posts) == 2
    assert replica.posts[1].conn == replica.posts[0].conn  # the final answer's connection, reused


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\n\r\n" * (MAX_INFORMATIONAL + 1),
        OK_JSON + b"X-Pad: " + b"a" * MAX_HEAD_BYTES + b"\r\n",
    ],
    ids=["101", "endless 103", "oversize head"],
)
def test_a_switch_endless_hints_or_an_oversize_head_is_a_clean_502(
    raw_replica: Callable[[Answer], tuple[RawReplica, str]],
    start_gateway: Callable[..., RunningGateway],
    head: bytes,
) -> None:
    async def answer(posted: Posted) -> None:
        if posted.marker == "bad":
            posted.send(head)
        else:
            posted.send(answer_of(posted, reply(posted.marker)))

    _, url = raw_replica(answer)
    gateway = gateway_for(start_gateway, [url])
    start = time.monotonic()
    status, _, raw = ask(gateway, "bad")
    assert_clean_error(status, raw)
    assert time.monotonic() - start < REQUEST_TIMEOUT_S / 2
    assert ask(gateway, "next")[:2] == (200, reply("next"))


# -- a request sent once ---------------------------------------------------------------------------


def test_a_post_the_replica_read_and_dropped_is_not_sent_again(
    raw_replica: Callable[[Answer], tuple[RawReplica, str]], start_gateway: Callable[..., RunningGateway]
) -> None:
    async def answer(posted: Posted) -> None:
        if posted.marker == "dropped":
            posted.writer.close()  # read it (a generation may have started), then gone without a word
        else:
            posted.send(answer_of(posted, reply(posted.marker)))

    replica, url = raw_replica(answer)
    gateway = gateway_for(start_gateway, [url])
    assert ask(gateway, "warm")[:2] == (200, reply("warm"))  # leaves a pooled connection
    status, _, raw = ask(gateway, "dropped")
    assert_clean_error(status, raw)
    assert replica.received("dropped") == 1
    assert replica.posts[1].conn == replica.posts[0].conn  # it went on the reused connection
    assert ask(gateway, "after")[:2] == (200, reply("after"))


def test_a_dropped_post_goes_to_the_next_replica_once_each(
    raw_replica: Callable[[Answer], tuple[RawReplica, str]], start_gateway: Callable[..., RunningGateway]
) -> None:
    async def drops(posted: Posted) -> None:
        if posted.marker.startswith("dropped"):
            posted.writer.close()
        else:
            posted.send(answer_of(posted, reply(posted.marker)))

    async def answers(posted: Posted) -> None:
        posted.send(answer_of(posted, reply(posted.marker)))

    dropper, first = raw_replica(drops)
    good, second = raw_replica(answers)
    gateway = gateway_for(start_gateway, [first, second])
    for n in range(6):
        ask(gateway, f"warm {n}")
    for n in range(6):
        marker = f"dropped {n}"
        assert ask(gateway, marker)[:2] == (200, reply(marker))
        assert dropper.received(marker) <= 1 and good.received(marker) == 1


def test_an_idle_connection_the_replica_closed_unseen_is_not_written_to() -> None:
    """The replica's close (its keep-alive timeout) has reached the gateway's socket, but not yet its
    event loop: the request goes on a new connection, once."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    close_first = threading.Event()
    first_closed = threading.Event()
    received: list[bytes] = []

    def serve() -> None:
        for n in range(2):
            conn, _ = listener.accept()
            with conn:
                data = b""
                while not data.endswith(b'"}'):
                    data += conn.recv(65536)
                received.append(data)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                if n == 0:
                    close_first.wait(5)
            if n == 0:
                first_closed.set()

    server = threading.Thread(target=serve, daemon=True)
    server.start()

    async def main() -> None:
        client = UpstreamClient()
        url = f"http://127.0.0.1:{port}"
        try:
            for n in range(2):
                response = await client.request(
                    "POST", url, "/v1/completions", b'{"n": "%d"}' % n, {}, connect_s=2, read_s=2
                )
                assert await response.read() == b"ok"
                response.release()
                if n == 0:
                    close_first.set()
                    assert first_closed.wait(5)  # blocking: the loop has not seen the close
                    time.sleep(0.05)
        finally:
            client.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        listener.close()
    assert len(received) == 2 and received[1].endswith(b'{"n": "1"}')


def test_an_idempotent_request_is_resent_once_and_a_post_never() -> None:
    """A replica that reads the request on a kept-alive connection and closes: a GET (nothing done
    twice) is resent on a new connection, a POST is not."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                seen.append(head.split(b" ", 2)[1])
                if len(seen) in (2, 5):
                    break  # read, then gone without an answer
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = UpstreamClient()
        try:
            for path in ("/a", "/get-twice"):
                response = await client.request("GET", url, path, b"", {}, connect_s=2, read_s=2)
                assert await response.read() == b"ok"
                response.release()
            response = await client.request("POST", url, "/warm", b"{}", {}, connect_s=2, read_s=2)
            assert await response.read() == b"ok"
            response.release()
            with pytest.raises(UpstreamError):
                await client.request("POST", url, "/post-once", b"{}", {}, connect_s=2, read_s=2)
        finally:
            client.close()
            server.close()

    asyncio.run(asyncio.wait_for(main(), 20))
    assert seen == [b"/a", b"/get-twice", b"/get-twice", b"/warm", b"/post-once"]


# -- bodies framed by the close --------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_body_framed_by_the_close_is_the_whole_answer(
    raw_replica: Callable[[Answer], tuple[RawReplica, str]],
    start_gateway: Callable[..., RunningGateway],
    stream: bool,
) -> None:
    async def answer(posted: Posted) -> None:
        text = reply(posted.marker)
        if posted.stream:
            posted.send(OK_SSE + b"\r\n")
            for event in events(posted, text):
                posted.send(event)
                await posted.writer.drain()
        else:
            posted.send(OK_JSON + b"\r\n" + completion(text))
        posted.writer.close()

    replica, url = raw_replica(answer)
    gateway = gateway_for(start_gateway, [url])
    for marker in ("first", "second"):
        status, text, raw = ask(gateway, marker, stream)
        assert (status, text) == (200, reply(marker)), raw
    assert replica.posts[1].conn != replica.posts[0].conn


# -- server-sent events ------------------------------------------------------------------------------


@pytest.mark.parametrize("line_end", [b"\r\n", b"\r", b"\n"], ids=["CRLF", "CR", "LF"])
def test_a_stream_framed_with_any_line_ending_is_relayed_as_it_comes(
    raw_replica: Callable[[Answer], tuple[RawReplica, str]],
    start_gateway: Callable[..., RunningGateway],
    line_end: bytes,
) -> None:
    """Its first output reaches the client while the replica holds back the rest, and the usage event
    the gateway asked for (the client did not) is left out."""
    first_seen = threading.Event()
    held: list[bool] = []
    asked_usage: list[bool] = []

    async def answer(posted: Posted) -> None:
        options = posted.body.get("stream_options")
        asked_usage.append(isinstance(options, dict) and options.get("include_usage") is True)
        role, first, *rest = events(posted, reply(posted.marker), line_end)
        posted.send(OK_SSE + b"Transfer-Encoding: chunked\r\n\r\n")
        for piece in (role, first[:7], first[7:]):  # the first output split mid-line
            posted.send(b"%x\r\n%s\r\n" % (len(piece), piece))
            await posted.writer.drain()
        held.append(not await asyncio.to_thread(first_seen.wait, REQUEST_TIMEOUT_S / 2))
        posted.send(b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in rest) + b"0\r\n\r\n")

    _, url = raw_replica(answer)
    gateway = gateway_for(start_gateway, [url])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "m"}], "stream": True}
    data = b""
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        for piece in r.iter_raw():
            data += piece
            if b'"content": "answe"' in data:  # the first delta of the answer
                first_seen.set()
    assert held == [False], "the stream was held back until its end"
    assert said(data, True) == reply("m")
    assert asked_usage == [True]
    assert b'"usage"' not in data  # the usage event the client did not ask for was left out
    assert data.endswith(b"data: [DONE]" + line_end * 2)


def test_an_event_that_never_ends_before_any_output_is_a_clean_502(
    raw_replica: Callable[[Answer], tuple[RawReplica, str]], start_gateway: Callable[..., RunningGateway]
) -> None:
    async def answer(posted: Posted) -> None:
        if posted.marker != "endless":
            posted.send(answer_of(posted, reply(posted.marker)))
            return
        posted.send(OK_SSE + b"\r\n" + events(posted, "")[0] + b'data: {"choices": "')
        filler = b"x" * 65536
        try:
            for _ in range(MAX_EVENT_BYTES // len(filler) + 32):
                posted.send(filler)
                await posted.writer.drain()
        except ConnectionError:
            pass
        posted.writer.close()

    _, url = raw_replica(answer)
    gateway = gateway_for(start_gateway, [url])
    status, _, raw = ask(gateway, "endless", stream=True)
    assert_clean_error(status, raw)
    assert b"event over" in raw
    assert ask(gateway, "next", stream=True)[:2] == (200, reply("next"))


def test_an_event_that_never_ends_mid_stream_ends_the_stream_with_an_error(
    raw_replica: Callable[[Answer], tuple[RawReplica, str]], start_gateway: Callable[..., RunningGateway]
) -> None:
    """After output, with the usage event to leave out (so events are held whole): the stream ends
    with an error event and [DONE]."""

    async def answer(posted: Posted) -> None:
        role, first, *_ = events(posted, "tokens")
        posted.send(OK_SSE + b"\r\n" + role + first + b'data: {"choices": "')
        filler = b"y" * 65536
        try:
            for _ in range(MAX_EVENT_BYTES // len(filler) + 32):
                posted.send(filler)
                await posted.writer.drain()
        except ConnectionError:
            pass
        posted.writer.close()

    replica, url = raw_replica(answer)
    gateway = gateway_for(start_gateway, [url])
    status, _, raw = ask(gateway, "m", stream=True)
    assert status == 200
    assert b'"content": "tok' in raw and b"upstream_failed" in raw
    assert raw.endswith(b"data: [DONE]\n\n")
    assert replica.posts[0].body["stream_options"] == {"include_usage": True}


def test_events_are_cut_alike_at_every_split_and_in_linear_time() -> None:
    stream = (
        b"data: a\r\n\r\n: comment\rdata: b\r\rdata: c\n\ndata: d\r\n\r\n"
        b"event: x\r\ndata: e\n\r\ndata: f\r\r\n"
    )
    whole = EventSplitter().feed(stream)
    assert len(whole) == 6 and b"".join(whole) == stream
    for cut in range(len(stream) + 1):
        for second in range(cut, len(stream) + 1):
            splitter = EventSplitter()
            pieces = [stream[:cut], stream[cut:second], stream[second:]]
            cut_up = [e for p in pieces for e in splitter.feed(p)]
            assert b"".join(cut_up) + splitter.rest() == stream  # every byte, as it came
            # The same events, but for an empty one where a CRLF was split after its CR.
            events = [e.strip(b"\r\n") for e in cut_up]
            assert [e for e in events if e] == [e.strip(b"\r\n") for e in whole], (cut, second)
    # One event just under the bound, arriving 1 KiB at a time, is cut in one pass over it, not one per
    # piece (which would scan about 6 GiB).
    piece = b"z" * 1024
    watch = OutputWatch()
    start = time.monotonic()
    assert not watch.feed(b"data: ")
    for _ in range(MAX_EVENT_BYTES // len(piece) - 1):
        watch.feed(piece)
    assert watch.feed(b"\r\n\r\n")  # text that is not JSON: output
    assert time.monotonic() - start < 2.0
    strip = UsageStrip()
    with pytest.raises(UpstreamError) as too_large:
        for _ in range(MAX_EVENT_BYTES // len(piece) + 1):
            strip.feed(piece)
    assert too_large.value.kind == "event_too_large"
