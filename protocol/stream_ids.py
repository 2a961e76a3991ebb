"""The token ids of a bundled worker's stream, told to the gateway alone.

A gateway that loses a worker mid-stream continues the answer on another one from the prompt's ids
plus the ids already streamed (gateway.forward.migration). Text cannot give those ids back exactly (the same
text tokenizes more than one way), so a worker asked with STREAM_IDS_HEADER puts the ids of each
event's tokens in the event itself, as an SSE comment line before its data: clients ignore comments,
and the gateway strips them before its client sees the event.
"""

from __future__ import annotations

from collections.abc import Sequence

# Request header (any value) asking a bundled worker for its tokens' ids in its stream.
STREAM_IDS_HEADER = "x-prefixgate-stream-token-ids"
_PREFIX = b":prefixgate-token-ids "


def ids_comment(ids: Sequence[int]) -> bytes:
    """The comment line naming `ids`, to go before an event's data (nothing for no ids)."""
    return _PREFIX + ",".join(map(str, ids)).encode() + b"\n" if ids else b""


def is_ids_comment(line: bytes) -> bool:
    return line.startswith(_PREFIX)


def parse_ids_comment(line: bytes) -> list[int] | None:
    """The ids of a comment line made by ids_comment; None when it is not one or is garbled."""
    if not line.startswith(_PREFIX):
        return None
    try:
        return [int(part) for part in line[len(_PREFIX) :].split(b",")]
    except ValueError:
        return None
