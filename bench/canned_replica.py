"""`python -m bench.canned_replica --port N --model M`: an OpenAI-compatible replica that costs next to
nothing, for measuring what a router costs: every generation request gets the same one-token answer
at once, its body never parsed.

On llhttp (httptools) and uvloop where installed, with keep-alive, so that one process answers tens
of thousands of requests a second: against it, the requests/s through a router are the router's (and
the load generator's), not a replica's. It answers GET /health, GET /v1/models (the one model),
POST /v1/chat/completions and /v1/completions (a chat or text completion, streamed as SSE when the
body asks for `"stream": true`), and 404 to anything else.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import httptools

from protocol.serving import new_event_loop


def _response(status: str, content_type: bytes, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n".encode()
    return head + b"Content-Type: " + content_type + b"\r\n\r\n" + body


def _answers(model: str) -> dict[tuple[bytes, bytes, bool], bytes]:
    """(method, path, streamed) -> the whole response."""
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    chat = {
        "id": "chatcmpl-canned",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}
        ],
        "usage": usage,
    }
    text = {
        "id": "cmpl-canned",
        "object": "text_completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
        "usage": usage,
    }
    chat_chunk = {
        **chat,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": "ok"}}],
    }
    text_chunk = {**text, "choices": [{"index": 0, "text": "ok"}]}
    as_json, sse = b"application/json", b"text/event-stream"

    def events(chunk: dict) -> bytes:
        return f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()

    models = {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "canned"}]}
    return {
        (b"GET", b"/health", False): _response("200 OK", as_json, b"{}"),
        (b"GET", b"/v1/models", False): _response("200 OK", as_json, json.dumps(models).encode()),
        (b"POST", b"/v1/chat/completions", False): _response("200 OK", as_json, json.dumps(chat).encode()),
        (b"POST", b"/v1/chat/completions", True): _response("200 OK", sse, events(chat_chunk)),
        (b"POST", b"/v1/completions", False): _response("200 OK", as_json, json.dumps(text).encode()),
        (b"POST", b"/v1/completions", True): _response("200 OK", sse, events(text_chunk)),
    }


NOT_FOUND = _response("404 Not Found", b"application/json", b'{"error": {"message": "not found"}}')


class _Connection(asyncio.Protocol):
    def __init__(self, answers: dict[tuple[bytes, bytes, bool], bytes]) -> None:
        self.answers = answers
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        # One token of the JSON looked for in the bytes, not parsed: this replica must cost nothing.
        streamed = b'"stream":true' in b"".join(self.body).replace(b" ", b"")
        self.transport.write(self.answers.get((method, path, streamed), NOT_FOUND))
        self.url, self.body = b"", []
        if not self.parser.should_keep_alive():
            self.transport.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.canned_replica", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="canned")
    args = parser.parse_args(argv)
    answers = _answers(args.model)
    loop = new_event_loop()
    server = loop.run_until_complete(loop.create_server(lambda: _Connection(answers), "127.0.0.1", args.port))
    try:
        loop.run_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        loop.close()


if __name__ == "__main__":
    main()
