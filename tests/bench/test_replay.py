"""`bench replay` against a real simulated worker over loopback HTTP: open-loop shared-prefix load end
to end through the CLI, failures counted by kind, and workloads that are a pure function of the seed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from bench.replay import (
    FLEET_DURATION_S,
    FLEET_NUM_BLOCKS,
    FLEET_POLICIES,
    FLEET_RATE,
    FLEET_WORKLOAD,
    TOKEN_HIGH,
    TOKEN_LOW,
    Arrival,
    Prompt,
    fill_fleet_defaults,
    imbalance,
    replay,
    shared_prefix_arrivals,
    shared_prefix_workload,
    trace_arrivals,
)
from bench.trace import load_trace, write_conversation_trace
from gateway.cli import build_parser, main
from tests.conftest import free_port
from tests.workers.conftest import ServerThread
from workers.kv_events import KVEventLog
from workers.server import Worker, create_app
from workers.sim.engine import SimEngine
from workers.sim.profiles import get_profile
from workers.sim.runner import RealClock

# An H100-class cost model (a step of a few ms) with small blocks, so that short system prompts cache.
PROFILE = replace(get_profile("h100-8b"), block_size=16, kv_capacity_tokens=16 * 2048)


@pytest.fixture(scope="module")
def worker_url() -> Iterator[str]:
    events = KVEventLog()
    sim = SimEngine(PROFILE, clock=RealClock(), **events.callbacks())
    server = ServerThread(create_app(Worker.around(sim, events, worker_id="w", backend="sim")))
    yield server.start()
    server.stop()


def test_cli_replays_a_shared_prefix_load_and_writes_json_and_plot(worker_url: str, tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    argv = ["bench", "replay", "--url", worker_url, "--shared-prefix", "2,4,64,16,8"]
    assert main([*argv, "--rate", "15", "--duration", "2", "--seed", "3", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert (payload["url"], payload["workload"], payload["rate"]) == (
        worker_url,
        "shared-prefix 2,4,64,16,8",
        15,
    )
    assert payload["sent"] == len(
        shared_prefix_arrivals(shared_prefix_workload(2, 4, 64, 16, 8, 3), 15, 2, 3)
    )
    assert payload["completed"] == payload["sent"] > 10 and payload["errors"] == {}
    # Eight distinct prompts over two system prompts: most of each prompt is cached after the first.
    assert payload["hit_rate"] > 0.3
    assert payload["requests_per_replica"] == {"direct": payload["completed"]}
    for key in ("ttft_s", "itl_s", "e2e_s"):
        stats = payload[key]
        assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"], key
    assert payload["ttft_s"]["p99"] <= payload["e2e_s"]["p99"]
    assert payload["throughput_req_s"] > 0 and payload["output_tok_s"] >= 8 * payload["throughput_req_s"]


def test_failures_are_counted_by_kind_not_raised(worker_url: str) -> None:
    prompt = Prompt(tuple(range(TOKEN_LOW, TOKEN_LOW + 32)), 4)
    arrivals = [Arrival(0.01 * i, prompt) for i in range(5)]

    def run(url: str, model: str | None = None) -> dict:
        return asyncio.run(replay(url, arrivals, model=model, progress=False)).summary()

    refused = run(f"http://127.0.0.1:{free_port()}")  # nothing listens; the model cannot be asked either
    assert (refused["sent"], refused["completed"], refused["errors"]) == (5, 0, {"connect": 5})
    assert refused["ttft_s"]["p50"] is None and refused["hit_rate"] == 0.0
    assert run(worker_url, model="no-such-model")["errors"] == {"http_404": 5}
    slow = [Arrival(0.0, Prompt(prompt.token_ids, 500))]
    assert asyncio.run(replay(worker_url, slow, timeout_s=0.2, progress=False)).errors == {"timeout": 1}
    assert run(worker_url)["completed"] == 5  # the worker is fine after all that


def test_shared_prefix_workload_is_a_function_of_the_seed() -> None:
    workload = shared_prefix_workload(3, 5, 40, 7, 11, seed=1)
    assert workload == shared_prefix_workload(3, 5, 40, 7, 11, seed=1)
    assert workload != shared_prefix_workload(3, 5, 40, 7, 11, seed=2)
    assert len(workload) == 15 and {p.max_tokens for p in workload} == {11}
    assert all(
        len(p.token_ids) == 47 and TOKEN_LOW <= min(p.token_ids) < max(p.token_ids) < TOKEN_HIGH
        for p in workload
    )
    systems = [{p.token_ids[:40] for p in workload[g * 5 : (g + 1) * 5]} for g in range(3)]
    assert all(len(s) == 1 for s in systems) and len(set.union(*systems)) == 3
    assert len({p.token_ids[40:] for p in workload}) == 15
    # More groups leave the existing ones as they were.
    assert shared_prefix_workload(4, 5, 40, 7, 11, seed=1)[:15] == workload

    arrivals = shared_prefix_arrivals(workload, rate=50, duration_s=10, seed=4)
    assert arrivals == shared_prefix_arrivals(workload, rate=50, duration_s=10, seed=4)
    times = [a.at_s for a in arrivals]
    assert times == sorted(times) and times[0] > 0 and times[-1] < 10
    assert 400 < len(arrivals) < 600  # Poisson: 500 expected, sd 22
    assert {a.prompt for a in arrivals} == set(workload)


def test_trace_arrivals_follow_the_trace_or_the_rate(tmp_path: Path) -> None:
    trace = load_trace(write_conversation_trace(tmp_path / "t.jsonl", conversations=10), speed=2)
    own = trace_arrivals(trace, duration_s=15, max_prompt_tokens=1000)
    assert [a.at_s for a in own] == [r.arrival_s - trace[0].arrival_s for r in trace[: len(own)]]
    assert 0 < len(own) < len(trace) and own[-1].at_s < 15
    assert max(len(a.prompt.token_ids) for a in own) == 1000
    assert [a.prompt.max_tokens for a in own] == [r.output_length for r in trace[: len(own)]]
    paced = trace_arrivals(trace, duration_s=1, rate=20, max_prompt_tokens=1000)
    assert [a.prompt for a in paced] == [a.prompt for a in own[: len(paced)]]
    assert paced[-1].at_s < 1


def test_sim_fleet_replays_one_schedule_through_a_gateway_per_policy(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    argv = ["bench", "replay", "--sim-fleet", "2", "--policies", "prefix_aware,round_robin"]
    main([*argv, "--shared-prefix", "4,8,512,64,8", "--rate", "10", "--duration", "2", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert payload["sim_fleet"]["count"] == 2 and payload["sim_fleet"]["num_blocks"] == FLEET_NUM_BLOCKS
    rows = payload["policies"]
    assert list(rows) == ["prefix_aware", "round_robin"]
    sent = len(shared_prefix_arrivals(shared_prefix_workload(4, 8, 512, 64, 8), 10, 2))
    for row in rows.values():
        assert row["sent"] == row["completed"] == sent > 5 and row["errors"] == {}
        assert set(row["requests_per_replica"]) <= {"w0", "w1"}
        assert sum(row["requests_per_replica"].values()) == sent
        assert 0 < row["ttft_s"]["p50"] <= row["e2e_s"]["p99"]
        assert row["imbalance"] >= 1
    assert rows["round_robin"]["imbalance"] <= 1 + 2 / sent  # alternating: off by one at most
    assert rows["prefix_aware"]["hit_rate"] > 0


def test_sim_fleet_alone_runs_the_default_comparison_and_a_url_needs_a_workload() -> None:
    args = build_parser().parse_args(["bench", "replay", "--sim-fleet", "4"])
    fill_fleet_defaults(args)
    assert (args.shared_prefix, args.rate, args.duration, args.policies) == (
        FLEET_WORKLOAD,
        FLEET_RATE,
        FLEET_DURATION_S,
        FLEET_POLICIES,
    )
    with pytest.raises(SystemExit, match="give a workload"):
        fill_fleet_defaults(
            build_parser().parse_args(["bench", "replay", "--url", "http://x", "--duration", "1"])
        )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "replay", "--sim-fleet", "2", "--policies", "prefix_aware,nope"])


def test_imbalance_counts_idle_replicas_in_the_mean() -> None:
    assert imbalance({"w0": 6, "w1": 2}, 2) == pytest.approx(1.5)
    assert imbalance({"w0": 8}, 4) == pytest.approx(4.0)
    assert imbalance({}, 3) == 0.0
