"""What the gateway reads of the server-sent events it relays, without ever rewriting one.

A relayed stream passes through as the replica sent it. The gateway only looks: for the first event
that carries output (until then a failed replica can still be replaced, since the client has
received nothing worth keeping), for the id a Responses stream announces, for the usage numbers at
the end, and, when it asked for a usage chunk the client did not (to learn what a foreign replica
caches), for that one event, which it leaves out.

Events are cut as the SSE spec frames them: a line ends with CRLF, LF or CR, and a blank line ends an
event. The cut is incremental (what was searched is not searched again: linear in the stream), and what
is held of a stream has a bound: an incomplete event past MAX_EVENT_BYTES is the replica's failure
(EventTooLarge), and a stream whose first MAX_EVENT_BYTES carry no output is relayed as it is.
"""

from __future__ import annotations

import re

import orjson

from gateway.forward.upstream import UpstreamError

# A line ending. A CR that ends what has arrived counts at once, as a browser's parser counts it (a
# stream may pause there); an LF that comes next, the rest of a CRLF, then starts the next event.
_LINE_END = rb"(?:\r\n|\r(?!\n)|\n)"
_EVENT_END = re.compile(_LINE_END * 2)
# The longest event end (CRLF CRLF) less one byte: how far back a new search starts.
_END_OVERLAP = 3
_LINES = re.compile(rb"\r\n|\r|\n")
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_USAGE_KEY = re.compile(rb'"usage"\s*:\s*\{')
# Responses API events that come before any output.
_PREAMBLE_TYPES = frozenset(
    {"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"}
)
# A chat delta's fields that are output (a role alone, or empty content, is not).
_DELTA_OUTPUT = ("content", "tool_calls", "function_call", "reasoning_content", "reasoning", "refusal")
# A streamed Responses answer names its id in its first event; it is looked for this far at most.
RESPONSE_ID_SCAN = 16 * 1024
# One event held whole, at most (a Responses `response.completed` carries the whole answer), and the
# most of a stream held back before its first output.
MAX_EVENT_BYTES = 4 * 1024 * 1024


class EventTooLarge(UpstreamError):
    """A replica's event that does not end within MAX_EVENT_BYTES: a failed answer, not a memory leak."""

    def __init__(self, limit: int) -> None:
        super().__init__("event_too_large", f"the replica sent an event over {limit} bytes")


class EventSplitter:
    """Cuts a stream into whole events as its bytes arrive."""

    def __init__(self, limit: int = MAX_EVENT_BYTES) -> None:
        self._partial = bytearray()
        # How much of `_partial` was searched for an event end without finding one.
        self._searched = 0
        self._limit = limit

    def feed(self, data: bytes) -> list[bytes]:
        """The events `data` completes, each with the blank line that ends it (their bytes, joined,
        are what was fed before the incomplete rest). Raises EventTooLarge past the bound."""
        partial = self._partial
        partial += data
        start = max(self._searched - _END_OVERLAP, 0)
        if start and partial[start - 1 : start + 1] == b"\r\n":
            start -= 1  # never search from inside a CRLF, whose LF would pass for a line of its own
        events = []
        cut = 0
        for end in _EVENT_END.finditer(partial, start):
            events.append(bytes(partial[cut : end.end()]))
            cut = end.end()
        if cut:
            del partial[:cut]
        self._searched = len(partial)
        if len(partial) > self._limit:
            raise EventTooLarge(self._limit)
        return events

    @property
    def pending(self) -> int:
        """Bytes held of an event not yet ended."""
        return len(self._partial)

    def rest(self) -> bytes:
        """What came after the last whole event (at the stream's end: an event it did not finish)."""
        rest = bytes(self._partial)
        self._partial.clear()
        self._searched = 0
        return rest


def complete_events(data: bytes) -> list[bytes]:
    """The whole events in `data` (each with its blank line), in order."""
    return EventSplitter(len(data)).feed(data)


def _payload(event: bytes) -> object:
    """An event's data as JSON; None for a comment, an empty event or data that is not JSON."""
    lines = [line[5:] for line in _LINES.split(event) if line.startswith(b"data:")]
    if not lines:
        return None
    try:
        return orjson.loads(b"\n".join(lines))
    except orjson.JSONDecodeError:
        return b"".join(lines).strip()  # [DONE], or text: not nothing


def _is_preamble(payload: object) -> bool:
    """An event that says a stream started and nothing more: a chat choice's role, an empty delta, a
    Responses lifecycle event. Anything else, an error included, is output."""
    if payload is None:
        return True
    if not isinstance(payload, dict):
        return False
    kind = payload.get("type")
    if isinstance(kind, str) and kind in _PREAMBLE_TYPES:
        return True
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or payload.get("usage"):
        return False
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("finish_reason") is not None or choice.get("text"):
            return False
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(delta.get(key) for key in _DELTA_OUTPUT):
            return False
        if delta is None and "text" not in choice:
            return False
    return True


def _output(event: bytes) -> bool:
    return not _is_preamble(_payload(event))


def carries_output(data: bytes) -> bool:
    """Whether the whole events in `data` hold output (a token, a tool call, a finish, an error)."""
    return any(_output(event) for event in complete_events(data))


class OutputWatch:
    """Reads a stream's head, chunk by chunk, for its first event that carries output."""

    def __init__(self) -> None:
        self._events = EventSplitter()
        self._held = 0

    def feed(self, data: bytes) -> bool:
        """Whether what was fed may go to the client: it holds output, or is more than MAX_EVENT_BYTES
        (held no longer). Raises EventTooLarge for an event that does not end within the bound."""
        self._held += len(data)
        return any(_output(event) for event in self._events.feed(data)) or self._held > MAX_EVENT_BYTES


def usage_numbers(tail: bytes) -> tuple[int | None, int | None]:
    """(prompt_tokens, cached_tokens) of the last usage object in a response's tail: read from its
    `"usage"` key on (the whole tail where the key was cut off), so that one object's count never
    pairs with another's."""
    keys = list(_USAGE_KEY.finditer(tail))
    last = tail[keys[-1].start() :] if keys else tail
    prompts, cached = _PROMPT_TOKENS.findall(last), _CACHED_TOKENS.findall(last)
    return (int(prompts[-1]) if prompts else None), (int(cached[-1]) if cached else None)


class UsageStrip:
    """Leaves out the usage-only event (no choices, a usage object) of a stream whose client did not
    ask for usage; every other byte passes as it came. A partial event at a chunk's end waits for the
    rest of it (a usage event could be split across reads), up to MAX_EVENT_BYTES (EventTooLarge)."""

    def __init__(self) -> None:
        self._events = EventSplitter()

    def feed(self, chunk: bytes) -> bytes:
        return b"".join(event for event in self._events.feed(chunk) if not _usage_only(event))

    def flush(self) -> bytes:
        return self._events.rest()


def _usage_only(event: bytes) -> bool:
    return bool(_USAGE_OBJECT.search(event) and _NO_CHOICES.search(event))


def response_id_in(event: bytes) -> str | None:
    """The response id a Responses stream's event announces (`response.created`, whose `response` is
    the response object)."""
    payload = _payload(event)
    response = payload.get("response") if isinstance(payload, dict) else None
    found = response.get("id") if isinstance(response, dict) else None
    return found if isinstance(found, str) and found else None


def response_body_id(body: bytes) -> str | None:
    """The `id` of a Responses API answer that is not streamed."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    found = parsed.get("id") if isinstance(parsed, dict) else None
    return found if isinstance(found, str) and found else None


class ResponseIdScan:
    """The head of a Responses stream, read until the response's id shows in it (or for
    RESPONSE_ID_SCAN bytes at most)."""

    def __init__(self) -> None:
        self._events = EventSplitter(limit=2**62)  # bounded by the scan's own length
        self._seen = 0
        self.done = False

    def feed(self, data: bytes) -> str | None:
        if self.done:
            return None
        self._seen += len(data)
        for event in self._events.feed(data):
            found = response_id_in(event)
            if found is not None:
                self.done = True
                return found
        self.done = self._seen > RESPONSE_ID_SCAN
        return None
