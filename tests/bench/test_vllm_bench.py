"""bench vllm's pure parts: a row's rounds read as one (the servers themselves are
tests/gateway/test_real_vllm.py's)."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import pytest

from bench.replay_result import ReplayResult, RequestRecord
from bench.vllm_bench import (
    NUM_BLOCKS,
    ROUTERS,
    WAIT_COLUMNS,
    WORKLOADS,
    _chosen,
    _speed,
    _wait_cells,
    alone_bound,
    as_token_ids,
    row_summary,
    workload_params,
)
from bench.vllm_fleet import BLOCK_SIZE, PrefillTiming, ServerCounters, VllmServer, VllmSpec
from bench.workloads import HELD_OUT, Session, Turn, agent_sessions

NOTHING = ServerCounters(0, 0, 0, 0)
# 100 tokens a second beyond 0.5 s a request.
TIMING = PrefillTiming(tokens_s=100.0, fixed_s=0.5)
SERVERS = [VllmServer(i, 8000 + i, f"ipc:///tmp/e{i}", f"tcp://127.0.0.1:{9000 + i}") for i in range(2)]


def _replay(ttfts: list[float], replica: str) -> ReplayResult:
    records = [RequestRecord(t, (), t, 100, 50, 1, replica, s, 0) for s, t in enumerate(ttfts)]
    return ReplayResult("u", len(records), 10.0, records)


def test_a_rows_rounds_pool_their_requests_and_sum_the_servers_counters() -> None:
    rounds = [
        (
            _replay([1.0, 3.0], "vllm0"),
            [ServerCounters(2, 200, 200, 100, 2.4, 0.8, 1.2), ServerCounters(0, 0, 0, 0)],
        ),
        (
            _replay([2.0], "vllm1"),
            [ServerCounters(0, 0, 0, 0), ServerCounters(1, 100, 100, 80, 1.2, 0.4, 0.6)],
        ),
    ]
    row = row_summary(ROUTERS[0], SERVERS, rounds, TIMING)
    assert row["ttft_s"]["mean"] == pytest.approx(2.0) and row["completed"] == 3
    assert [r["ttft_mean_s"] for r in row["rounds"]] == [pytest.approx(2.0), pytest.approx(2.0)]
    assert row["servers"]["vllm0"]["requests"] == 2 and row["servers"]["vllm1"]["hit_rate"] == pytest.approx(
        0.8
    )
    assert row["vllm_hit_rate"] == pytest.approx(180 / 300)
    assert row["imbalance"] == pytest.approx(2 * 2 / 3)
    # Every request computed 50 of its 100 tokens: 0.5 s of its own at 100 tokens/s, past 0.5 s fixed.
    assert row["ttft_alone_mean_s"] == pytest.approx(1.0)
    # vLLM's own account, per request: 1.2 s to its first token, 0.4 s of it queued, 0.6 s prefilling.
    assert row["vllm_ttft_mean_s"] == pytest.approx(1.2) and row["vllm_queued_mean_s"] == pytest.approx(0.4)
    assert _wait_cells(row) == [2.0, 1.0, "50%", *map(pytest.approx, (1.2, 0.4, 0.6, 0.8))]
    assert len(_wait_cells(row)) == len(WAIT_COLUMNS)
    # Servers that published no TTFT histogram: no reading, not an instant first token.
    untimed = row_summary(ROUTERS[0], SERVERS, [(r, [NOTHING, NOTHING]) for r, _ in rounds], TIMING)
    assert untimed["vllm_ttft_mean_s"] is None
    assert _wait_cells(untimed) == [2.0, *["-"] * (len(WAIT_COLUMNS) - 1)]


def test_the_bound_reuses_what_a_cache_of_the_fleets_size_would_hold() -> None:
    """Sessions whose turns repeat their first prompt and add to it: their later turns find their
    history in the pooled cache, so the bound's TTFT is below the same prompts computed whole; a fleet
    of a few blocks reuses less, and one whose cache vLLM sizes itself is not bounded."""
    words = [*range(1000, 1400)]
    sessions = [
        Session(float(s), (Turn(tuple(words[: 200 + s]), 4), Turn(tuple(words[: 300 + s]), 4, think_s=1.0)))
        for s in range(3)
    ]
    ids = as_token_ids(sessions)
    roomy = alone_bound(ids, VllmSpec(count=2, num_blocks=NUM_BLOCKS), TIMING)
    tiny = alone_bound(ids, VllmSpec(count=1, num_blocks=3, max_model_len=64), TIMING)
    unbounded = alone_bound(ids, VllmSpec(count=2), TIMING)
    assert 0.5 < roomy["pooled_hit_rate"] < 1.0 and tiny["pooled_hit_rate"] < 0.5 * roomy["pooled_hit_rate"]
    assert unbounded["pooled_hit_rate"] == roomy["pooled_hit_rate"]
    assert TIMING.fixed_s < roomy["ttft_mean_s"] < tiny["ttft_mean_s"]
    assert BLOCK_SIZE == 32


def test_rounds_below_one_are_refused() -> None:
    args = argparse.Namespace(workloads="agent", routers=None, rounds=0)
    with pytest.raises(SystemExit, match="--rounds"):
        _chosen(args)


def test_speed_is_auto_or_a_positive_finite_number() -> None:
    assert _speed("auto") is None and _speed("0.25") == 0.25
    for bad in ("0", "-1", "nan", "inf", "fast", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="positive number or auto"):
            _speed(bad)


def test_the_held_out_workload_is_agents_sessions_thinking_longer_at_its_arrival_rate() -> None:
    assert "agent-think" in HELD_OUT and "agent" not in HELD_OUT and "grouped" not in HELD_OUT
    agent, think = (agent_sessions(WORKLOADS[name]) for name in ("agent", "agent-think"))  # type: ignore[arg-type]
    assert [s.start_s for s in think] == [s.start_s for s in agent]
    assert [len(s.turns) for s in think] == [len(s.turns) for s in agent]
    pauses, agent_pauses = ([t.think_s for s in w for t in s.turns[1:]] for w in (think, agent))
    assert min(pauses) >= 6.0 and statistics.fmean(pauses) > 4 * statistics.fmean(agent_pauses)
    args = argparse.Namespace(workloads="agent-think", routers="sglang cache_aware", rounds=1)
    assert _chosen(args)[0] == ["agent-think"]


def test_a_seed_draws_other_sessions_of_the_same_shape() -> None:
    for name in WORKLOADS:
        assert workload_params(name, 0) == WORKLOADS[name]
        first, other = (workload_params(name, seed) for seed in (0, 1))
        assert other.seed == 1 and replace(other, seed=0) == first
    agent = [agent_sessions(workload_params("agent", seed)) for seed in (0, 1)]  # type: ignore[arg-type]
    assert [s.start_s for s in agent[0]] != [s.start_s for s in agent[1]]
    assert [list(t.prompt) for t in agent[0][0].turns] != [list(t.prompt) for t in agent[1][0].turns]
    assert len(agent[0]) == len(agent[1])
