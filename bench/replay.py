"""`prefixgate bench replay`: load against any OpenAI-compatible endpoint (the gateway, one of our
workers, vLLM, SGLang), with TTFT, inter-token latency, cache hit rate and the replica spread.

Open loop across sessions: each session starts at its scheduled time whether or not earlier ones
have finished. A closed loop over all users slows down with the server and so hides the queueing
that latency under load is about. Within a session (bench.workloads: an agent's turns) the loop is
closed, as an agent's is: a turn leaves its think time after the previous answer ended. A trace or
a shared-prefix load is sessions of one request. Prompts are token ids, which both the gateway and
the simulated workers accept, so no tokenizer runs on either side of the measurement; with `--text`
they are sent as words (bench.token_text), for servers and routers that tokenize what they are sent.

With `--sim-fleet N` it brings its own servers: per row, N fresh simulated workers (empty caches)
and a gateway with the row's policy, each its own process (bench.local_fleet), and one workload
replayed through each gateway, `--parallel` rows at a time (a simulated fleet needs little CPU, and
rows run together share the machine's noise). The policies that read the index get a row per mode: the
workers declared as bundled (precise: the gateway follows their KV events) or as foreign OpenAI
servers (approximate: the gateway predicts their caches from its own routing) with the capacity the
gateway is told set to a multiple of their true pool, or left for it to learn.

`--sim-unit` makes the workers count in another unit than the gateway, as a foreign backend does:
`words` (they read the text as one token per word, `prefixgate worker --sim-tokenizer words`, while
the gateway reads it with SmolLM2's tokenizer, about 2.8 tokens a word) or `blocks64` (the gateway's
tokens, cached in blocks of 64). Such workers are declared foreign (`kind: openai`) in every row, since
the gateway can follow no events in another unit. `--peers` adds rows where a peer router
(bench.peers: sglang-router, vllm-router) stands in for the gateway over fresh workers of the same
kind. Each row's hit rate is what its workers report (usage.prompt_tokens_details.cached_tokens in
their own unit), and its moved turns the share of sessions' turns served by another replica than the
turn before: the gateway names its replica in a header, a peer router names none, so there the
workers' own header is read.

This module is the command: its flags, the workload they choose and a run against one URL. The
workloads are bench.arrivals', the load generator bench.loadgen's, what it measures
bench.replay_result's and its tables bench.replay_tables'; `--sim-fleet` runs in bench.replay_fleet,
its rows (bench.replay_rows) over fleets bench.row_fleets starts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.arrivals import arrival_sessions, shared_prefix_arrivals, shared_prefix_workload, trace_arrivals
from bench.loadgen import replay_sessions
from bench.peers import PEER_ROWS, PEER_VARIANTS
from bench.replay_fleet import run_fleet
from bench.replay_rows import BLOCKS64, FLEET_MODES, SIM_UNITS, parse_modes, parse_peers
from bench.replay_tables import endpoint_panels, endpoint_tables
from bench.report import bar_panels, write_json
from bench.shared_flags import WORKLOADS, generated_sessions, prefix_aware_knob
from bench.trace import load_trace
from bench.workloads import AGENT_WORKLOADS, AgentParams, GroupedParams, Session
from policies import POLICY_NAMES

# Fleet mode (--sim-fleet) defaults: the policies compared, and workers whose cache holds only a
# fraction of the workload's system prompts, the regime in which the replica chosen decides the hit:
# 768 blocks of 16 tokens are 12k tokens, six of the sixteen 2k-token system prompts. At 40 req/s,
# at round robin's hit rate, each replica's modelled prefill is about half busy, so hits show in
# TTFT. Twelve rows (the index policies in five modes each) of 20 s, about 800 requests a row, four
# at a time, take about two minutes on two cores with their start-ups; the agent workload about four.
FLEET_POLICIES = ("prefix_aware", "cache_threshold", "least_load", "round_robin")
FLEET_PROFILE = "h100-8b"
FLEET_BLOCK_SIZE = 16
FLEET_NUM_BLOCKS = 768
FLEET_WORKLOAD = (16, 32, 2048, 128, 32)
FLEET_RATE = 40.0
FLEET_DURATION_S = 20.0
FLEET_PARALLEL = 4


def _shape(text: str) -> tuple[int, ...]:
    """`--shared-prefix`: five integers, shared_prefix_workload's shape."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 5:
        raise argparse.ArgumentTypeError(
            f"expected groups,prompts,system_len,question_len,output_len (five integers), got {text!r}"
        )
    return values


def _policies(text: str) -> tuple[str, ...]:
    """`--policies`: known policy names, comma-separated, a gateway row (or a row per mode) each."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in POLICY_NAMES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(POLICY_NAMES)}; got {text!r}"
        )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", default=None, help="base URL of an OpenAI-compatible server")
    target.add_argument(
        "--sim-fleet",
        type=int,
        default=None,
        metavar="N",
        help="start N simulated workers and, per row (policy and mode), a gateway over them",
    )
    workload = parser.add_mutually_exclusive_group()
    workload.add_argument("--trace", default=None, help="Mooncake-format JSONL trace")
    workload.add_argument(
        "--shared-prefix",
        type=_shape,
        default=None,
        metavar="G,P,S,Q,O",
        help="G groups of P questions: S system tokens, Q question tokens, O output tokens "
        f"(--sim-fleet default: {','.join(map(str, FLEET_WORKLOAD))})",
    )
    workload.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=None,
        help="generated (bench.workloads): multi-tenant agent sessions (agent; agent-zipf: Zipf tenants; "
        "agent-tools: long tool results; agent-think: long think times), grouped shared prefixes, or long "
        "prompts with long answers (longmix)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="requests/s, Poisson (with --trace: instead of its times; "
        f"--sim-fleet default: {FLEET_RATE:g}; grouped default: {GroupedParams().rate:g})",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help=f"seconds of sending (--sim-fleet default: {FLEET_DURATION_S:g}); agent workloads: the "
        "window sessions start in, each then running to its end (default: the workload's, agent "
        f"{AgentParams().start_window_s:g}); grouped: all prompts when absent",
    )
    parser.add_argument(
        "--sessions",
        type=int,
        default=None,
        help=f"agent workloads' sessions (the workload's: agent {AgentParams().sessions})",
    )
    parser.add_argument("--json", default=None, help="write the summary here, and a PNG next to it")
    parser.add_argument(
        "--text",
        action="store_true",
        help="send prompts as text, one made-up word per token id (bench.token_text), for servers that "
        "tokenize; --sim-fleet: with --sim-unit words, and a gateway tokenizing with SmolLM2's tokenizer",
    )
    parser.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    parser.add_argument("--api-key", default=None, help="default: $PREFIXGATE_API_KEY or 'none'")
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="time compression of a trace or generated workload (2 = twice as fast)",
    )
    parser.add_argument("--limit", type=int, default=None, help="send at most N requests (sessions)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency-limit", type=int, default=512, help="most requests in flight")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request, and to drain")
    parser.add_argument("--vocab-size", type=int, default=32000, help="trace token ids are drawn below this")
    parser.add_argument("--max-prompt-tokens", type=int, default=4000, help="cut trace prompts to this")
    fleet = parser.add_argument_group("--sim-fleet: simulated workers started for the run")
    fleet.add_argument(
        "--policies", type=_policies, default=FLEET_POLICIES, help="comma-separated, one gateway each"
    )
    fleet.add_argument(
        "--modes",
        type=parse_modes,
        default=None,
        help="for the policies that read the index, a row each: precise, approx (no capacity told), "
        "approx:F (F x the workers' pool), text; each may end in @N, the gateway's "
        "limits.prefill_depth; default: approx:0.25,approx:1,approx:16,approx,precise "
        "(with --sim-unit, all but precise)",
    )
    fleet.add_argument(
        "--sim-unit",
        choices=SIM_UNITS,
        default=None,
        help="workers counting in their own unit, declared to the gateway as foreign (kind: openai) in "
        "every row: words (one token per word of the --text prompts, which the gateway reads with "
        f"SmolLM2's tokenizer) or blocks64 (the gateway's tokens, in KV blocks of {BLOCKS64})",
    )
    fleet.add_argument(
        "--peers",
        type=parse_peers,
        default=(),
        help="peer routers, a row each over fresh workers (bench.peers, installed from PyPI on first use): "
        f"{', '.join(PEER_ROWS)}, or a router's name for all those rows of it (sglang, vllm-router); "
        f"tuned, named in full: {', '.join(PEER_VARIANTS)}; "
        "comma-separated; sglang reads text prompts only (--text --sim-unit words)",
    )
    fleet.add_argument(
        "--parallel",
        type=int,
        default=FLEET_PARALLEL,
        help="rows run at once, each on its own workers and gateway (the CPU they need is small)",
    )
    fleet.add_argument("--sim-profile", default=FLEET_PROFILE, help="the workers' profile")
    fleet.add_argument(
        "--prefix-aware",
        type=prefix_aware_knob,
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a prefix_aware knob for every gateway row (e.g. recompute_penalty=2), repeatable",
    )
    fleet.add_argument("--block-size", type=int, default=FLEET_BLOCK_SIZE, help="the workers' KV block size")
    fleet.add_argument(
        "--num-blocks",
        type=int,
        default=FLEET_NUM_BLOCKS,
        help="KV blocks per worker (the cache that matters)",
    )


def _sessions(args: argparse.Namespace) -> tuple[str, list[Session], dict[str, Any]]:
    """The workload's name, its sessions and its parameters, a pure function of the flags and seed."""
    if args.shared_prefix is not None:
        if args.rate is None:
            raise SystemExit("prefixgate bench replay: --shared-prefix needs --rate")
        prompts = shared_prefix_workload(*args.shared_prefix, seed=args.seed)
        arrivals = shared_prefix_arrivals(prompts, args.rate, args.duration, args.seed)
        name = "shared-prefix " + ",".join(map(str, args.shared_prefix))
        return name, arrival_sessions(arrivals[: args.limit]), {}
    if args.workload is not None:
        sessions, params = generated_sessions(args)
        return args.workload, sessions, params
    trace = load_trace(args.trace, speed=args.speed, limit=args.limit)
    arrivals = trace_arrivals(
        trace,
        args.duration,
        rate=args.rate,
        seed=args.seed,
        vocab_size=args.vocab_size,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    return f"trace {Path(args.trace).name}", arrival_sessions(arrivals[: args.limit]), {}


def fill_fleet_defaults(args: argparse.Namespace) -> None:
    """--sim-fleet alone runs the comparison the defaults were chosen for; a URL needs its workload."""
    chosen = args.trace is not None or args.shared_prefix is not None or args.workload is not None
    if args.sim_fleet is not None and not chosen:
        args.shared_prefix = FLEET_WORKLOAD
        args.rate = FLEET_RATE if args.rate is None else args.rate
    if args.sim_fleet is not None and args.duration is None and args.workload is None:
        args.duration = FLEET_DURATION_S
    if args.modes is None:
        args.modes = FLEET_MODES if args.sim_unit is None else tuple(m for m in FLEET_MODES if not m.precise)
    if any(m.on_text for m in args.modes) and not args.text:
        raise SystemExit("prefixgate bench replay: --modes text routes prompts sent as text: add --text")
    if not (chosen or args.shared_prefix is not None):
        raise SystemExit("prefixgate bench replay: give a workload, --trace, --shared-prefix or --workload")
    if args.duration is None and args.workload is None:
        raise SystemExit("prefixgate bench replay: --duration must be given with --trace or --shared-prefix")
    if args.duration is not None and args.duration <= 0:
        raise SystemExit("prefixgate bench replay: --duration must be positive")


def workload_pace(
    args: argparse.Namespace, name: str, params: dict[str, Any], sessions: Sequence[Session]
) -> str:
    """How the workload is paced, for the titles."""
    speed = f" at speed {args.speed:g}" if args.speed != 1 else ""
    if name in AGENT_WORKLOADS:
        return f"{len(sessions)} sessions starting within {params['start_window_s']:g} s{speed}"
    if name in ("grouped", "longmix"):
        return f"{len(sessions)} prompts at {params['rate']:g} req/s{speed}"
    rate = f"{args.rate:g} req/s" if args.rate else f"its own times at speed {args.speed:g}"
    return f"{rate} for {args.duration:g} s"


def run(args: argparse.Namespace) -> dict[str, Any]:
    fill_fleet_defaults(args)
    name, sessions, params = _sessions(args)
    if args.sim_fleet is not None:
        return run_fleet(args, name, params, sessions, workload_pace(args, name, params, sessions))
    result = asyncio.run(
        replay_sessions(
            args.url,
            sessions,
            model=args.model,
            api_key=args.api_key or os.environ.get("PREFIXGATE_API_KEY", "none"),
            concurrency_limit=args.concurrency_limit,
            timeout_s=args.timeout,
            text=args.text,
        )
    )
    payload = {
        "workload": name,
        "workload_params": params,
        "rate": args.rate,
        "duration_s": args.duration,
        **result.summary(),
    }
    title = f"replay: {name}, {workload_pace(args, name, params, sessions)} against {result.url}"
    print(endpoint_tables(title, payload))
    if args.json:
        write_json(args.json, payload)
        bar_panels(Path(args.json).with_suffix(".png"), title, endpoint_panels(payload))
    return payload
