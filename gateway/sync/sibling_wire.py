"""The frames the processes of `serve --workers N` exchange through their parent (gateway.sync.siblings
says what they carry; gateway.process_group relays them): a HEADER (the one process a frame is for,
or EVERYONE; the payload's length), then the payload, a msgpack list of messages. Apart from the
messages' meaning, so that the parent, which relays but never reads them, imports nothing else."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence
from typing import Any

import msgspec

HEADER = struct.Struct(">iI")
EVERYONE = -1
# A frame larger than this is a broken relay, not a message.
MAX_FRAME_BYTES = 64 << 20
# Past this many bytes unsent to the relay, messages are dropped (and counted) rather than queued.
SEND_BUFFER_BYTES = 16 << 20

_encode = msgspec.msgpack.Encoder().encode
decode_messages = msgspec.msgpack.Decoder(list[list[Any]]).decode


def frame(messages: Sequence[tuple[Any, ...] | list[Any]], to: int = EVERYONE) -> bytes:
    payload = _encode(messages)
    return HEADER.pack(to, len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(to, payload); IncompleteReadError at the end of the stream."""
    to, length = HEADER.unpack(await reader.readexactly(HEADER.size))
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"a sibling frame of {length} bytes")
    return to, await reader.readexactly(length)
