"""vLLM's KV-event wire format (docs/design.md §4): what vLLM and SGLang publish over ZMQ, and what the
bundled worker publishes too (workers/zmq_publisher.py) so that one consumer serves every fleet.

Read in vLLM's `vllm/distributed/kv_events.py` (commit b4e69e0a, about v0.9.0, and commit 0181ea31,
a recent main), `examples/online_serving/kv_events_subscriber.py` (0ef0f426), the publisher tests in
`tests/distributed/` (05d3142f, 029329a8), vLLM PR #42892 (events from arrays to maps) with a capture
from a vLLM 0.26.0 server (volcano-sh/kthena#1535), and SGLang's
`python/sglang/srt/disaggregation/kv_events.py` (006d053f); written here from that reading.

Payload: one msgpack-encoded batch per message, positional (msgspec `array_like=True`):
`[ts, [event, ...], data_parallel_rank]`, the rank omitted when unset (vLLM up to v0.9.0 and SGLang
have no rank). The copy at commit 0181ea31 declares the batch without `array_like`, which would make
it a map `{"ts": ..., "events": [...], "data_parallel_rank": ...}`: decoding accepts that too. Events
are msgspec structs with `tag=True`: the tag is the class name, and the fields keep this declaration
order in every version, each version only appending fields:

- before vLLM PR #42892 (vLLM up to about v0.2x, SGLang before its #37482) events are `array_like`
  too, the tag first: `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window]`, `["BlockRemoved", block_hashes, medium, group_idx]`,
  `["AllBlocksCleared"]`, trailing fields with their default (None) omitted (`omit_defaults`); the
  oldest producers stop after `lora_id` (BlockStored) or `block_hashes` (BlockRemoved);
- since then events are maps keyed by field name, the tag under `"type"`:
  `{"type": "BlockStored", "block_hashes": [...], ...}`; `lora_id`, `medium` and `lora_name` are
  always present (they have no default), the rest only when set.

Decoding accepts both layouts; encoding writes the current one (a positional batch of tagged maps).
Block hashes are unsigned 64-bit integers, or bytes where vLLM runs with
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`; they are opaque here (the gateway re-hashes the tokens).
`token_ids` holds the tokens of every block of the event, `block_size` of them per hash.

Frames (ZMQ PUB, one message per batch): `[topic, seq, payload]`, seq an unsigned 64-bit big-endian
integer counting from 0 in each publisher process (vLLM's default topic is empty). Replay (ZMQ
ROUTER): a client sends `[b"", start]` (what a REQ socket sends for the single frame `start`, 8 bytes
big-endian) and receives, for every buffered batch with seq >= start, `[b"", seq, payload]` (newer
vLLM puts the topic before seq), then the end marker `[b"", seq -1 as 8 signed big-endian bytes,
b""]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

BlockHash = int | bytes
# Token ids are packed as uint32 for hashing (docs/design.md §3): anything else is refused when decoded.
TokenId = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
MEDIUM_GPU = "GPU"
SEQ_BYTES = 8
# The replay answer that ends a replay: seq -1, empty payload.
REPLAY_END = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
# The largest payload read: one engine step's events, prompts of a million tokens included, take a few
# MB; a consumer bounds its sockets' messages by this too (ZMQ_MAXMSGSIZE).
MAX_PAYLOAD_BYTES = 32 * 2**20


class MalformedEvents(ValueError):
    """A frame or payload that is not vLLM's KV-event format; the message says what is wrong."""


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """A KV event: tagged with its class name, encoded as a map (see the module docstring)."""


class BlockStored(KVCacheEvent):
    """Full blocks newly cached, in prefix order; the parent is the backend's hash of the block
    before the first one (None: the first block of a prompt)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[TokenId]
    block_size: Annotated[int, msgspec.Meta(ge=0)]
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # Per block: what else its hash covers (multimodal inputs, LoRA, cache salt); None when nothing.
    extra_keys: list[Any] | None = None
    # The KV cache group (hybrid models keep one per attention kind) and that group's kind.
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks evicted: one copy each (a backend may cache a hash more than once)."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The cache was flushed: nothing is cached any more."""


Event = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)
}


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: the events of one engine step, stamped with the publisher's clock."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _RawMapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_ARRAY_BATCH = msgspec.msgpack.Decoder(_RawBatch)
_MAP_BATCH = msgspec.msgpack.Decoder(_RawMapBatch)
_MAP_EVENT = msgspec.msgpack.Decoder(Event)
_ANY = msgspec.msgpack.Decoder()


def _is_array(first_byte: int) -> bool:
    """msgpack's fixarray, array 16 and array 32 markers."""
    return 0x90 <= first_byte <= 0x9F or first_byte in (0xDC, 0xDD)


def _positional(values: Any) -> Event:
    """An event in the positional layout: the tag, then the fields in declaration order. Fields a
    shorter array lacks were added by later versions and read as None; trailing ones beyond those
    known here are ignored, as msgspec ignores them."""
    if not isinstance(values, list) or not values or not isinstance(values[0], str):
        raise MalformedEvents(f"an event array must start with its tag, got {values!r:.80}")
    cls = EVENT_TYPES.get(values[0])
    if cls is None:
        raise MalformedEvents(f"unknown KV event type {values[0]!r}")
    names = cls.__struct_fields__
    fields = dict.fromkeys(names) | dict(zip(names, values[1:], strict=False))
    return msgspec.convert(fields, cls)


def _event(raw: msgspec.Raw) -> Event:
    data = memoryview(raw)
    if data and _is_array(data[0]):
        return _positional(_ANY.decode(raw))
    return _MAP_EVENT.decode(raw)


def decode_batch(payload: bytes, max_bytes: int = MAX_PAYLOAD_BYTES) -> KVEventBatch:
    """A batch in any layout of the module docstring; MalformedEvents when it is none of them, or is
    larger than `max_bytes`."""
    if not payload:
        raise MalformedEvents("empty KV event payload")
    if len(payload) > max_bytes:
        raise MalformedEvents(f"a KV event payload of {len(payload)} bytes, over the {max_bytes} allowed")
    try:
        raw = _ARRAY_BATCH.decode(payload) if _is_array(payload[0]) else _MAP_BATCH.decode(payload)
        return KVEventBatch(raw.ts, [_event(e) for e in raw.events], raw.data_parallel_rank)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise MalformedEvents(f"not a KV event batch: {error}") from None
    except RecursionError:  # msgspec's answer to nesting deeper than it decodes
        raise MalformedEvents("not a KV event batch: nested too deep") from None


def encode_batch(batch: KVEventBatch) -> bytes:
    """The batch as vLLM encodes it since PR #42892: a positional batch of tagged maps."""
    return _ENCODER.encode(batch)


# -- frames -----------------------------------------------------------------------------------------


def check_endpoint(address: str, *, bind: bool = False) -> str:
    """A ZMQ address as given: `tcp://HOST:PORT` or `ipc://PATH`. Only a socket that binds may name
    every interface (`tcp://*:5557`); one that connects needs a host. ValueError says what is wrong."""
    if address.startswith("ipc://"):
        if address == "ipc://":
            raise ValueError("names no path")
        return address
    if not address.startswith("tcp://"):
        raise ValueError("must start with tcp:// or ipc://")
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("names no port in 1..65535")
    if not host or (host in ("*", "[::]") and not bind):
        raise ValueError("names no host to connect to")
    return address


def default_replay_endpoint(endpoint: str) -> str | None:
    """The replay socket next to a PUB endpoint: the same host, port + 1, as vLLM's examples and
    docs pair them (5557 and 5558); None for an ipc:// endpoint, which has no port to count from."""
    base, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit() or int(port) >= 65535:
        return None
    return f"{base}:{int(port) + 1}"


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise MalformedEvents(f"a sequence number is {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def pub_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The PUB message of one batch."""
    return [topic, encode_seq(seq), payload]


def read_pub_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """(topic, seq, payload) of a PUB message."""
    if len(frames) != 3:
        raise MalformedEvents(f"a KV event message has 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = frames
    return topic, decode_seq(seq), payload


def replay_request(start: int) -> list[bytes]:
    """What a DEALER sends to ask for the batches from `start` on (a REQ socket adds the b"" itself)."""
    return [b"", encode_seq(start)]


def read_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int]:
    """(client identity, start) of a request as a ROUTER receives it."""
    if len(frames) != 3 or frames[1] != b"":
        raise MalformedEvents(f"a replay request is [identity, b'', start], got {len(frames)} frames")
    return frames[0], decode_seq(frames[2])


def replay_answer(client: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One replayed batch as a ROUTER sends it to `client`."""
    return [client, b"", encode_seq(seq), payload]


def replay_end(client: bytes) -> list[bytes]:
    return [client, b"", REPLAY_END, b""]


def read_replay_answer(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of a replayed batch as a DEALER receives it, or None for the end marker.
    The frames after the empty delimiter are [seq, payload], or [topic, seq, payload]."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise MalformedEvents(f"a replay answer is [b'', (topic,) seq, payload], got {len(frames)} frames")
    seq, payload = frames[-2], frames[-1]
    if not payload:
        return None
    return decode_seq(seq), payload
