"""The KV-event wire format (docs/design.md §4): what a worker's log publishes and a gateway's index replays.

A batch (JSON): `{"incarnation": str, "seq": int, "events": [event, ...]}`, where an event is
`{"type": "stored", "hashes": [h, ...], "parent": h | null}` (hashes in prefix order; a null parent
means the first block sits on the model's root hash), `{"type": "removed", "hashes": [...]}` or
`{"type": "cleared"}`. Hashes are unsigned 64-bit integers (radix.hashing). Sequence numbers start
at 1 in every incarnation, and batch 1 is always a lone `cleared`, so a reader that sees a new
incarnation starts from an empty set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

EventType = Literal["stored", "removed", "cleared"]
EVENT_TYPES: tuple[EventType, ...] = ("stored", "removed", "cleared")


@dataclass(frozen=True, slots=True)
class KVEvent:
    type: EventType
    hashes: tuple[int, ...] = ()
    parent: int | None = None

    def to_json(self) -> dict[str, Any]:
        if self.type == "stored":
            return {"type": "stored", "hashes": list(self.hashes), "parent": self.parent}
        if self.type == "removed":
            return {"type": "removed", "hashes": list(self.hashes)}
        return {"type": "cleared"}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> KVEvent:
        kind = obj["type"]
        if kind not in EVENT_TYPES:
            raise ValueError(f"unknown KV event type {kind!r}")
        return cls(kind, tuple(obj.get("hashes", ())), obj.get("parent"))


@dataclass(frozen=True, slots=True)
class EventBatch:
    incarnation: str
    seq: int
    events: tuple[KVEvent, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "incarnation": self.incarnation,
            "seq": self.seq,
            "events": [e.to_json() for e in self.events],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> EventBatch:
        return cls(obj["incarnation"], obj["seq"], tuple(KVEvent.from_json(e) for e in obj["events"]))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The cached hashes after applying every batch up to and including `seq`."""

    incarnation: str
    seq: int
    hashes: frozenset[int]


def apply_event(cached: set[int], event: KVEvent) -> None:
    """What every consumer does with one event; the log's own mirror uses it too."""
    if event.type == "stored":
        cached.update(event.hashes)
    elif event.type == "removed":
        cached.difference_update(event.hashes)
    else:
        cached.clear()


def apply_batches(cached: set[int], batches: Iterable[EventBatch]) -> None:
    for batch in batches:
        for event in batch.events:
            apply_event(cached, event)
