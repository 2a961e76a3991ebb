"""`bench replay`, the command: open-loop shared-prefix load end to end through the CLI against a real
simulated worker over loopback HTTP, the defaults `--sim-fleet` alone fills in, the checks its flags
get before anything starts, and the flags and titles that are the command's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.arrivals import Arrival, Prompt, arrival_sessions, shared_prefix_arrivals, shared_prefix_workload
from bench.peers import PEER_ROWS
from bench.replay import (
    FLEET_DURATION_S,
    FLEET_POLICIES,
    FLEET_RATE,
    FLEET_WORKLOAD,
    fill_fleet_defaults,
    workload_pace,
)
from bench.replay_rows import FLEET_MODES
from prefixgate.cli import build_parser, main


@pytest.mark.fleet
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


@pytest.mark.fleet
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


@pytest.mark.fleet
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
    # A tuned variant runs only when named in full, beside the router's defaults if asked for.
    assert args("--peers", "sglang,sglang cache_aware balanced").peers == (
        "sglang cache_aware",
        "sglang cache_aware balanced",
    )
    assert args().peers == ()  # no peer rows unless asked for
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "replay", "--sim-fleet", "2", "--peers", "nginx"])


def test_shapes_and_policies_are_parsed_or_refused() -> None:
    parse = build_parser().parse_args
    url = ["bench", "replay", "--url", "http://x"]
    args = parse([*url, "--shared-prefix", "1,2,3,4,5", "--policies", " prefix_aware,round_robin ,"])
    assert args.shared_prefix == (1, 2, 3, 4, 5) and args.policies == ("prefix_aware", "round_robin")
    for flags in (["--shared-prefix", "1,2,3,4"], ["--shared-prefix", "1,2,3,4,x"], ["--policies", ","]):
        with pytest.raises(SystemExit):
            parse([*url, *flags])


def test_the_title_says_how_each_workload_is_paced() -> None:
    def pace(flags: list[str], name: str, params: dict, sessions: int = 3) -> str:
        args = build_parser().parse_args(["bench", "replay", "--url", "http://x", *flags])
        arrivals = [Arrival(float(i), Prompt((5,), 1)) for i in range(sessions)]
        return workload_pace(args, name, params, arrival_sessions(arrivals))

    assert pace([], "agent", {"start_window_s": 30.0}) == "3 sessions starting within 30 s"
    assert pace(["--speed", "4"], "agent-zipf", {"start_window_s": 2.5}) == (
        "3 sessions starting within 2.5 s at speed 4"
    )
    assert pace([], "grouped", {"rate": 8.0}, sessions=5) == "5 prompts at 8 req/s"
    assert pace(["--rate", "40", "--duration", "20"], "shared-prefix 1,2,3,4,5", {}) == "40 req/s for 20 s"
    assert pace(["--speed", "2", "--duration", "5"], "trace t.jsonl", {}) == (
        "its own times at speed 2 for 5 s"
    )
