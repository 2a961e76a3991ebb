"""What the gateway reads of the server-sent events it relays, without ever rewriting one.

A relayed stream passes through as the replica sent it. The gateway only looks: for the first event
that carries output (until then a failed replica can still be replaced, since the client has
received nothing worth keeping), for the id a Responses stream announces, for the usage numbers at
the end, and, when it asked for a usage chunk the client did not (to learn what a foreign replica
caches), for that one event, which it leaves out. Events are separated by a blank line; a backend
that frames them otherwise is relayed whole, with nothing left out.
"""

from __future__ import annotations

import re

import orjson

_EVENT_END = b"\n\n"
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
# Responses API events that come before any output.
_PREAMBLE_TYPES = frozenset(
    {"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"}
)
# A chat delta's fields that are output (a role alone, or empty content, is not).
_DELTA_OUTPUT = ("content", "tool_calls", "function_call", "reasoning_content", "reasoning", "refusal")
# A streamed Responses answer names its id in its first event; it is looked for this far at most.
RESPONSE_ID_SCAN = 16 * 1024


def complete_events(data: bytes) -> list[bytes]:
    """The whole events in `data` (each without its blank line), in order."""
    return data.split(_EVENT_END)[:-1]


def _payload(event: bytes) -> object:
    """An event's data as JSON; None for a comment, an empty event or data that is not JSON."""
    lines = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
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
    if payload.get("type") in _PREAMBLE_TYPES:
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


def carries_output(data: bytes) -> bool:
    """Whether the whole events in `data` hold output (a token, a tool call, a finish, an error)."""
    return any(not _is_preamble(_payload(event)) for event in complete_events(data))


def usage_numbers(tail: bytes) -> tuple[int | None, int | None]:
    """(prompt_tokens, cached_tokens) of the last usage object in a response's tail."""
    prompts, cached = _PROMPT_TOKENS.findall(tail), _CACHED_TOKENS.findall(tail)
    return (int(prompts[-1]) if prompts else None), (int(cached[-1]) if cached else None)


class UsageStrip:
    """Leaves out the usage-only event (no choices, a usage object) of a stream whose client did not
    ask for usage; every other byte passes as it came. A partial event at a chunk's end waits for the
    rest of it (a usage event could be split across reads)."""

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._partial + chunk
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._partial = data
            return b""
        whole, self._partial = data[: end + 2], data[end + 2 :]
        if not _USAGE_OBJECT.search(whole):
            return whole
        kept = [e for e in complete_events(whole) if not (_USAGE_OBJECT.search(e) and _NO_CHOICES.search(e))]
        return b"".join(e + _EVENT_END for e in kept)

    def flush(self) -> bytes:
        rest, self._partial = self._partial, b""
        return rest


def response_id_in_events(data: bytes) -> str | None:
    """The response id a Responses stream announces (`response.created`, whose `response` is the
    response object), from the whole events in `data`."""
    for event in complete_events(data):
        payload = _payload(event)
        response = payload.get("response") if isinstance(payload, dict) else None
        found = response.get("id") if isinstance(response, dict) else None
        if isinstance(found, str) and found:
            return found
    return None


class ResponseIdScan:
    """The head of a Responses stream, read until the response's id shows in it (or for
    RESPONSE_ID_SCAN bytes at most)."""

    def __init__(self) -> None:
        self.head = b""
        self.done = False

    def feed(self, data: bytes) -> str | None:
        if self.done:
            return None
        self.head += data
        found = response_id_in_events(self.head)
        self.done = found is not None or len(self.head) > RESPONSE_ID_SCAN
        return found
