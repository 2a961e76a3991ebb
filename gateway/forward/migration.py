"""Continuing a stream whose replica failed once output had reached the client (pure: no I/O).

The client must see one unbroken answer: one id and created time, one role preamble, one
finish_reason, usage counted as if one replica had answered. So while a stream is relayed, a
StreamTap keeps what the client has received (Sent), and the continuation goes to another replica as
the same request with that appended (continuation_body); its events are rewritten as the original
stream's by a StreamTap with a `shift`.

Which backends can continue:
- bundled workers (prefixgate's own) always: they get the prompt's token ids plus the ids already
  streamed, which they name in their stream for the gateway alone (protocol.stream_ids; the gateway
  strips them), with max_tokens less the tokens sent. Greedy decoding goes on exactly where it broke.
- a foreign backend as its model's `foreign_continuation` allows (gateway.gateway_config.ModelEntry):
  "completions" continues completions whose prompt is text, with the prompt plus the text so far (any
  OpenAI server takes that); "vllm" also continues chat, with the messages plus the partial assistant
  message and `continue_final_message: true, add_generation_prompt: false` (vLLM; a server that
  ignored those fields would start a new answer after the partial one, which is why the default is
  "none"). Text re-tokenizes close to, not always exactly as, the tokens sent, and max_tokens less the
  events sent is an estimate (vLLM streams one token an event).

Where no replica can continue a stream (n > 1, echo, a foreign backend's tool calls or reasoning, a
foreign token-id prompt, `foreign_continuation: none`, framing the tap could not read, or every
replica tried failed), the client gets what it got before: an error event, then [DONE]. A stop string
that spans the break is not seen by the continuing replica.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from gateway.forward.internal_fields import DROPPED, PREFIX
from gateway.forward.sse_events import MAX_EVENT_BYTES, EventSplitter
from protocol.openai_api import DEFAULT_COMPLETION_MAX_TOKENS
from protocol.stream_ids import is_ids_comment, parse_ids_comment

Continuation = Literal["bundled", "completions", "vllm"]
_LINES = re.compile(rb"\r\n|\r|\n")
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"')
# A chat delta's fields that text cannot carry on.
_NOT_TEXT = ("tool_calls", "function_call", "reasoning_content", "reasoning", "refusal")


@dataclass(slots=True)
class Sent:
    """What the client has received of one stream (choice 0: streams of several are not continued)."""

    chat: bool
    # From the stream's first event, given to every continuation event.
    id: Any = None
    created: Any = None
    # The token ids streamed (a bundled worker names them) and the text (read from a foreign one's).
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    # Events that carried text.
    outputs: int = 0
    finished: bool = False
    # Something reached the client that a continuation cannot rebuild.
    opaque: bool = False


class StreamTap:
    """Passes a stream's whole events on (a partial one waits for its end), recording them in `sent`
    and leaving out a bundled worker's token-id comments. With `shift` (a continuation), each event is
    rewritten as the original stream's: its id and created, no second role preamble, and usage less the
    `shift` tokens that the continuation's prompt held of the answer."""

    def __init__(self, sent: Sent, *, read_text: bool, shift: int | None = None) -> None:
        self.sent = sent
        self.read_text = read_text
        self.shift = shift
        # Its own bound is the tap's: an event past MAX_EVENT_BYTES goes through unread.
        self._events = EventSplitter(limit=2**62)
        self._raw = False

    def feed(self, chunk: bytes) -> bytes:
        if self._raw:
            return chunk
        out = [self._event(event) for event in self._events.feed(chunk)]
        if self._events.pending > MAX_EVENT_BYTES:
            self.sent.opaque, self._raw = True, True
            out.append(self._events.rest())
        return b"".join(out)

    def flush(self) -> bytes:
        return self._events.rest()

    def _event(self, event: bytes) -> bytes:
        """One whole event, its blank line included, as the client gets it."""
        body = event.rstrip(b"\r\n")
        end = event[len(body) :]
        lines = _LINES.split(body)
        kept = [line for line in lines if not is_ids_comment(line)]
        for line in lines:
            if is_ids_comment(line):
                ids = parse_ids_comment(line)
                if ids is None:
                    self.sent.opaque = True
                else:
                    self.sent.ids += ids
        data = b"\n".join(line[5:].removeprefix(b" ") for line in kept if line.startswith(b"data:"))
        if self.shift is not None:
            return self._rewrite(data)
        self._record(data)
        return event if len(kept) == len(lines) else b"\n".join(kept) + end

    def _record(self, data: bytes) -> None:
        if not data:
            return
        if self.sent.id is not None and not self.read_text:  # a bundled worker's: its ids say enough
            self.sent.finished = self.sent.finished or _FINISHED.search(data) is not None
            return
        payload = _json(data)
        if isinstance(payload, dict):
            self._note(payload)

    def _note(self, payload: dict[str, Any]) -> bool:
        """Record one event's data; whether it carries output (a token, a finish, usage, an error)."""
        sent = self.sent
        if sent.id is None:
            sent.id, sent.created = payload.get("id"), payload.get("created")
        output = payload.get("usage") is not None or "error" in payload
        choices = payload.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                sent.opaque = True
                continue
            if choice.get("finish_reason") is not None:
                sent.finished = output = True
            if choice.get("logprobs"):
                output = True
            delta = choice.get("delta") if sent.chat else None
            if isinstance(delta, dict) and any(delta.get(key) for key in _NOT_TEXT):
                sent.opaque = output = True
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(text, str) and text:
                sent.text.append(text)
                sent.outputs += 1
                output = True
        return output

    def _rewrite(self, data: bytes) -> bytes:
        payload = _json(data) if data else None
        if not isinstance(payload, dict):
            # [DONE] (or text) as it came; a comment or an empty event is left out.
            return b"data: " + data + b"\n\n" if data else b""
        if not self._note(payload):
            return b""  # the continuation's own preamble: the client had the original's
        if "id" in payload and self.sent.id is not None:
            payload["id"] = self.sent.id
        if "created" in payload and self.sent.created is not None:
            payload["created"] = self.sent.created
        for choice in payload.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict):
                delta.pop("role", None)
        usage = payload.get("usage")
        if isinstance(usage, dict):
            _shift_usage(usage, self.shift or 0)
        return b"data: " + orjson.dumps(payload) + b"\n\n"


def _json(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shift_usage(usage: dict[str, Any], shift: int) -> None:
    """A continuation's usage as the original request's: `shift` answer tokens moved from its prompt
    back to its completion (the total stays)."""
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not (_count(prompt) and _count(completion)):
        return
    moved = min(shift, prompt)
    usage["prompt_tokens"], usage["completion_tokens"] = prompt - moved, completion + moved
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and _count(details.get("cached_tokens")):
        details["cached_tokens"] = min(details["cached_tokens"], prompt - moved)


def sent_tokens(sent: Sent, how: Continuation) -> int:
    """The answer tokens the client has: counted by a bundled worker's ids, else one an event."""
    return len(sent.ids) if how == "bundled" else sent.outputs


def continuation_body(
    body: dict[str, Any],
    sent: Sent,
    how: Continuation,
    *,
    prompt_ids: Sequence[int] | None,
    ask_usage: bool,
) -> dict[str, Any] | None:
    """The request that carries `sent` on (see the module's docstring), or None where none can."""
    if sent.opaque or sent.finished or body.get("echo") or body.get("n") not in (None, 1):
        return None
    names = ("max_completion_tokens", "max_tokens") if sent.chat else ("max_tokens",)
    limit_name = next((name for name in names if _count(body.get(name))), names[-1])
    limit = body.get(limit_name)
    if limit is None and not sent.chat:
        limit = DEFAULT_COMPLETION_MAX_TOKENS
    # The gateway's own fields (gateway.forward.internal_fields) are set here or not at all.
    given = {
        k: v for k, v in body.items() if k not in names and k not in DROPPED and not k.startswith(PREFIX)
    }
    if limit is not None:
        left = limit - sent_tokens(sent, how)
        if left < 1:
            return None
        given[limit_name] = left
    text = "".join(sent.text)
    if how == "bundled":
        if prompt_ids is None:
            return None
        given["prefixgate_token_ids"] = [*prompt_ids, *sent.ids]
    elif sent.chat:
        messages = body.get("messages")
        if how != "vllm" or not isinstance(messages, list) or not text:
            return None
        given["messages"] = [*messages, {"role": "assistant", "content": text}]
        given["continue_final_message"], given["add_generation_prompt"] = True, False
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        given["prompt"] = prompt + text
    if ask_usage:
        options = body.get("stream_options")
        given["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return given
