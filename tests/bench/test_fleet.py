"""`bench fleet`, the command: its table, JSON and plot, the agent workload in both modes and
capacities, seeds averaged, and the profile its flags build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.fleet import fleet_profile
from bench.trace import write_conversation_trace
from bench.workloads import AgentParams, agent_sessions, total_turns
from prefixgate.cli import main
from workers.sim.profiles import get_profile


@pytest.mark.fleet
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


@pytest.mark.fleet
def test_cli_runs_the_agent_workload_for_the_index_policies_in_both_modes_and_capacities(
    tmp_path: Path,
) -> None:
    out = tmp_path / "agent.json"
    argv = ["bench", "fleet", "--workload", "agent", "--sessions", "8", "--replicas", "2"]
    main(
        [
            *argv,
            "--policies",
            "prefix_aware",
            "cache_threshold",
            "--capacity-priors",
            "1",
            "unset",
            "--json",
            str(out),
        ]
    )
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").exists()
    assert payload["workload"] == "agent"
    assert payload["requests"] == total_turns(agent_sessions(AgentParams(sessions=8)))
    assert set(payload["policies"]) == {
        "prefix_aware",
        "cache_threshold",
        "prefix_aware_approximate",
        "cache_threshold_approximate",
        "prefix_aware_approximate_unset",
        "cache_threshold_approximate_unset",
    }
    for row in payload["policies"].values():
        assert 0 < row["hit_rate"] <= payload["pooled_bound"]["hit_rate"] + 1e-9
        assert row["ttft_p50_s"] <= row["ttft_p99_s"] and row["imbalance"] >= 1


@pytest.mark.fleet
def test_seeds_average_the_runs_of_each_seed(tmp_path: Path) -> None:
    """--seeds 3 reports, per policy, the mean of the three one-seed runs, each measured alone."""
    argv = ["bench", "fleet", "--workload", "grouped", "--rate", "20", "--duration", "2", "--replicas", "2"]
    argv += ["--policies", "prefix_aware", "--modes", "precise", "--workers", "1"]
    single = []
    for seed in (4, 5, 6):
        out = tmp_path / f"seed{seed}.json"
        main([*argv, "--seed", str(seed), "--json", str(out)])
        single.append(json.loads(out.read_text())["policies"]["prefix_aware"])
    out = tmp_path / "seeds.json"
    main([*argv, "--seed", "4", "--seeds", "3", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert payload["seeds"] == [4, 5, 6]
    averaged = payload["policies"]["prefix_aware"]
    for key in ("hit_rate", "ttft_mean_s", "ttft_p99_s", "imbalance"):
        assert averaged[key] == pytest.approx(sum(s[key] for s in single) / 3)
    assert len({s["ttft_mean_s"] for s in single}) == 3  # the seeds are different workloads
    with pytest.raises(ValueError, match="not a trace, --pd or --ep"):
        main([*argv, "--seeds", "2", "--pd", "1:1"])


def test_the_profile_is_overridden_only_where_a_flag_is_given() -> None:
    base = get_profile("h100-8b")
    assert fleet_profile("h100-8b", None, None) == base
    small = fleet_profile("h100-8b", 16, 768, 512)
    assert (small.block_size, small.num_blocks, small.max_num_batched_tokens) == (16, 768, 512)
    assert small.cost == base.cost and small.model_name == base.model_name
    assert fleet_profile("h100-8b", None, 100).num_blocks == 100
