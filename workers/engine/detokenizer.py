"""Streaming text for one sequence: deltas that never split a character and never leak a stop string."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(slots=True)
class Detokenizer:
    """Decodes a growing list of output tokens into text deltas.

    The whole output is decoded each time (byte-level BPE merges across token boundaries, so a
    token's text depends on its neighbours); the tail is held back while it may be an incomplete
    UTF-8 character or the start of a stop string, so that what was sent is never taken back.
    """

    stop: tuple[str, ...] = ()
    text: str = ""
    sent: int = 0
    stopped: bool = field(default=False)

    def update(self, decoder: Decoder, output_ids: list[int], final: bool) -> str:
        """The new text to send after the latest token; sets `stopped` when a stop string matched."""
        if self.stopped:
            return ""
        text = decoder.decode(output_ids, skip_special_tokens=True)
        for stop in self.stop:
            at = text.find(stop, max(self.sent - len(stop), 0))
            if at != -1:
                text = text[:at]
                self.stopped = True
        self.text = text
        limit = len(text)
        if not (final or self.stopped):
            if text.endswith("\ufffd"):
                limit -= 1
            limit -= self._stop_prefix_len(text[:limit])
        delta = text[self.sent : max(limit, self.sent)]
        self.sent = max(limit, self.sent)
        return delta

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
