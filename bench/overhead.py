"""`prefixgate bench overhead`: what the gateway adds to a request, and how many requests one gateway
process carries, both measured side by side in one run against the same simulated worker.

Three processes: this one (the load generator), one simulated worker and one gateway in front of it
(policy prefix_aware, embedded KV sync), each with its own interpreter lock. The worker's profile is
h100-8b's pool and batch limits with every cost set to zero ("instant"): the time a request spends
in it is then only its software (HTTP, JSON, scheduler, block manager, KV events), so the gateway's
share is not buried under a GPU's modelled seconds, and a 2,000-token prompt at 200 req/s does not
overload a replica the way it would at H100 prefill speed.

Added latency: one Poisson schedule, cut into short windows; each window is sent to the worker
directly and through the gateway, one after the other, in ABBA order (direct first in even windows,
gateway first in odd ones), so that a shared, noisy machine's slow seconds fall on both alike. Every
request has a prompt of its own (no two share a first block, so by the chained hash nothing is
cached for anyone: the gateway hashes, matches and ingests the KV events of fresh prompts, its
worst case), drawn alike for both paths.

Capacity: closed loops of short requests at rising concurrency, direct and through the gateway. On a
small machine the three processes share the cores and the highest rate is the machine's, so each
process's CPU seconds per request (/proc/PID/stat) are reported beside it: the gateway's is its cost
per request, and its inverse the rate one core would carry.

This module is the command, its tables and its plot; bench.overhead_phases takes the measurements.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

from bench.local_fleet import LocalFleet, SimWorkers, local_fleet
from bench.overhead_phases import (
    BASE_PROFILE,
    SHORT_PROMPT_TOKENS,
    TARGETS,
    capacity_phase,
    instant_profile,
    latency_phase,
    sustained,
)
from bench.procfs import proc_stat
from bench.report import bar_panels, format_table, write_json

# The bar the issue sets for the gateway's added latency.
BAR_P50_S, BAR_P99_S = 1e-3, 5e-3
MS = 1e3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, default=200.0, help="requests/s of the latency phase (Poisson)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of schedule, sent to each path")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="tokens per prompt, each prompt new")
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    parser.add_argument("--window", type=float, default=1.0, help="seconds per direct/gateway window")
    parser.add_argument("--block-size", type=int, default=16, help="the worker's KV block size")
    parser.add_argument("--max-duration", type=float, default=4.0, help="seconds per capacity step")
    parser.add_argument("--skip-max", action="store_true", help="skip the capacity (max req/s) phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--pin-gateway",
        action="store_true",
        help="give the gateway a core of its own (the worker and the load share the rest): its added "
        "latency without the other processes' contention for its core",
    )
    parser.add_argument("--json", default=None, help="write the results here, and a PNG next to it")


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of a process onto `cpus` (sched_setaffinity binds one thread; threads started
    later inherit their creator's set)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cpus)


def pinning(fleet: LocalFleet) -> dict[str, list[int]]:
    """The gateway on the last core this process may use, the worker and this process on the others."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("prefixgate bench overhead: --pin-gateway needs at least 2 cores")
    assert fleet.gateway is not None
    gateway, rest = {cpus[-1]}, set(cpus[:-1])
    pin(fleet.gateway.pid, gateway)
    pin(fleet.workers[0].pid, rest)
    pin(os.getpid(), rest)
    return {"gateway": sorted(gateway), "worker and load": sorted(rest)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if min(args.rate, args.duration, args.window, args.max_duration) <= 0 or args.prompt_tokens < 1:
        raise SystemExit("prefixgate bench overhead: rates, durations and --prompt-tokens must be positive")
    with tempfile.TemporaryDirectory(prefix="prefixgate-overhead-") as tmp:
        workdir = Path(tmp)
        workers = SimWorkers(1, str(instant_profile(workdir)), block_size=args.block_size)
        with local_fleet(workdir, workers, policy="prefix_aware") as fleet:
            assert fleet.gateway is not None
            ours = os.sched_getaffinity(0)
            cores = pinning(fleet) if args.pin_gateway else None
            try:
                samples, decision = asyncio.run(latency_phase(fleet, args, workers.model))
                capacity = [] if args.skip_max else asyncio.run(capacity_phase(fleet, args, workers.model))
            finally:
                pin(os.getpid(), ours)
            processes = {"worker": fleet.workers[0], "gateway": fleet.gateway}
            memory = {name: dataclasses.asdict(proc_stat(c.pid)) for name, c in processes.items()}
            urls = {"direct": fleet.workers[0].url, "gateway": fleet.gateway.url}
    latency = {t: samples[t].summary(urls[t]) for t in TARGETS}
    added = {
        f"{measure}_{p}": latency["gateway"][key][p] - latency["direct"][key][p]
        for measure, key in (("ttft", "ttft_s"), ("e2e", "e2e_s"))
        for p in ("p50", "p99")
        if latency["gateway"][key][p] is not None and latency["direct"][key][p] is not None
    }
    payload: dict[str, Any] = {
        "config": {
            "rate": args.rate,
            "duration_s": args.duration,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "window_s": args.window,
            "block_size": args.block_size,
            "worker_profile": f"{BASE_PROFILE}-instant",
            "prompts": "distinct (no two share a block)",
            "order": "ABBA windows (direct, gateway, gateway, direct, ...)",
            "policy": "prefix_aware",
            "cores": cores or f"{len(os.sched_getaffinity(0))} shared by all three processes",
        },
        "latency": latency,
        "added_s": added,
        "bar": {
            "p50_s": BAR_P50_S,
            "p99_s": BAR_P99_S,
            "met": bool(added)
            and max(added["ttft_p50"], added["e2e_p50"]) <= BAR_P50_S
            and max(added["ttft_p99"], added["e2e_p99"]) <= BAR_P99_S,
        },
        "routing_decision_s": decision,
        "process": memory,
        "capacity": {
            "steps": capacity,
            "sustained_req_s": {t: sustained(capacity, t) for t in TARGETS} if capacity else {},
        },
    }
    title = (
        f"overhead: {args.prompt_tokens}-token prompts, {args.max_tokens} output tokens, "
        f"{args.rate:g} req/s for {args.duration:g} s per path"
        + (", the gateway on a core of its own" if cores else "")
    )
    print(_tables(title, payload))
    if args.json:
        write_json(args.json, payload)
        bar_panels(Path(args.json).with_suffix(".png"), title, *_panels(payload))
    return payload


def _ms(value: float | None) -> float | str:
    return "-" if value is None else value * MS


def _tables(title: str, p: dict[str, Any]) -> str:
    latency, added = p["latency"], p["added_s"]
    stats = ("p50", "p90", "p99")
    rows = [
        [
            name,
            *(_ms(latency[t][key][s]) for t in TARGETS for s in stats),
            _ms(added.get(f"{short}_p50")),
            _ms(added.get(f"{short}_p99")),
        ]
        for name, key, short in (("TTFT", "ttft_s", "ttft"), ("E2E", "e2e_s", "e2e"))
    ]
    header = ["ms", *(f"{t} {s}" for t in TARGETS for s in stats), "added p50", "added p99"]
    totals = [
        [
            t,
            latency[t]["sent"],
            latency[t]["completed"],
            ", ".join(f"{k}={v}" for k, v in latency[t]["errors"].items()) or "0",
            *(latency[t]["cpu_s_per_request"][k] * MS for k in ("gateway", "worker", "loadgen")),
        ]
        for t in TARGETS
    ]
    decision = p["routing_decision_s"]
    cost = [
        [
            int(decision["count"]),
            _ms(decision["p50"]),
            _ms(decision["p99"]),
            p["process"]["gateway"]["rss_bytes"] / 2**20,
            p["process"]["gateway"]["peak_rss_bytes"] / 2**20,
            p["process"]["worker"]["peak_rss_bytes"] / 2**20,
        ]
    ]
    bar = p["bar"]
    verdict = (
        f"bar (added p50 <= {bar['p50_s'] * MS:g} ms, p99 <= {bar['p99_s'] * MS:g} ms): "
        f"{'met' if bar['met'] else 'NOT met'}"
    )
    tables = [
        format_table(title, header, rows),
        format_table(
            "requests (CPU ms per request: each process's CPU over that path's windows)",
            ["path", "sent", "completed", "errors", "gateway CPU ms", "worker CPU ms", "loadgen CPU ms"],
            totals,
        ),
        format_table(
            "gateway cost",
            ["decisions", "decision p50 ms", "decision p99 ms", "RSS MiB", "peak RSS MiB", "worker peak MiB"],
            cost,
        ),
    ]
    steps = p["capacity"]["steps"]
    if steps:
        capacity = [
            [
                s["target"],
                s["concurrency"],
                s["req_s"],
                s["error_rate"],
                _ms(s["e2e_s"]["p50"]),
                _ms(s["e2e_s"]["p99"]),
                *(s["cpu_s_per_request"][k] * MS for k in ("gateway", "worker", "loadgen")),
                s["busy_cores"],
            ]
            for s in steps
        ]
        tables.append(
            format_table(
                f"capacity: closed loops of {SHORT_PROMPT_TOKENS}-token prompts, 1 output token; cores: "
                f"{p['config']['cores']}",
                [
                    "path",
                    "clients",
                    "req/s",
                    "error rate",
                    "E2E p50 ms",
                    "E2E p99 ms",
                    "gateway CPU ms",
                    "worker CPU ms",
                    "loadgen CPU ms",
                    "busy cores",
                ],
                capacity,
            )
        )
        best = p["capacity"]["sustained_req_s"]
        verdict += "; sustained (< 1% errors): " + ", ".join(
            f"{t} {'-' if best[t] is None else f'{best[t]:.0f}'} req/s" for t in TARGETS
        )
    return "\n\n".join([*tables, verdict])


def _panels(p: dict[str, Any]) -> tuple[list[tuple[str, dict[str, float]]], dict[int, tuple[str, float]]]:
    added = p["added_s"]
    latency = p["latency"]
    panels: list[tuple[str, dict[str, float]]] = [
        ("added p50 ms", {m: added[f"{m}_p50"] * MS for m in ("ttft", "e2e") if f"{m}_p50" in added}),
        ("added p99 ms", {m: added[f"{m}_p99"] * MS for m in ("ttft", "e2e") if f"{m}_p99" in added}),
        (
            "TTFT ms",
            {
                f"{t} {s}": latency[t]["ttft_s"][s] * MS
                for t in TARGETS
                for s in ("p50", "p99")
                if latency[t]["ttft_s"][s] is not None
            },
        ),
    ]
    reference = {0: ("bar 1 ms", BAR_P50_S * MS), 1: ("bar 5 ms", BAR_P99_S * MS)}
    best = p["capacity"]["sustained_req_s"]
    if best:
        panels.append(("sustained req/s", {t: v for t, v in best.items() if v is not None}))
        steps = [s for s in p["capacity"]["steps"] if s["target"] == "gateway"]
        if steps:
            cpu = max(steps, key=lambda s: s["req_s"])["cpu_s_per_request"]
            panels.append(("CPU ms per request", {k: v * MS for k, v in cpu.items()}))
    return panels, reference
