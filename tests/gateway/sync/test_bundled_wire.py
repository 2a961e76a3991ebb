"""What bundled workers send their followers is decoded whole and bounded before anything applies."""

from __future__ import annotations

import msgspec
import orjson
import pytest

from gateway.sync.bundled_wire import HASH_MAX, MALFORMED, decode_poll, decode_snapshot, parse_entry
from protocol.kv_events import KVEvent


def test_a_poll_reply_becomes_event_batches_in_order() -> None:
    reply = {
        "seq": 3,
        "batches": [
            {"incarnation": "i", "seq": 2, "events": [{"type": "stored", "hashes": [1, 2], "parent": 9}]},
            {
                "incarnation": "i",
                "seq": 3,
                "events": [{"type": "removed", "hashes": [2]}, {"type": "cleared"}],
            },
        ],
    }
    newest, batches = decode_poll(orjson.dumps(reply))
    assert newest == 3 and [b.seq for b in batches] == [2, 3]
    assert batches[0].events == (KVEvent("stored", (1, 2), 9),)
    assert batches[1].events == (KVEvent("removed", (2,)), KVEvent("cleared"))


@pytest.mark.parametrize(
    "reply",
    [
        {"seq": 1, "batches": [{"incarnation": "i", "seq": 0, "events": []}]},
        {"seq": 1, "batches": [{"incarnation": "", "seq": 1, "events": []}]},
        {
            "seq": 1,
            "batches": [{"incarnation": "i", "seq": 1, "events": [{"type": "stored", "hashes": [-1]}]}],
        },
        {"seq": 1, "batches": [{"incarnation": "i", "seq": 1, "events": [{"type": "moved"}]}]},
        {"seq": -1, "batches": []},
    ],
)
def test_a_bad_poll_reply_is_refused_whole(reply: dict) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_poll(orjson.dumps(reply))


def test_a_snapshot_holds_only_64_bit_hashes() -> None:
    snapshot = decode_snapshot(orjson.dumps({"incarnation": "i", "seq": 0, "hashes": [0, HASH_MAX]}))
    assert (snapshot.incarnation, snapshot.seq, snapshot.hashes) == ("i", 0, [0, HASH_MAX])
    with pytest.raises(msgspec.ValidationError):
        decode_snapshot(b'{"incarnation": "i", "seq": 0, "hashes": [%d]}' % (HASH_MAX + 1))


def test_a_stream_entry_is_a_batch_or_one_of_the_malformed_errors() -> None:
    events = orjson.dumps([{"type": "stored", "hashes": [5]}]).decode()
    batch = parse_entry({"incarnation": "i", "seq": "7", "events": events})
    assert (batch.incarnation, batch.seq, batch.events) == ("i", 7, (KVEvent("stored", (5,)),))
    for fields in (
        {"incarnation": "i", "seq": "0", "events": events},
        {"incarnation": "i", "seq": "x", "events": events},
        {"incarnation": "i", "events": events},
        {"incarnation": "i" * 300, "seq": "1", "events": events},
        {"incarnation": "i", "seq": "1", "events": "[{"},
    ):
        with pytest.raises(MALFORMED):
            parse_entry(fields)
