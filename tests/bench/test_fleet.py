"""The fleet simulator: real scheduler and block manager per replica, real index and policies."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.fleet import jobs_of, pooled_hit_rate, simulate
from bench.trace import load_trace, prompt_tokens, write_conversation_trace
from gateway.cli import main
from policies import RoutingConfig
from radix import block_hashes
from workers.sim.profiles import get_profile

PROFILE = get_profile("h100-8b")


def test_prefix_aware_beats_round_robin_on_cache_and_ttft(tmp_path: Path) -> None:
    trace = load_trace(write_conversation_trace(tmp_path / "t.jsonl", conversations=40, turns=4), speed=4.0)
    rr = simulate(trace, RoutingConfig(policy="round_robin"), PROFILE, 4)
    aware = simulate(trace, RoutingConfig(policy="prefix_aware"), PROFILE, 4)
    approx = simulate(trace, RoutingConfig(policy="prefix_aware"), PROFILE, 4, mode="approximate")
    pooled = pooled_hit_rate(trace, PROFILE, 4)
    for result in (rr, aware, approx):
        assert result.completed == len(trace) and result.rejected == 0
    assert aware.hit_rate > 1.5 * rr.hit_rate
    assert aware.hit_rate >= 0.8 * pooled
    assert approx.hit_rate > 1.5 * rr.hit_rate
    assert aware.ttft_mean_s < rr.ttft_mean_s


def test_cli_table_json_and_plot(tmp_path: Path) -> None:
    trace = write_conversation_trace(tmp_path / "t.jsonl", conversations=8, turns=2)
    out = tmp_path / "fleet.json"
    main(
        [
            "bench",
            "fleet",
            "--trace",
            str(trace),
            "--replicas",
            "2",
            "--profile",
            "h100-8b",
            "--policies",
            "round_robin",
            "prefix_aware",
            "--json",
            str(out),
        ]
    )
    payload = json.loads(out.read_text())
    assert set(payload["policies"]) == {"round_robin", "prefix_aware", "prefix_aware_approximate"}
    assert 0 < payload["pooled_bound"]["hit_rate"] < 1
    assert out.with_suffix(".png").exists()


def test_pooled_bound_counts_every_repeated_block_with_room_enough(tmp_path: Path) -> None:
    trace = load_trace(write_conversation_trace(tmp_path / "t.jsonl", conversations=6, turns=3))
    roomy = replace(PROFILE, kv_capacity_tokens=10**9)
    bs = roomy.block_size
    seen: set[int] = set()
    expected = 0
    for request in trace:
        hashes = block_hashes(prompt_tokens(request, roomy.vocab_size), bs, roomy.model_name)
        usable = hashes[: (request.input_length - 1) // bs]
        expected += bs * next((i for i, h in enumerate(usable) if h not in seen), len(usable))
        seen.update(hashes)
    assert expected > 0
    assert pooled_hit_rate(trace, roomy, 1) == pytest.approx(expected / sum(r.input_length for r in trace))


def test_jobs_run_approximate_mode_for_prefix_aware_only() -> None:
    jobs = jobs_of(["round_robin", "prefix_aware"], ["precise", "approximate"])
    assert jobs == [("round_robin", "precise"), ("prefix_aware", "precise"), ("prefix_aware", "approximate")]
