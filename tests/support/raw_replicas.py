"""A replica that misbehaves on purpose, written on raw sockets, behind a real gateway: the replica,
the bytes it answers with, a gateway in front of it, and what a client read from an answer."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tests.support.gateways import RunningGateway

MODEL = "foreign-m"
# The gateway's limit on a replica's silence: a client that waits this long was left hanging.
REQUEST_TIMEOUT_S = 4.0
OK_JSON = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
OK_SSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"


@dataclass
class Posted:
    """One POST as the replica read it, with the connection it came on (numbered from 1)."""

    conn: int
    body: dict[str, Any]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    @property
    def marker(self) -> str:
        return str(self.body["messages"][-1]["content"])

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    def send(self, data: bytes) -> None:
        self.writer.write(data)


Answer = Callable[[Posted], Awaitable[None]]


class RawReplica:
    """A foreign OpenAI-compatible replica on raw asyncio sockets, in a thread of its own: discovery
    (/health, /v1/models) is answered as a server would, each POST by `answer`, which writes whatever
    bytes a test wants (and may close the connection). Every POST is recorded."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.posts: list[Posted] = []
        self.connections = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="raw-replica", daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> str:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self.loop
        )
        self._server = started.result(10)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def received(self, marker: str) -> int:
        """How many times a POST carrying `marker` reached this replica."""
        return sum(p.marker == marker for p in self.posts)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = self.connections
        try:
            while not writer.is_closing():
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, target, _ = head[0].split(" ", 2)
                fields = dict(line.split(":", 1) for line in head[1:] if ":" in line)
                length = next((int(v) for k, v in fields.items() if k.lower() == "content-length"), 0)
                body = await reader.readexactly(length)
                if method == "GET":
                    writer.write(_discovery(target))
                else:
                    posted = Posted(conn, json.loads(body), reader, writer)
                    self.posts.append(posted)
                    await self.answer(posted)
                if not writer.is_closing():
                    await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()


def _discovery(target: str) -> bytes:
    if target == "/health":
        return b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    if target == "/v1/models":
        return framed(
            OK_JSON, json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
        )
    return framed(
        b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n", b'{"error": "no such route"}'
    )


def framed(head: bytes, body: bytes) -> bytes:
    """A head (status line and headers, without the blank line) and a body, framed by its length."""
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def completion(text: str) -> bytes:
    """A chat completion that says `text`."""
    message = {"role": "assistant", "content": text}
    return json.dumps(
        {
            "id": "chatcmpl-raw",
            "object": "chat.completion",
            "created": 1,
            "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
    ).encode()


def chunk_event(
    delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any
) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {
        "id": "chatcmpl-raw",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": choices,
        **extra,
    }


def events(posted: Posted, text: str, line_end: bytes = b"\n") -> list[bytes]:
    """A chat stream that says `text` in two deltas, each event one piece, its lines ended by
    `line_end`, with a usage event when the request asked for one."""
    half = len(text) // 2
    payloads: list[Any] = [
        chunk_event({"role": "assistant", "content": ""}),
        chunk_event({"content": text[:half]}),
        chunk_event({"content": text[half:]}),
        chunk_event({}, "stop"),
    ]
    options = posted.body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        usage = {
            "prompt_tokens": 32,
            "completion_tokens": 2,
            "total_tokens": 34,
            "prompt_tokens_details": {"cached_tokens": 16},
        }
        payloads.append(chunk_event(None, usage=usage))
    lines = [b"data: " + json.dumps(p).encode() for p in payloads] + [b"data: [DONE]"]
    return [line + line_end + line_end for line in lines]


def reply(marker: str) -> str:
    return f"answer to {marker}"


def gateway_for(
    start_gateway: Callable[..., RunningGateway], urls: list[str], **limits: Any
) -> RunningGateway:
    """A gateway in front of foreign replicas, whose failed forwards never take a replica out of
    rotation (each test reads the next client's answer from the same replica)."""
    return start_gateway(
        urls,
        models={MODEL: {"tokenizer": "default"}},
        limits={"request_timeout_s": REQUEST_TIMEOUT_S, "connect_timeout_s": 2.0, **limits},
        health={"interval_s": 0.2, "failures": 10_000},
    )


def said(raw: bytes, stream: bool) -> str:
    """The assistant's text in an answer (a stream's deltas joined), as a client reads it."""
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"]
    text = []
    for line in raw.decode().splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            payload = json.loads(line[5:])
            for choice in payload.get("choices", []):
                text.append(choice["delta"].get("content") or "")
    return "".join(text)
