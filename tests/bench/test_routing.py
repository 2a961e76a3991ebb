"""The routing replay: real index and policies over a cache-and-queue model, end to end via the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.routing import pooled_hit_rate, simulate
from bench.trace import load_trace, write_conversation_trace
from gateway.cli import main
from policies import POLICY_NAMES, RoutingConfig


def test_prefix_aware_keeps_conversations_on_their_cache(tmp_path: Path) -> None:
    trace = load_trace(write_conversation_trace(tmp_path / "t.jsonl"))
    capacity = 200 * 512
    results = {
        name: simulate(trace, RoutingConfig(policy=name), 4, capacity, 10_000.0) for name in POLICY_NAMES
    }
    pooled = pooled_hit_rate(trace, 4 * capacity)
    aware = results["prefix_aware"]
    for name in ("round_robin", "random", "least_load", "power_of_two"):
        assert aware.hit_rate > 1.5 * results[name].hit_rate
        assert aware.ttft_mean_s < results[name].ttft_mean_s
    assert aware.hit_rate >= 0.95 * pooled
    # The shared system block must not pack new sessions onto the replicas that happen to hold it.
    assert aware.imbalance <= 1.25
    assert min(aware.requests_per_replica) > 0
    assert sum(aware.requests_per_replica) == len(trace)
    for result in results.values():
        assert 0.0 <= result.hit_rate <= 1.0
        assert result.ttft_p99_s >= result.ttft_mean_s > 0


def test_pooled_bound_sees_every_repeat_with_room_enough(tmp_path: Path) -> None:
    trace = load_trace(write_conversation_trace(tmp_path / "t.jsonl", conversations=6, turns=3))
    # Every prompt's full blocks, minus its new ones, were seen before: count them directly.
    seen: set[int] = set()
    expected = 0
    for r in trace:
        expected += sum(
            512
            for h in r.full_blocks[
                : next((i for i, h in enumerate(r.full_blocks) if h not in seen), len(r.full_blocks))
            ]
        )
        seen.update(r.full_blocks)
    assert pooled_hit_rate(trace, 10**9) == pytest.approx(expected / sum(r.input_length for r in trace))


def test_cli_writes_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_conversation_trace(tmp_path / "t.jsonl", conversations=20, turns=3)
    out = tmp_path / "routing.json"
    main(
        [
            "bench",
            "routing",
            "--trace",
            str(trace),
            "--replicas",
            "3",
            "--capacity-tokens",
            "20000",
            "--speed",
            "2",
            "--json",
            str(out),
        ]
    )
    payload = json.loads(out.read_text())
    assert set(payload["policies"]) == set(POLICY_NAMES)
    for summary in payload["policies"].values():
        assert set(summary) == {"hit_rate", "ttft_mean_s", "ttft_p99_s", "imbalance"}
    assert 0 < payload["pooled_bound"]["hit_rate"] < 1
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "prefix_aware" in table and "pooled bound" in table


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
