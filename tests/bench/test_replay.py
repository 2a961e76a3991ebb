"""`bench replay` against a real simulated worker over loopback HTTP: open-loop shared-prefix load end
to end through the CLI, agent sessions closed loop within a session, failures counted by kind,
workloads that are a pure function of the seed, the fleet comparison's rows and gateway configs, and
fleets whose workers count in their own unit (words, blocks of 64) with a peer router's row."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from bench.peers import PEER_ROWS
from bench.replay import (
    APPROX,
    BLOCKS64,
    FLEET_DURATION_S,
    FLEET_MODES,
    FLEET_NUM_BLOCKS,
    FLEET_POLICIES,
    FLEET_RATE,
    FLEET_WORKLOAD,
    PRECISE,
    TOKEN_HIGH,
    TOKEN_LOW,
    Arrival,
    Mode,
    Prompt,
    RequestRecord,
    fill_fleet_defaults,
    fleet_rows,
    fleet_workers,
    imbalance,
    moved_turns,
    replay,
    replay_sessions,
    row_fleet,
    row_gateway_config,
    shared_prefix_arrivals,
    shared_prefix_workload,
    trace_arrivals,
    ttft_predicted,
)
from bench.trace import load_trace, write_conversation_trace
from bench.words import text_of
from bench.workloads import AgentParams, agent_sessions, total_turns
from gateway.config import parse_config
from prefixgate.cli import build_parser, main
from protocol.models import default_tokenizer
from tests.support.servers import ServerThread, free_port
from workers.kv_events import KVEventLog
from workers.server import Worker, create_app
from workers.sim.cost_model import CostModel
from workers.sim.engine import SimEngine
from workers.sim.profiles import get_profile, profile_to_json
from workers.sim.runner import RealClock

pytestmark = pytest.mark.fleet

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


def test_agent_sessions_are_closed_loop_within_a_session(worker_url: str) -> None:
    params = AgentParams(
        tenants=1,
        system_tokens=64,
        sessions=2,
        min_turns=3,
        max_turns=3,
        tool_tokens=32,
        min_output_tokens=4,
        max_output_tokens=8,
        think_base_s=0.3,
        think_mean_s=0.01,
        start_window_s=0.1,
    )
    sessions = agent_sessions(params)
    result = asyncio.run(replay_sessions(worker_url, sessions, progress=False))
    summary = result.summary()
    assert result.sent == summary["completed"] == 6 and summary["errors"] == {}
    # Each session waits for each answer and then thinks: its turns cannot overlap, so the run lasts
    # at least one session's answers and two think times.
    by_session = sorted(result.records, key=lambda r: r.prompt_tokens)
    assert result.elapsed_s >= 2 * 0.3 + sum(r.e2e_s for r in by_session[::2])
    # Later turns extend earlier ones (and the two sessions share a system prompt): cached.
    assert sum(r.cached_tokens > 0 for r in result.records) >= 4


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


def test_sim_fleet_runs_agent_sessions_through_each_mode(tmp_path: Path) -> None:
    # Ten times H100's speed, so that a session's answers take a fraction of a second.
    fast = replace(PROFILE, cost=CostModel(**{k: v / 10 for k, v in asdict(PROFILE.cost).items()}))
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


def test_rows_put_the_index_policies_side_by_side_per_mode() -> None:
    rows = fleet_rows(FLEET_POLICIES, FLEET_MODES)
    assert [r.name for r in rows] == [
        "prefix_aware approx cap x0.25",
        "cache_threshold approx cap x0.25",
        "prefix_aware approx cap x1",
        "cache_threshold approx cap x1",
        "prefix_aware approx cap x16",
        "cache_threshold approx cap x16",
        "prefix_aware approx cap absent",
        "cache_threshold approx cap absent",
        "prefix_aware precise",
        "cache_threshold precise",
        "least_load",
        "round_robin",
    ]


def test_gateway_configs_declare_the_workers_as_each_mode_says() -> None:
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]

    def replicas(mode: Mode) -> list:
        config = row_gateway_config("m", urls, "cache_threshold", mode, (16, 768), 8000)
        return parse_config(config).replicas

    approx = replicas(Mode(False, 16.0))
    assert [(r.id, r.kind, r.block_size, r.capacity_blocks) for r in approx] == [
        ("w0", "openai", 16, 768 * 16),
        ("w1", "openai", 16, 768 * 16),
    ]
    assert replicas(Mode(False, 0.25))[0].capacity_blocks == 192
    # Left out: whatever the gateway assumes (or learns) when it is told nothing.
    absent = row_gateway_config("m", urls, "prefix_aware", Mode(False), (16, 768), 8000)
    assert all("capacity_blocks" not in r and r["kind"] == "openai" for r in absent["replicas"])
    assert [r.kind for r in replicas(PRECISE)] == ["bundled", "bundled"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "replay", "--sim-fleet", "2", "--modes", "approx:-1"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "replay", "--sim-fleet", "2", "--modes", "fuzzy"])


def test_sim_fleet_alone_runs_the_default_comparison_and_a_url_needs_a_workload() -> None:
    args = build_parser().parse_args(["bench", "replay", "--sim-fleet", "4"])
    fill_fleet_defaults(args)
    assert (args.shared_prefix, args.rate, args.duration, args.policies, args.modes) == (
        FLEET_WORKLOAD,
        FLEET_RATE,
        FLEET_DURATION_S,
        FLEET_POLICIES,
        FLEET_MODES,
    )
    with pytest.raises(SystemExit, match="give a workload"):
        fill_fleet_defaults(
            build_parser().parse_args(["bench", "replay", "--url", "http://x", "--duration", "1"])
        )
    with pytest.raises(SystemExit, match="--duration"):
        fill_fleet_defaults(
            build_parser().parse_args(["bench", "replay", "--url", "http://x", "--trace", "t"])
        )
    agent = build_parser().parse_args(["bench", "replay", "--url", "http://x", "--workload", "agent"])
    fill_fleet_defaults(agent)
    assert agent.duration is None  # the workload's own start window
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "replay", "--sim-fleet", "2", "--policies", "prefix_aware,nope"])


def test_imbalance_counts_idle_replicas_in_the_mean() -> None:
    assert imbalance({"w0": 6, "w1": 2}, 2) == pytest.approx(1.5)
    assert imbalance({"w0": 8}, 4) == pytest.approx(4.0)
    assert imbalance({}, 3) == 0.0


def _record(session: int | None, turn: int, replica: str) -> RequestRecord:
    return RequestRecord(0.1, (), 0.2, 10, 0, 1, replica, session, turn)


def test_moved_turns_count_later_turns_served_elsewhere_than_the_turn_before() -> None:
    records = [
        _record(0, 0, "w0"),
        _record(0, 1, "w0"),
        _record(0, 2, "w1"),  # moved
        _record(0, 3, "w1"),
        _record(1, 0, "w1"),
        _record(1, 2, "w0"),  # its turn 1 failed: nothing to compare with
        _record(1, 3, "w1"),  # moved
    ]
    assert moved_turns(records) == pytest.approx(2 / 4)
    assert moved_turns(list(reversed(records))) == pytest.approx(2 / 4)  # completion order is no matter
    assert moved_turns([_record(i, 0, f"w{i % 2}") for i in range(5)]) is None  # single turns
    assert moved_turns([_record(None, 0, "w0"), _record(None, 0, "w1")]) is None  # no sessions


def test_the_predicted_ttft_is_read_against_the_ttft_seen() -> None:
    seen = [
        replace(_record(0, k, "w0"), ttft_s=t, predicted_ttft_s=p)
        for k, (t, p) in enumerate([(1, 0.5), (3, 1.5)])
    ]
    assert ttft_predicted(seen) == pytest.approx(0.5)
    assert ttft_predicted([*seen, _record(0, 9, "w1")]) == pytest.approx(0.5)  # no prediction: not counted
    assert ttft_predicted([_record(0, 0, "w0")]) is None


def test_foreign_units_and_peers_are_checked_before_anything_starts() -> None:
    def args(*flags: str) -> object:
        parsed = build_parser().parse_args(
            ["bench", "replay", "--sim-fleet", "2", "--workload", "agent", *flags]
        )
        fill_fleet_defaults(parsed)
        return parsed

    assert args("--sim-unit", "words").modes == tuple(m for m in FLEET_MODES if not m.precise)
    assert args().modes == FLEET_MODES
    for flags, message in [
        (("--text",), "--text and --sim-unit words"),
        (("--sim-unit", "words"), "--text and --sim-unit words"),
        (("--text", "--sim-unit", "blocks64"), "--text and --sim-unit words"),
        (("--text", "--sim-unit", "words", "--modes", "approx,precise"), "approx modes only"),
        (("--peers", "sglang"), "text prompts only"),
    ]:
        with pytest.raises(SystemExit, match=message):
            main(["bench", "replay", "--sim-fleet", "2", "--workload", "agent", *flags])
    assert args("--peers", "sglang").peers == ("sglang cache_aware",)
    assert args("--peers", "vllm-router,sglang cache_aware,vllm-router kv_aware").peers == (
        "vllm-router cache_aware",
        "vllm-router kv_aware",
        "sglang cache_aware",
    )
    assert set(args("--peers", "sglang,vllm-router").peers) == set(PEER_ROWS)
    assert args().peers == ()  # no peer rows unless asked for
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "replay", "--sim-fleet", "2", "--peers", "nginx"])


def test_foreign_workers_are_declared_openai_in_every_row_and_the_text_gateway_tokenizes() -> None:
    rows = fleet_rows(["prefix_aware", "round_robin"], [APPROX], plain=APPROX)
    assert [(r.name, r.mode) for r in rows] == [
        ("prefix_aware approx cap absent", APPROX),
        ("round_robin", APPROX),
    ]
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    config = parse_config(row_gateway_config("m", urls, "round_robin", APPROX, (16, 768), 8000, text=True))
    assert config.tokenizer_for("m") == "default" and {r.kind for r in config.replicas} == {"openai"}
    assert (
        parse_config(row_gateway_config("m", urls, "round_robin", APPROX, (16, 768), 8000)).tokenizer_for("m")
        == "none"
    )
    words = fleet_workers(2, "h100-8b", (16, 768), "words")
    assert (words.spec.block_size, words.spec.num_blocks, words.flags) == (
        16,
        768,
        ("--sim-tokenizer", "words"),
    )
    blocks = fleet_workers(2, "h100-8b", (16, 768), "blocks64")
    assert (blocks.spec.block_size, blocks.spec.num_blocks, blocks.flags) == (BLOCKS64, 192, ())


# Two short agent sessions of a few turns on a tenant's system prompt, and a gateway that learns.
SHORT_AGENT = AgentParams(
    tenants=1,
    system_tokens=256,
    sessions=2,
    min_turns=3,
    max_turns=3,
    tool_tokens=96,
    min_output_tokens=4,
    max_output_tokens=8,
    think_base_s=0.1,
    think_mean_s=0.01,
    start_window_s=0.1,
)


def test_workers_counting_words_report_their_own_counts_behind_a_gateway_reading_tokens(
    tmp_path: Path,
) -> None:
    sessions = agent_sessions(SHORT_AGENT)
    workers = fleet_workers(2, "h100-8b", (16, 256), "words")
    with row_fleet(tmp_path, workers, "prefix_aware", APPROX, (16, 256), text=True) as url:
        result = asyncio.run(
            replay_sessions(url, sessions, model=workers.spec.model, text=True, progress=False)
        )
    assert result.summary()["errors"] == {} and result.completed == 6
    prompts = {(i, k): turn.prompt for i, s in enumerate(sessions) for k, turn in enumerate(s.turns)}
    tokenizer = default_tokenizer()
    for r in result.records:
        assert r.session is not None and r.replica in {"w0", "w1"}
        # One word per id: the workers count the ids' number, the gateway's tokenizer ~2.8 times it.
        words = len(prompts[r.session, r.turn])
        assert r.prompt_tokens == words
        assert len(tokenizer.encode(text_of(prompts[r.session, r.turn]))) > 2 * words
        # Cached in the workers' blocks of 16 words.
        assert r.cached_tokens % 16 == 0 and r.cached_tokens < words
    assert sum(r.cached_tokens > 0 for r in result.records) >= 3  # later turns, and the shared system prompt
    assert moved_turns(result.records) is not None


def test_blocks64_workers_cache_in_their_own_blocks(tmp_path: Path) -> None:
    workers = fleet_workers(2, "h100-8b", (16, 256), "blocks64")
    with row_fleet(tmp_path, workers, "cache_threshold", APPROX, (16, 256)) as url:
        result = asyncio.run(replay_sessions(url, agent_sessions(SHORT_AGENT), progress=False))
    assert result.completed == 6
    cached = [r.cached_tokens for r in result.records]
    assert all(c % BLOCKS64 == 0 for c in cached) and max(cached) >= BLOCKS64


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
    assert rows["sglang cache_aware"]["ttft_predicted"] is None
