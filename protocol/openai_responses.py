"""The OpenAI response bodies and SSE chunks a bundled worker sends (docs/design.md §4).

Pure: the engine's deltas in, JSON out. The gateway relays these bytes unparsed; it reads only the
cached-token count (CACHED_TOKENS_HEADER, or the usage object).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

# Response header with the prompt tokens served from the prefix cache, known at the first token: the
# gateway reads it instead of parsing the stream for the usage chunk.
CACHED_TOKENS_HEADER = "x-prefixgate-cached-tokens"
# One generated token's (id, logprob, top alternatives as (id, logprob)).
TokenLogprob = tuple[int, float | None, list[tuple[int, float]] | None]


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; for n > 1 choices the prompt counts once and completion_tokens is the
    sum over the choices."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def new_response_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class Choice:
    """One finished choice of a non-streaming response."""

    text: str
    finish_reason: str | None
    # None: the request did not ask for logprobs.
    logprobs: Sequence[TokenLogprob] | None = None


@dataclass(slots=True)
class ResponseShaper:
    """Builds one request's response body or its stream of chunks, in the endpoint's flavour.

    `decode_token` turns one token id into its text for logprobs; the completion flavour's
    `text_offset` runs across chunks, separately for each choice, so one shaper serves exactly one
    request.
    """

    chat: bool
    model: str
    created: int
    decode_token: Callable[[int], str]
    include_usage: bool = False
    id: str = ""
    # Choice index -> characters of text before its next token, for `text_offset`.
    _text_offsets: dict[int, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.id = self.id or new_response_id(self.chat)

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def response(self, choices: Sequence[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        """The whole non-streaming body; `choices` in index order."""
        shaped = []
        for index, choice in enumerate(choices):
            entry: dict[str, Any] = {"index": index}
            if self.chat:
                entry["message"] = {"role": "assistant", "content": choice.text}
            else:
                entry["text"] = choice.text
            entry["logprobs"] = self._logprobs(choice.logprobs, index)
            entry["finish_reason"] = choice.finish_reason
            shaped.append(entry)
        body = self._envelope("chat.completion" if self.chat else "text_completion", shaped)
        body["usage"] = usage
        return body

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        logprobs: Sequence[TokenLogprob] | None = None,
        role: bool = False,
        index: int = 0,
    ) -> dict[str, Any]:
        """One streamed delta of choice `index`; `role` marks chat's opening chunk of a choice, which
        announces the assistant."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = (
                {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            )
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(logprobs, index)
        choice["finish_reason"] = finish_reason
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk when the client asked for usage: no choices, only the totals."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage
        return body

    def _logprobs(self, entries: Sequence[TokenLogprob] | None, index: int) -> dict[str, Any] | None:
        if entries is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(token_id, lp, top) for token_id, lp, top in entries]}
        tokens = [self.decode_token(token_id) for token_id, _, _ in entries]
        offsets = []
        offset = self._text_offsets.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [
                None if top is None else {self.decode_token(i): v for i, v in top} for _, _, top in entries
            ],
            "text_offset": offsets,
        }

    def _chat_entry(
        self, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None
    ) -> dict[str, Any]:
        entry = self._token_entry(token_id, logprob)
        entry["top_logprobs"] = [self._token_entry(i, v) for i, v in top or []]
        return entry

    def _token_entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        token = self.decode_token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
