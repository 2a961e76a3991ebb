"""Mooncake-format traces: loading, speed, and errors that name their line."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.trace import load_trace, write_conversation_trace


def test_trace_speed_compresses_time(tmp_path: Path) -> None:
    path = write_conversation_trace(tmp_path / "t.jsonl", conversations=2, turns=2)
    slow, fast = load_trace(path), load_trace(path, speed=2.0)
    assert [r.arrival_s / 2 for r in slow] == [r.arrival_s for r in fast]


def test_bad_trace_record_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 5}\n'
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_trace(path)
