"""`prefixgate bench fleet`: the discrete-event fleet simulator (bench.fleet_sim), a workload replayed
through the gateway's real index and policies onto simulated replicas that run the real scheduler and
block manager under a cost model, per policy and mode (bench.fleet_jobs), with its table and plot.

With `--pd`, the same workload runs on splits of the fleet into prefill and decode replicas instead
(bench.pd_fleet, bench.pd_bench); with `--ep`, an MoE model on the same GPUs in replicas of each
expert-parallel group size (bench.fleet_ep).

This module is the command: its flags, the profile and workload they choose, and the table, JSON and
plot; the simulator is bench.fleet_sim's, the jobs it runs bench.fleet_jobs'.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import fleet_ep, pd_bench
from bench.fleet_jobs import jobs_of, parse_capacity_prior
from bench.fleet_result import FleetResult
from bench.fleet_sim import MODES, pooled_hit_rate, simulate
from bench.latency import Slo
from bench.parallel import run_jobs
from bench.pd_fleet import DEFAULT_RESERVE_WAIT_S
from bench.report import bar_panels, format_table, write_json
from bench.shared_flags import WORKLOADS, generated_sessions, prefix_aware_knob
from bench.trace import load_trace, trace_sessions
from bench.units import UNITS, unit_of
from bench.workloads import AgentParams, GroupedParams, LongMixParams, Session, total_turns
from policies import POLICY_NAMES, RoutingConfig
from policies.routing_config import parse_routing
from workers.sim.moe_routing import Gate
from workers.sim.profiles import Profile, get_profile


def fleet_profile(
    name: str, block_size: int | None, num_blocks: int | None, max_batched_tokens: int | None = None
) -> Profile:
    """The named profile, with its block size, pool and step token budget overridden where given (a
    pool smaller than an H100's is what puts a small workload's caches under pressure; a smaller
    budget is chunked prefill's lever against the stalls a long prompt's chunk causes in the decodes
    that share its step)."""
    profile = get_profile(name)
    if block_size is not None:
        profile = replace(profile, block_size=block_size)
    if num_blocks is not None:
        profile = replace(profile, kv_capacity_tokens=num_blocks * profile.block_size)
    if max_batched_tokens is not None:
        profile = replace(profile, max_num_batched_tokens=max_batched_tokens)
    return profile


def workload_of(args: argparse.Namespace, profile: Profile) -> tuple[str, list[Session], dict[str, Any]]:
    """The workload's name, sessions and parameters (none for a trace), a pure function of the flags."""
    if args.trace is not None:
        trace = load_trace(args.trace, speed=args.speed, limit=args.limit)
        return Path(args.trace).name, trace_sessions(trace, profile.vocab_size), {}
    return args.workload, *generated_sessions(args)


def run(args: argparse.Namespace) -> dict:
    if args.seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
    if args.seeds > 1 and (args.ep is not None or args.pd or args.trace is not None):
        raise ValueError("--seeds varies a generated workload under --policies; not a trace, --pd or --ep")
    if args.ep is not None:
        return run_ep(args)
    profile = fleet_profile(args.profile, args.block_size, args.num_blocks, args.max_batched_tokens)
    if args.link_gbytes is not None:
        profile = replace(profile, link=replace(profile.link, bytes_per_s=args.link_gbytes * 1e9))
    workload, sessions, params = workload_of(args, profile)
    if args.pd:
        return pd_bench.run(args, profile, workload, sessions, params)
    seeds = list(range(args.seed, args.seed + args.seeds))
    workloads = [
        sessions,
        *(workload_of(argparse.Namespace(**{**vars(args), "seed": s}), profile)[1] for s in seeds[1:]),
    ]
    requests = total_turns(sessions)
    unit = unit_of(args.replica_unit)
    jobs = jobs_of(args.policies or list(POLICY_NAMES), args.modes, args.capacity_priors, unit.foreign)
    overrides = dict(args.prefix_aware or ())
    calls = [
        functools.partial(
            simulate,
            w,
            parse_routing({"policy": job.policy, "prefix_aware": overrides}),
            profile,
            args.replicas,
            job.mode,
            capacity_scale=job.capacity_scale,
            unit=unit,
        )
        for job in jobs
        for w in workloads
    ]
    total = sum(total_turns(w) for w in workloads) * len(jobs)
    runs = run_jobs(calls, total, args.workers)
    outcomes = {
        job: FleetResult.mean(runs[i * len(seeds) : (i + 1) * len(seeds)]) for i, job in enumerate(jobs)
    }
    results: dict[str, dict[str, float]] = {}
    rows = []
    for job, result in outcomes.items():
        results[job.key] = result.summary()
        rows.append(
            [
                job.key,
                result.hit_rate,
                result.ttft_mean_s,
                result.ttft_p50_s,
                result.ttft_p99_s,
                result.throughput_tok_s,
                result.imbalance,
                result.moved_turns,
            ]
        )
    pooled = statistics.fmean(pooled_hit_rate(w, profile, args.replicas) for w in workloads)
    rows.append(["pooled bound", pooled, "", "", "", "", "", ""])
    title = (
        f"fleet simulation: {workload}, {requests} requests, {args.replicas} x {profile.name} "
        f"({profile.num_blocks} blocks of {profile.block_size}), speed {args.speed:g}"
    )
    if unit.foreign:
        title += f", replicas counting in {unit.name}"
    if overrides:
        title += ", prefix_aware " + " ".join(f"{k}={v}" for k, v in overrides.items())
    if len(seeds) > 1:
        title += f", means of seeds {seeds[0]}-{seeds[-1]}"

    print(
        format_table(
            title,
            ["policy", "hit rate", "TTFT mean s", "p50 s", "p99 s", "out tok/s", "imbalance", "moved turns"],
            rows,
        )
    )
    payload = {
        "workload": workload,
        "workload_params": params,
        "trace": args.trace,
        "requests": requests,
        "replicas": args.replicas,
        "profile": profile.name,
        "block_size": profile.block_size,
        "num_blocks": profile.num_blocks,
        "speed": args.speed,
        "seed": args.seed,
        "seeds": seeds,
        "replica_unit": unit.name,
        "prefix_aware": overrides,
        "policies": results,
        "pooled_bound": {"hit_rate": pooled},
    }
    if args.json:
        write_json(args.json, payload)
        bar_panels(
            Path(args.json).with_suffix(".png"),
            title,
            [
                ("hit rate", {n: p["hit_rate"] for n, p in results.items()}),
                ("TTFT mean (s)", {n: p["ttft_mean_s"] for n, p in results.items()}),
                ("TTFT p50 (s)", {n: p["ttft_p50_s"] for n, p in results.items()}),
                ("TTFT p99 (s)", {n: p["ttft_p99_s"] for n, p in results.items()}),
                ("imbalance (max/mean)", {n: p["imbalance"] for n, p in results.items()}),
            ],
            reference={0: ("pooled bound", pooled), 4: ("balanced", 1.0)},
        )
    return payload


def run_ep(args: argparse.Namespace) -> dict:
    """`--ep`: the MoE profile in replicas of each group size on `--gpus` GPUs, under one policy."""
    if args.num_blocks is not None or args.max_batched_tokens is not None:
        raise ValueError("--ep sizes each layout's KV pool and step budget from its GPUs")
    policies = args.policies or ["prefix_aware"]
    if len(policies) > 1:
        raise ValueError(f"--ep compares layouts under one policy, got {' '.join(policies)}")
    groups = fleet_ep.parse_groups(args.ep)
    chosen = fleet_ep.layouts(args.profile, groups, args.gpus, Gate(args.gate_zipf), args.block_size)
    workload, sessions, params = workload_of(args, chosen[0].profile)
    requests = total_turns(sessions)
    routing = RoutingConfig(policy=policies[0])
    calls = [functools.partial(simulate, sessions, routing, c.profile, c.replicas) for c in chosen]
    results = run_jobs(calls, requests * len(calls), args.workers)
    return fleet_ep.report(args, chosen, results, workload, params, requests, policies[0])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", default=None, help="Mooncake-format JSONL trace")
    source.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=None,
        help="generated (bench.workloads): agent sessions (agent; agent-zipf: Zipf tenants; agent-tools: "
        "long tool results; agent-think: long think times), grouped prefixes, or long prompts with long "
        "answers (longmix)",
    )
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--profile", default="h100-8b", help="sim profile name or JSON path")
    parser.add_argument("--block-size", type=int, default=None, help="KV block size (default: the profile's)")
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks per replica (default: the profile's)"
    )
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="tokens per engine step, the chunked-prefill budget (default: the profile's)",
    )
    parser.add_argument("--speed", type=float, default=1.0, help="time compression (2 = twice as fast)")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests (sessions)")
    parser.add_argument(
        "--sessions",
        type=int,
        default=None,
        help=f"agent workloads' sessions (default: the workload's, agent {AgentParams().sessions}); "
        f"longmix requests (default {LongMixParams().requests})",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help=f"grouped prompts per second (default {GroupedParams().rate:g}); longmix requests per "
        f"second (default {LongMixParams().rate:g})",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="agent workloads: the window sessions start in (default: the workload's, agent "
        f"{AgentParams().start_window_s:g} s); grouped, longmix: prompts due later are left out",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the generated workloads")
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="a generated workload from N seeds (--seed and on), every measure their mean",
    )
    parser.add_argument("--policies", nargs="*", choices=POLICY_NAMES, default=None)
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--capacity-priors",
        nargs="+",
        type=parse_capacity_prior,
        default=[1.0],
        metavar="X|unset",
        help="approximate mode: each replica's configured capacity_blocks as a multiple of its true "
        "pool, or unset; the index learns the real one from the cached tokens replicas report "
        "(default 1)",
    )
    parser.add_argument(
        "--replica-unit",
        choices=UNITS,
        default="tokens",
        help="what the replicas count prompts in: the gateway's tokens, words (several tokens each), or "
        "tokens in KV blocks of 64 (bench.units); not tokens: approximate mode only",
    )
    parser.add_argument(
        "--prefix-aware",
        type=prefix_aware_knob,
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a prefix_aware knob for every run (e.g. recompute_penalty=0), repeatable",
    )
    parser.add_argument("--workers", type=int, default=None, help="processes (default: one per core)")
    parser.add_argument("--json", default=None)
    pd = parser.add_argument_group("prefill/decode disaggregation (bench.pd_fleet): --pd replaces --policies")
    pd.add_argument(
        "--pd",
        action="append",
        default=None,
        metavar="P:D[,P:D...]",
        help="splits of the GPUs into P prefill and D decode replicas (P:0: P mixed), each simulated "
        "and compared, e.g. 4:0,3:1,2:2,1:3; repeatable",
    )
    pd.add_argument("--slo-ttft", type=float, default=Slo().ttft_s, help="goodput's TTFT target, s")
    pd.add_argument("--slo-itl", type=float, default=Slo().itl_s, help="goodput's mean-ITL target, s")
    pd.add_argument(
        "--slo-stall",
        type=float,
        default=Slo().stall_s,
        help="stall-free goodput's target for a request's longest gap between tokens, s",
    )
    pd.add_argument(
        "--reserve-wait",
        type=float,
        default=DEFAULT_RESERVE_WAIT_S,
        help="how long a decode replica waits for room to receive a prompt's KV before computing the "
        "prompt itself, s (0: at once)",
    )
    pd.add_argument("--link-gbytes", type=float, default=None, help="KV link GB/s (default: the profile's)")
    ep = parser.add_argument_group(
        "expert parallelism (bench.fleet_ep): --ep replaces --replicas and --modes, and takes one policy"
    )
    ep.add_argument(
        "--ep",
        default=None,
        metavar="G[,G...]",
        help="GPUs per replica to compare for an MoE --profile (mixtral-8x7b-h100, qwen3-30b-a3b-h100) "
        "at equal GPUs, e.g. 2,4,8: each an expert-parallel group with replicated attention",
    )
    ep.add_argument("--gpus", type=int, default=8, help="GPUs of every --ep layout")
    ep.add_argument(
        "--gate-zipf",
        type=float,
        default=0.0,
        help="skew of the MoE gate: expert e weighed (e+1)^-S (0: uniform)",
    )
