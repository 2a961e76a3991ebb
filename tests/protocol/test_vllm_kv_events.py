"""vLLM's KV-event wire format: bytes built the way vLLM and SGLang build them — by hand, or as plain
msgpack arrays and maps, never through this module's structs — decode to the events they carry; what
this module encodes is vLLM's current layout; anything else is refused with a message."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from protocol.vllm_kv_events import (
    REPLAY_END,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    MalformedEvents,
    check_endpoint,
    decode_batch,
    default_replay_endpoint,
    encode_batch,
    pub_frames,
    read_pub_frames,
    read_replay_answer,
    read_replay_request,
    replay_answer,
    replay_end,
    replay_request,
)

U64_MAX = 2**64 - 1


def stored(**fields: Any) -> BlockStored:
    defaults: dict[str, Any] = {"parent_block_hash": None, "lora_id": None, "medium": None, "lora_name": None}
    return BlockStored(**(defaults | fields))


def packed(obj: Any) -> bytes:
    """Plain msgpack of lists, dicts and scalars: how vLLM's msgspec structs come out on the wire."""
    return msgspec.msgpack.encode(obj)


def test_a_positional_batch_written_byte_by_byte() -> None:
    # [1.5, [["AllBlocksCleared"], ["BlockStored", [2**64-1], nil, [1, 2], 2, nil], ["BlockRemoved", [7]]]]
    # as vLLM 0.9 and SGLang write it (array_like=True, tag=True, the oldest field set).
    payload = bytes.fromhex(
        "92"  # the batch: [ts, events]
        "cb3ff8000000000000"  # ts, float64 1.5
        "93"  # three events
        "91b0"
        + b"AllBlocksCleared".hex()
        + "96ab"
        + b"BlockStored".hex()
        + "91cfffffffffffffffff"  # [2**64-1]
        "c0"  # parent: nil
        "920102"  # token ids [1, 2]
        "02"  # block size
        "c0"  # lora id: nil
        "92ac" + b"BlockRemoved".hex() + "9107"
    )
    assert decode_batch(payload) == KVEventBatch(
        1.5,
        [
            AllBlocksCleared(),
            stored(block_hashes=[U64_MAX], token_ids=[1, 2], block_size=2),
            BlockRemoved([7]),
        ],
    )


@pytest.mark.parametrize(
    ("wire", "event"),
    [
        pytest.param(
            ["BlockStored", [11, 12], 10, [1, 2, 3, 4], 2, None],
            stored(block_hashes=[11, 12], parent_block_hash=10, token_ids=[1, 2, 3, 4], block_size=2),
            id="stored-v0.9",
        ),
        pytest.param(
            ["BlockStored", [11], None, [1, 2], 2, 3, "GPU"],
            stored(block_hashes=[11], token_ids=[1, 2], block_size=2, lora_id=3, medium="GPU"),
            id="stored-with-medium",
        ),
        pytest.param(
            [
                "BlockStored",
                [11],
                None,
                [1, 2],
                2,
                None,
                "GPU",
                "ad",
                [None],
                0,
                "full_attention",
                7,
                "future",
            ],
            stored(
                block_hashes=[11],
                token_ids=[1, 2],
                block_size=2,
                medium="GPU",
                lora_name="ad",
                extra_keys=[None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
                kv_cache_spec_sliding_window=7,
            ),
            id="stored-every-field-and-one-unknown",
        ),
        pytest.param(["BlockRemoved", [5, 6]], BlockRemoved([5, 6]), id="removed-v0.9"),
        pytest.param(["BlockRemoved", [5], "CPU", 1], BlockRemoved([5], "CPU", 1), id="removed-with-group"),
        pytest.param(["AllBlocksCleared"], AllBlocksCleared(), id="cleared"),
    ],
)
def test_every_positional_version_decodes(wire: list[Any], event: Any) -> None:
    assert decode_batch(packed([2.0, [wire], 1])) == KVEventBatch(2.0, [event], 1)


def test_events_as_maps_decode_as_vllm_026_sends_them() -> None:
    """The shape a vLLM 0.26 server was seen to send: an array batch of tagged maps, absent
    defaults omitted, and a key this module does not know."""
    wire = {
        "type": "BlockStored",
        "block_hashes": [15760518052499183552],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "cache_salt": "ignored",
    }
    removed = {"type": "BlockRemoved", "block_hashes": [15760518052499183552], "medium": "GPU"}
    batch = decode_batch(packed([1789095808.8, [wire, removed, {"type": "AllBlocksCleared"}], 0]))
    assert batch.events == [
        stored(
            block_hashes=[15760518052499183552],
            token_ids=list(range(16)),
            block_size=16,
            medium="GPU",
            extra_keys=[None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockRemoved([15760518052499183552], "GPU"),
        AllBlocksCleared(),
    ]
    assert batch.data_parallel_rank == 0


def test_a_batch_encoded_as_a_map_and_bytes_hashes_decode() -> None:
    wire = ["BlockStored", [b"\x01" * 32], b"\x00" * 32, [5, 6], 2, None, "GPU"]
    batch = decode_batch(packed({"ts": 3.0, "events": [wire]}))
    assert batch == KVEventBatch(
        3.0,
        [
            stored(
                block_hashes=[b"\x01" * 32],
                parent_block_hash=b"\x00" * 32,
                token_ids=[5, 6],
                block_size=2,
                medium="GPU",
            )
        ],
    )


def test_encoding_is_vllms_current_layout_and_round_trips() -> None:
    batch = KVEventBatch(
        4.25,
        [
            stored(
                block_hashes=[1, 2], parent_block_hash=9, token_ids=[3, 4, 5, 6], block_size=2, medium="GPU"
            ),
            BlockRemoved([1], "GPU"),
            AllBlocksCleared(),
        ],
        0,
    )
    payload = encode_batch(batch)
    assert msgspec.msgpack.decode(payload) == [
        4.25,
        [
            {
                "type": "BlockStored",
                "block_hashes": [1, 2],
                "parent_block_hash": 9,
                "token_ids": [3, 4, 5, 6],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
    assert decode_batch(payload) == batch


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"", "empty"),
        (b"\xc1", "not a KV event batch"),  # a byte msgpack never uses
        (packed(7), "not a KV event batch"),
        (packed([1.0]), "not a KV event batch"),
        (packed([1.0, [["BlockStored", [1]]]]), "not a KV event batch"),  # no token ids
        (packed([1.0, [["Nonsense", 1]]]), "unknown KV event type 'Nonsense'"),
        (packed([1.0, [[1, 2]]]), "must start with its tag"),
        (packed([1.0, [{"type": "Nonsense"}]]), "not a KV event batch"),
        (packed([1.0, [["BlockStored", [1], None, [-1], 1, None]]]), "not a KV event batch"),
        (packed([1.0, [["BlockStored", [1], None, [2**32], 1, None]]]), "not a KV event batch"),
        (packed([1.0, [["BlockStored", ["h"], None, [1], 1, None]]]), "not a KV event batch"),
        (packed([1.0, [["AllBlocksCleared"]]])[:-3], "not a KV event batch"),  # truncated
    ],
)
def test_malformed_payloads_are_refused_with_a_message(payload: bytes, why: str) -> None:
    with pytest.raises(MalformedEvents, match=why):
        decode_batch(payload)


def test_frames_and_the_replay_protocol() -> None:
    assert pub_frames(b"kv-events", 258, b"p") == [b"kv-events", b"\x00" * 6 + b"\x01\x02", b"p"]
    assert read_pub_frames([b"", (5).to_bytes(8, "big"), b"p"]) == (b"", 5, b"p")
    with pytest.raises(MalformedEvents, match="3 frames"):
        read_pub_frames([b"", b"p"])
    with pytest.raises(MalformedEvents, match="8 bytes"):
        read_pub_frames([b"", b"\x05", b"p"])
    # A DEALER sends the delimiter itself; the ROUTER sees the client's identity before it.
    assert replay_request(3) == [b"", (3).to_bytes(8, "big")]
    assert read_replay_request([b"id", *replay_request(3)]) == (b"id", 3)
    with pytest.raises(MalformedEvents, match="replay request"):
        read_replay_request([b"id", (3).to_bytes(8, "big")])
    # What the DEALER receives once the ROUTER strips the identity; newer vLLM adds the topic.
    assert read_replay_answer(replay_answer(b"id", 4, b"p")[1:]) == (4, b"p")
    assert read_replay_answer([b"", b"topic", (4).to_bytes(8, "big"), b"p"]) == (4, b"p")
    assert replay_end(b"id") == [b"id", b"", b"\xff" * 8, b""] and REPLAY_END == b"\xff" * 8
    assert read_replay_answer(replay_end(b"id")[1:]) is None
    with pytest.raises(MalformedEvents, match="replay answer"):
        read_replay_answer([(4).to_bytes(8, "big"), b"p"])


def test_endpoints() -> None:
    assert check_endpoint("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"
    assert check_endpoint("tcp://[::1]:5557") == "tcp://[::1]:5557"
    assert check_endpoint("ipc:///tmp/kv") == "ipc:///tmp/kv"
    assert check_endpoint("tcp://*:5557", bind=True) == "tcp://*:5557"
    for bad, why in [
        ("tcp://*:5557", "no host"),
        ("tcp://:5557", "no host"),
        ("tcp://h", "no port"),
        ("tcp://h:0", "no port"),
        ("tcp://h:70000", "no port"),
        ("http://h:1", "tcp:// or ipc://"),
        ("ipc://", "no path"),
    ]:
        with pytest.raises(ValueError, match=why):
            check_endpoint(bad)
    assert default_replay_endpoint("tcp://10.0.0.2:5557") == "tcp://10.0.0.2:5558"
    assert default_replay_endpoint("tcp://*:5557") == "tcp://*:5558"
    assert default_replay_endpoint("ipc:///tmp/kv") is None
    assert default_replay_endpoint("tcp://h:65535") is None
