"""`bench replay --sim-fleet`: one schedule through a gateway per row over fresh simulated workers, in
each mode, for agent sessions, and beside a peer router; the imbalance each row reports; and the flags
checked before any worker starts."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from bench.arrivals import shared_prefix_arrivals, shared_prefix_workload
from bench.replay import FLEET_NUM_BLOCKS, fill_fleet_defaults
from bench.replay_fleet import imbalance, run_fleet
from bench.workloads import AgentParams, agent_sessions, total_turns
from prefixgate.cli import build_parser, main
from workers.sim.cost_model import CostModel
from workers.sim.profiles import Profile, profile_to_json


@pytest.mark.fleet
def test_sim_fleet_replays_one_schedule_through_a_gateway_per_row(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    argv = ["bench", "replay", "--sim-fleet", "2", "--policies", "prefix_aware,round_robin"]
    argv += ["--modes", "approx:1,precise", "--shared-prefix", "4,8,512,64,8", "--rate", "10"]
    main([*argv, "--duration", "2", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert payload["sim_fleet"]["count"] == 2 and payload["sim_fleet"]["num_blocks"] == FLEET_NUM_BLOCKS
    rows = payload["policies"]
    assert list(rows) == ["prefix_aware approx cap x1", "prefix_aware precise", "round_robin"]
    assert rows["prefix_aware approx cap x1"]["capacity_blocks"] == FLEET_NUM_BLOCKS
    assert rows["prefix_aware precise"]["capacity_blocks"] is None
    sent = len(shared_prefix_arrivals(shared_prefix_workload(4, 8, 512, 64, 8), 10, 2))
    for row in rows.values():
        assert row["sent"] == row["completed"] == sent > 5 and row["errors"] == {}
        assert set(row["requests_per_replica"]) <= {"w0", "w1"}
        assert sum(row["requests_per_replica"].values()) == sent
        assert 0 < row["ttft_s"]["p50"] <= row["e2e_s"]["p99"]
        assert row["imbalance"] >= 1
    assert rows["round_robin"]["imbalance"] <= 1 + 2 / sent  # alternating: off by one at most
    assert rows["prefix_aware precise"]["hit_rate"] > 0
    assert rows["prefix_aware approx cap x1"]["hit_rate"] > 0


@pytest.mark.fleet
def test_sim_fleet_runs_agent_sessions_through_each_mode(tmp_path: Path, worker_profile: Profile) -> None:
    # Ten times H100's speed, so that a session's answers take a fraction of a second.
    cost = {k: v / 10 for k, v in asdict(worker_profile.cost).items()}
    fast = replace(worker_profile, cost=CostModel(**cost))
    profile = tmp_path / "fast.json"
    profile.write_text(json.dumps(profile_to_json(fast)))
    out = tmp_path / "agent.json"
    argv = ["bench", "replay", "--sim-fleet", "2", "--sim-profile", str(profile), "--workload", "agent"]
    argv += ["--sessions", "3", "--duration", "0.5", "--speed", "20", "--policies", "cache_threshold"]
    main([*argv, "--modes", "approx:0.25,precise", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert payload["workload"] == "agent" and payload["workload_params"]["sessions"] == 3
    rows = payload["policies"]
    assert set(rows) == {"cache_threshold approx cap x0.25", "cache_threshold precise"}
    turns = total_turns(agent_sessions(AgentParams(sessions=3)))
    assert payload["requests"] == turns
    for row in rows.values():
        assert row["completed"] == turns and row["errors"] == {}
        assert row["hit_rate"] > 0.3  # every later turn extends the one before
    assert rows["cache_threshold approx cap x0.25"]["capacity_blocks"] == FLEET_NUM_BLOCKS // 4


@pytest.mark.fleet
def test_sim_fleet_compares_the_gateway_with_a_peer_router_over_word_counting_workers(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    argv = [
        "bench",
        "replay",
        "--sim-fleet",
        "2",
        "--workload",
        "agent",
        "--sessions",
        "4",
        "--duration",
        "1",
    ]
    argv += ["--speed", "4", "--text", "--sim-unit", "words", "--policies", "prefix_aware,round_robin"]
    main([*argv, "--modes", "approx", "--peers", "sglang", "--num-blocks", "256", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert payload["text"] is True and payload["sim_fleet"]["unit"] == "words"
    rows = payload["policies"]
    assert list(rows) == ["prefix_aware approx cap absent", "round_robin", "sglang cache_aware"]
    turns = total_turns(agent_sessions(replace(AgentParams(), sessions=4, start_window_s=1)))
    for row in rows.values():
        assert row["completed"] == turns and row["errors"] == {}
        # Every replica is a worker named by the gateway or, behind the peer, by the worker itself.
        assert set(row["requests_per_replica"]) <= {"w0", "w1"}
        assert 0 <= row["moved_turns"] <= 1 and row["hit_rate"] > 0.2
    assert (
        rows["sglang cache_aware"]["mode"] == "peer" and rows["sglang cache_aware"]["capacity_blocks"] is None
    )
    assert rows["round_robin"]["moved_turns"] > 0.15  # alternating replicas: about every other turn moves
    # The gateway's predictions come back with its answers; the peer makes none.
    assert rows["prefix_aware approx cap absent"]["ttft_predicted"] > 0
    assert rows["prefix_aware approx cap absent"]["cached_predicted"]["ratio"] > 0
    assert rows["sglang cache_aware"]["ttft_predicted"] is None
    assert rows["sglang cache_aware"]["cached_predicted"] is None


def test_imbalance_counts_idle_replicas_in_the_mean() -> None:
    assert imbalance({"w0": 6, "w1": 2}, 2) == pytest.approx(1.5)
    assert imbalance({"w0": 8}, 4) == pytest.approx(4.0)
    assert imbalance({}, 3) == 0.0


def test_fleet_flags_are_checked_before_any_worker_starts() -> None:
    argv = ["bench", "replay", "--workload", "agent"]
    for flags in (["--sim-fleet", "0"], ["--sim-fleet", "2", "--parallel", "0"]):
        args = build_parser().parse_args([*argv, *flags])
        fill_fleet_defaults(args)
        with pytest.raises(SystemExit, match="need at least 1"):
            run_fleet(args, "agent", {}, [], "no sessions")
