"""`bench fleet --pd`: splits of one fleet's GPUs into prefill and decode replicas (bench.pd_fleet), side by
side on one workload, as a table, JSON and a plot, with the closing comparison of the best split
against the all-mixed one.

Goodput (TTFT and mean-ITL targets, DistServe's) ranks the splits; stall-free goodput (TTFT and the
worst single gap, bench.latency) is reported beside it, because it is where a mixed replica's long
prefills show in each stream and a mean-ITL target does not see them."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.latency import Slo
from bench.parallel import run_jobs
from bench.pd_fleet import PdResult, parse_splits, simulate_pd
from bench.report import bar_panels, format_table, write_json
from bench.workloads import Session, total_turns
from workers.sim.profiles import Profile

HEADER = [
    "split",
    "TTFT mean s",
    "TTFT p99 s",
    "ITL mean ms",
    "ITL p99 ms",
    "req ITL mean ms",
    "goodput",
    "goodput req/s",
    "stall-free",
    "stall-free req/s",
    "transfer/TTFT",
    "room wait/TTFT",
    "GB moved",
    "transfers",
    "no room",
]


def best(results: Sequence[PdResult]) -> PdResult:
    """The split serving the most requests within both targets; the lower ITL p99 among equals."""
    return max(results, key=lambda r: (r.summary.goodput_share, -r.summary.itl_p99_s))


def verdict(results: Sequence[PdResult]) -> str:
    """The closing note: the best split, and its gain over the mixed fleet when one was run."""
    top = best(results)
    note = f"best split: {top.split.name}"
    mixed = next((r for r in results if r.split.mixed), None)
    if mixed is None or top is mixed:
        return note
    itl = mixed.summary.itl_p99_s / top.summary.itl_p99_s if top.summary.itl_p99_s else float("inf")
    good = _gain(top.summary.goodput_share, mixed.summary.goodput_share)
    smooth = _gain(top.summary.stall_free_share, mixed.summary.stall_free_share)
    return (
        f"{note}: ITL p99 {itl:.2f}x lower, goodput {good} and stall-free goodput {smooth} "
        f"against {mixed.split.name}"
    )


def _gain(share: float, baseline: float) -> str:
    return f"{share / baseline:.2f}x" if baseline else "from none"


def row(result: PdResult) -> list[Any]:
    s = result.summary
    return [
        result.split.name,
        s.ttft_mean_s,
        s.ttft_p99_s,
        1e3 * s.itl_mean_s,
        1e3 * s.itl_p99_s,
        1e3 * s.request_itl_mean_s,
        s.goodput_share,
        s.goodput_rps,
        s.stall_free_share,
        s.stall_free_rps,
        s.transfer_share,
        s.reserve_wait_share,
        s.transferred_gb,
        result.routes.get("transfer", 0),
        result.routes.get("no_room", 0),
    ]


def run(
    args: argparse.Namespace, profile: Profile, workload: str, sessions: list[Session], params: dict[str, Any]
) -> dict[str, Any]:
    splits = parse_splits(args.pd)
    slo = Slo(args.slo_ttft, args.slo_itl, args.slo_stall)
    requests = total_turns(sessions)
    jobs = [
        functools.partial(simulate_pd, sessions, profile, split, slo, args.reserve_wait) for split in splits
    ]
    results: list[PdResult] = run_jobs(jobs, requests * len(jobs), args.workers)
    link = profile.link.bytes_per_s / 1e9
    rate = f" at {params['rate']:g}/s" if "rate" in params else ""
    title = (
        f"PD fleet simulation: {workload}, {requests} requests{rate}, {profile.name} "
        f"({profile.num_blocks} blocks of {profile.block_size}, {profile.max_num_batched_tokens} tokens a "
        f"step, link {link:g} GB/s), speed {args.speed:g}, "
        f"room wait <= {args.reserve_wait:g} s; goodput: TTFT <= {slo.ttft_s:g} s and mean ITL <= "
        f"{1e3 * slo.itl_s:g} ms; stall-free: TTFT <= {slo.ttft_s:g} s and every gap <= "
        f"{1e3 * slo.stall_s:g} ms"
    )
    print(format_table(title, HEADER, [row(r) for r in results]))
    note = verdict(results)
    print(note)
    payload = {
        "workload": workload,
        "workload_params": params,
        "trace": args.trace,
        "requests": requests,
        "profile": profile.name,
        "block_size": profile.block_size,
        "num_blocks": profile.num_blocks,
        "max_num_batched_tokens": profile.max_num_batched_tokens,
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "link": {"bytes_per_s": profile.link.bytes_per_s, "latency_s": profile.link.latency_s},
        "speed": args.speed,
        "seed": args.seed,
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s, "stall_s": slo.stall_s},
        "reserve_wait_s": args.reserve_wait,
        "splits": {r.split.name: {**r.summary.as_dict(), "routes": r.routes} for r in results},
        "best": best(results).split.name,
        "verdict": note,
    }
    if args.json:
        write_json(args.json, payload)
        bar_panels(
            Path(args.json).with_suffix(".png"),
            title.split(";")[0],
            [
                ("ITL p99 (ms)", {r.split.name: 1e3 * r.summary.itl_p99_s for r in results}),
                ("goodput (req/s)", {r.split.name: r.summary.goodput_rps for r in results}),
                ("goodput (share)", {r.split.name: r.summary.goodput_share for r in results}),
                ("stall-free goodput (share)", {r.split.name: r.summary.stall_free_share for r in results}),
                ("TTFT p99 (s)", {r.split.name: r.summary.ttft_p99_s for r in results}),
            ],
            reference={
                0: ("stall target", 1e3 * slo.stall_s),
                2: ("all requests", 1.0),
                3: ("all requests", 1.0),
                4: ("TTFT target", slo.ttft_s),
            },
        )
    return payload
