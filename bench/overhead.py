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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench.local_fleet import Child, LocalFleet, SimWorkers, local_fleet
from bench.replay import (
    Arrival,
    ReplayResult,
    RequestRecord,
    closed_loop,
    poisson_times,
    replay,
    shared_prefix_workload,
)
from bench.report import bar_panels, format_table, write_json
from workers.sim.cost_model import CostModel
from workers.sim.profiles import get_profile, profile_to_json

BASE_PROFILE = "h100-8b"
# The bar the issue sets for the gateway's added latency.
BAR_P50_S, BAR_P99_S = 1e-3, 5e-3
# One window of the schedule per path before measuring: connections, first-request paths.
WARMUP_S = 1.0
# Capacity phase: short prompts (two blocks at the default block size), one output token each.
SHORT_PROMPT_TOKENS, SHORT_PROMPTS = 32, 512
CONCURRENCY = (8, 32, 128)
MAX_ERROR_RATE = 0.01
DECISION_METRIC = "prefixgate_gateway_routing_decision_seconds"
TARGETS = ("direct", "gateway")
MS = 1e3


# -- process accounting ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcStat:
    cpu_s: float  # user + system, all threads
    rss_bytes: int
    peak_rss_bytes: int


def proc_stat(pid: int) -> ProcStat:
    """CPU seconds and memory of a process, from /proc (Linux)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 onward
    ticks = os.sysconf("SC_CLK_TCK")
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    kib = 1024
    return ProcStat(
        cpu_s=(int(fields[11]) + int(fields[12])) / ticks,
        rss_bytes=int(status["VmRSS"].split()[0]) * kib,
        peak_rss_bytes=int(status["VmHWM"].split()[0]) * kib,
    )


def own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


@dataclass(slots=True)
class CpuMeter:
    """CPU seconds the worker, the gateway and this process (the load generator) use inside `with`."""

    fleet: LocalFleet
    start: dict[str, float] = dataclasses.field(default_factory=dict)
    used: dict[str, float] = dataclasses.field(default_factory=dict)

    def _now(self) -> dict[str, float]:
        assert self.fleet.gateway is not None
        return {
            "worker": proc_stat(self.fleet.workers[0].pid).cpu_s,
            "gateway": proc_stat(self.fleet.gateway.pid).cpu_s,
            "loadgen": own_cpu_s(),
        }

    def __enter__(self) -> CpuMeter:
        self.start = self._now()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._now()
        self.used = {k: end[k] - self.start[k] for k in end}


# -- the routing decision histogram ------------------------------------------------------------------


def decision_histogram(gateway: Child) -> dict[float, float]:
    """The gateway's cumulative routing-decision buckets (upper bound -> count), +Inf included."""
    text = httpx.get(f"{gateway.url}/metrics", timeout=5).text
    buckets: Counter[float] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name == DECISION_METRIC:
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    buckets[float(sample.labels["le"])] += sample.value
    return dict(buckets)


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's histogram_quantile: linear within the bucket the q-th observation falls in."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] == 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def decision_stats(before: dict[float, float], after: dict[float, float]) -> dict[str, float | None]:
    delta = {b: after[b] - before.get(b, 0.0) for b in after}
    return {
        "count": max(delta.values(), default=0.0),
        "p50": histogram_quantile(0.5, delta),
        "p99": histogram_quantile(0.99, delta),
    }


# -- the two phases ----------------------------------------------------------------------------------


def instant_profile(workdir: Path) -> Path:
    """h100-8b's limits and pool with a zero cost model, as a profile file the worker CLI loads."""
    base = get_profile(BASE_PROFILE)
    profile = dataclasses.replace(
        base,
        name=f"{BASE_PROFILE}-instant",
        cost=CostModel(0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
        source=f"{BASE_PROFILE} with every cost zero: the worker's time is its software alone",
    )
    path = workdir / "instant-profile.json"
    write_json(path, profile_to_json(profile))
    return path


@dataclass(slots=True)
class Sample:
    """What one path got over the windows: its requests, its errors, and the CPU it cost."""

    sent: int = 0
    elapsed_s: float = 0.0
    records: list[RequestRecord] = dataclasses.field(default_factory=list)
    errors: Counter[str] = dataclasses.field(default_factory=Counter)
    cpu_s: Counter[str] = dataclasses.field(default_factory=Counter)

    def add(self, result: ReplayResult, cpu: dict[str, float]) -> None:
        self.sent += result.sent
        self.elapsed_s += result.elapsed_s
        self.records += result.records
        self.errors += result.errors
        self.cpu_s.update(cpu)

    def summary(self, url: str) -> dict[str, Any]:
        summary = ReplayResult(url, self.sent, self.elapsed_s, self.records, self.errors).summary()
        n = max(len(self.records), 1)
        return {**summary, "cpu_s_per_request": {k: v / n for k, v in sorted(self.cpu_s.items())}}


def _windows(times: Sequence[float], window_s: float, duration_s: float) -> list[list[int]]:
    """The indices of the send times falling in each window of the schedule."""
    count = max(math.ceil(duration_s / window_s), 1)
    windows: list[list[int]] = [[] for _ in range(count)]
    for i, t in enumerate(times):
        windows[min(int(t // window_s), count - 1)].append(i)
    return windows


async def latency_phase(
    fleet: LocalFleet, args: argparse.Namespace, model: str
) -> tuple[dict[str, Sample], dict[str, float | None]]:
    """Each window of one schedule to both paths, in ABBA order; the routing-decision histogram's
    change over the measured windows alone."""
    assert fleet.gateway is not None
    urls = {"direct": fleet.workers[0].url, "gateway": fleet.gateway.url}
    times = poisson_times(args.rate, args.duration, np.random.default_rng(args.seed))
    prompts = {
        target: shared_prefix_workload(1, len(times), 0, args.prompt_tokens, args.max_tokens, args.seed + k)
        for k, target in enumerate(TARGETS, start=1)
    }
    warm = shared_prefix_workload(1, max(int(args.rate * WARMUP_S), 1), 0, args.prompt_tokens, 1, args.seed)
    for target in TARGETS:
        warmup = [Arrival(i / args.rate, p) for i, p in enumerate(warm)]
        await replay(urls[target], warmup, model=model, progress=False)
    before = await asyncio.to_thread(decision_histogram, fleet.gateway)
    samples = {target: Sample() for target in TARGETS}
    windows = _windows(times, args.window, args.duration)
    for k, indices in enumerate(tqdm(windows, desc="added latency", unit="window")):
        offset = k * args.window
        for target in TARGETS if k % 2 == 0 else TARGETS[::-1]:
            arrivals = [Arrival(times[i] - offset, prompts[target][i]) for i in indices]
            with CpuMeter(fleet) as meter:
                result = await replay(urls[target], arrivals, model=model, progress=False)
            samples[target].add(result, meter.used)
    after = await asyncio.to_thread(decision_histogram, fleet.gateway)
    return samples, decision_stats(before, after)


async def capacity_phase(fleet: LocalFleet, args: argparse.Namespace, model: str) -> list[dict[str, Any]]:
    """Closed loops of short requests at each concurrency, direct then through the gateway."""
    assert fleet.gateway is not None
    urls = {"direct": fleet.workers[0].url, "gateway": fleet.gateway.url}
    prompts = shared_prefix_workload(
        1, SHORT_PROMPTS, 0, SHORT_PROMPT_TOKENS, 1, args.seed + len(TARGETS) + 1
    )
    rows = []
    steps = [(c, t) for c in CONCURRENCY for t in TARGETS]
    for concurrency, target in tqdm(steps, desc="capacity", unit="step"):
        with CpuMeter(fleet) as meter:
            result = await closed_loop(
                urls[target], prompts, concurrency=concurrency, duration_s=args.max_duration, model=model
            )
        n = max(result.completed, 1)
        errors = result.errors.total()
        rows.append(
            {
                "target": target,
                "concurrency": concurrency,
                "sent": result.sent,
                "completed": result.completed,
                "errors": dict(sorted(result.errors.items())),
                "error_rate": errors / max(result.sent, 1),
                "req_s": result.completed / max(result.elapsed_s, 1e-9),
                "e2e_s": result.summary()["e2e_s"],
                "cpu_s_per_request": {k: v / n for k, v in sorted(meter.used.items())},
                # Cores the three processes kept busy: near the machine's count, the machine is the limit.
                "busy_cores": sum(meter.used.values()) / max(result.elapsed_s, 1e-9),
            }
        )
    return rows


def sustained(rows: Sequence[dict[str, Any]], target: str) -> float | None:
    """The highest rate a path carried with fewer than 1% errors."""
    rates = [r["req_s"] for r in rows if r["target"] == target and r["error_rate"] < MAX_ERROR_RATE]
    return max(rates, default=None)


# -- command line ------------------------------------------------------------------------------------


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
