"""A follower's state, the same shape for every transport."""

from __future__ import annotations

from gateway.sync.state import SyncState


def test_lag_counts_from_the_oldest_change_missed_and_a_failure_keeps_it() -> None:
    state = SyncState("r", "http://w", "redis")
    assert not state.synced and state.lag_s() == 0.0
    state.behind(since=100.0)
    state.behind(since=150.0)
    assert state.lag_s(now=160.0) == 60.0, "the oldest change missed, not the latest"
    state.failed(ConnectionError("refused"))
    assert (state.errors, state.last_error, state.connected) == (1, "ConnectionError: refused", False)
    assert state.lag_s(now=160.0) == 60.0
    state.seq = 0
    assert state.synced, "seq 0 is a snapshot's: synced"


def test_every_transport_reports_the_same_fields() -> None:
    zmq = SyncState("v", "tcp://h:5557", "zmq", replay="tcp://h:5558")
    zmq.skipped["lora"] += 2
    bundled = SyncState("w", "http://w", "http", incarnation="abc", seq=4)
    rows = zmq.to_json(now=0.0), bundled.to_json(now=0.0)
    assert rows[0].keys() == rows[1].keys()
    assert (rows[0]["replay"], rows[0]["skipped_blocks"], rows[0]["synced"]) == (
        "tcp://h:5558",
        {"lora": 2},
        False,
    )
    assert (rows[1]["incarnation"], rows[1]["seq"], rows[1]["synced"]) == ("abc", 4, True)
