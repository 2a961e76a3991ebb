"""What the bundled workers send their followers (docs/design.md §4): event batches in a Redis stream
entry or a /kv/events reply, and /kv/snapshot. Decoded and bounded before anything is applied (hashes
unsigned 64-bit integers, lists and sequence numbers bounded), so a bad reply costs a rejection, never a
half-applied index.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

import msgspec

from protocol.kv_events import EventBatch, KVEvent

# What one batch, stream entry or snapshot may hold: far above a real worker's, low enough to bound
# what a bad one costs.
MAX_EVENT_HASHES = 1 << 20
MAX_BATCH_EVENTS = 1 << 16
MAX_POLL_BATCHES = 1 << 16
MAX_SNAPSHOT_HASHES = 1 << 26
MAX_SEQ = 2**63 - 1
MAX_INCARNATION_CHARS = 256

HASH_MAX = 2**64 - 1
# Unsigned 64-bit: msgspec bounds ints to int64 only, so the upper bound is checked_hashes'.
BlockHash = Annotated[int, msgspec.Meta(ge=0)]
Hashes = Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_EVENT_HASHES)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]
Incarnation = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_INCARNATION_CHARS)]

# What a bad entry raises: msgspec's errors are ValueErrors, as int()'s are.
MALFORMED = (ValueError, TypeError, KeyError)


def checked_hashes(hashes: list[int], parent: int | None = None) -> None:
    """ValueError unless every hash (and the parent) fits in 64 bits (docs/design.md §3); the lower bound is
    the decoder's."""
    if (hashes and max(hashes) > HASH_MAX) or (parent is not None and parent > HASH_MAX):
        raise ValueError("a block hash is not an unsigned 64-bit integer")


class _Stored(msgspec.Struct, tag_field="type", tag="stored"):
    hashes: Hashes = []
    parent: BlockHash | None = None

    def __post_init__(self) -> None:
        checked_hashes(self.hashes, self.parent)


class _Removed(msgspec.Struct, tag_field="type", tag="removed"):
    hashes: Hashes = []

    def __post_init__(self) -> None:
        checked_hashes(self.hashes)


class _Cleared(msgspec.Struct, tag_field="type", tag="cleared"):
    pass


_Events = Annotated[list[_Stored | _Removed | _Cleared], msgspec.Meta(max_length=MAX_BATCH_EVENTS)]


class _Batch(msgspec.Struct):
    incarnation: Incarnation
    seq: Annotated[int, msgspec.Meta(ge=1, le=MAX_SEQ)]
    events: _Events


class _Poll(msgspec.Struct):
    """A /kv/events reply."""

    seq: Seq
    batches: Annotated[list[_Batch], msgspec.Meta(max_length=MAX_POLL_BATCHES)]


class Snapshot(msgspec.Struct):
    """A worker's /kv/snapshot: every hash it caches, consistent with batch `seq` of `incarnation`."""

    incarnation: Incarnation
    seq: Seq
    hashes: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_SNAPSHOT_HASHES)]

    def __post_init__(self) -> None:
        checked_hashes(self.hashes)


_EVENTS = msgspec.json.Decoder(_Events)
_POLL = msgspec.json.Decoder(_Poll)
_SNAPSHOT = msgspec.json.Decoder(Snapshot)


def _event(event: _Stored | _Removed | _Cleared) -> KVEvent:
    if isinstance(event, _Stored):
        return KVEvent("stored", tuple(event.hashes), event.parent)
    if isinstance(event, _Removed):
        return KVEvent("removed", tuple(event.hashes))
    return KVEvent("cleared")


def _event_batch(incarnation: str, seq: int, events: list[_Stored | _Removed | _Cleared]) -> EventBatch:
    return EventBatch(incarnation, seq, tuple(_event(e) for e in events))


def decode_snapshot(body: bytes) -> Snapshot:
    """msgspec.DecodeError unless `body` is a valid /kv/snapshot."""
    return _SNAPSHOT.decode(body)


def decode_poll(body: bytes) -> tuple[int, list[EventBatch]]:
    """A /kv/events reply: the worker's newest seq and the batches it sent, in order; msgspec.DecodeError
    unless it is a valid one."""
    reply = _POLL.decode(body)
    return reply.seq, [_event_batch(b.incarnation, b.seq, b.events) for b in reply.batches]


def parse_entry(fields: Mapping[str, str]) -> EventBatch:
    """A KV stream entry's batch; one of MALFORMED when it is not a valid one."""
    incarnation, seq = fields["incarnation"], int(fields["seq"])
    if not 0 < seq <= MAX_SEQ:
        raise ValueError(f"seq {seq} is out of range")
    if not 0 < len(incarnation) <= MAX_INCARNATION_CHARS:
        raise ValueError(f"an incarnation of {len(incarnation)} characters")
    return _event_batch(incarnation, seq, _EVENTS.decode(fields["events"]))
