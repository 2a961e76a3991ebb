"""The two measurements of `bench overhead` (bench.overhead is the command and its report): the added
latency, one Poisson schedule sent in ABBA windows directly to the worker and through the gateway, and
the capacity, closed loops at rising concurrency; with the CPU each process spends meanwhile and the
gateway's own routing-decision histogram."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench.arrivals import Arrival, poisson_times, shared_prefix_workload
from bench.loadgen import closed_loop, replay
from bench.local_fleet import Child, LocalFleet
from bench.procfs import cpu_s, own_cpu_s
from bench.replay_result import ReplayResult, RequestRecord
from bench.report import write_json
from workers.sim.cost_model import CostModel
from workers.sim.profiles import get_profile, profile_to_json

BASE_PROFILE = "h100-8b"
# One window of the schedule per path before measuring: connections, first-request paths.
WARMUP_S = 1.0
# Capacity phase: short prompts (two blocks at the default block size), one output token each.
SHORT_PROMPT_TOKENS, SHORT_PROMPTS = 32, 512
CONCURRENCY = (8, 32, 128)
MAX_ERROR_RATE = 0.01
DECISION_METRIC = "prefixgate_gateway_routing_decision_seconds"
TARGETS = ("direct", "gateway")


# -- CPU accounting ----------------------------------------------------------------------------------


@dataclass(slots=True)
class CpuMeter:
    """CPU seconds the worker, the gateway and this process (the load generator) use inside `with`."""

    fleet: LocalFleet
    start: dict[str, float] = dataclasses.field(default_factory=dict)
    used: dict[str, float] = dataclasses.field(default_factory=dict)

    def _now(self) -> dict[str, float]:
        assert self.fleet.gateway is not None
        return {
            "worker": cpu_s(self.fleet.workers[0].pid),
            "gateway": cpu_s(self.fleet.gateway.pid),
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
