"""Trace replay through the real index and every policy, over a cache-and-queue model of replicas.

Each replica is an LRU cache of 512-token blocks (the real RadixIndex with a per-replica capacity:
the index is exact here, as in precise mode) and a FIFO prefill queue that computes uncached prompt
tokens at a fixed rate, so TTFT = queueing + uncached / rate. Decode is not modelled: this measures
what routing does to cache hits, queueing and balance, not an engine.
"""

from __future__ import annotations

import argparse
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from bench.report import bar_panels, format_table, write_json
from bench.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest, load_trace
from policies import POLICY_NAMES, ReplicaView, RouteRequest, RoutingConfig, build_policy
from radix import RadixIndex


@dataclass
class FleetResult:
    hit_rate: float
    ttft_mean_s: float
    ttft_p99_s: float
    imbalance: float
    requests_per_replica: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        return {
            "hit_rate": self.hit_rate,
            "ttft_mean_s": self.ttft_mean_s,
            "ttft_p99_s": self.ttft_p99_s,
            "imbalance": self.imbalance,
        }


def session_of(request: TraceRequest) -> str:
    """A session key for affinity routing: the first block after the trace's shared first block."""
    return str(request.hash_ids[1] if len(request.hash_ids) > 1 else request.hash_ids[0])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def simulate(
    trace: list[TraceRequest],
    routing: RoutingConfig,
    replicas: int,
    capacity_tokens: int,
    prefill_rate: float,
    progress: bool = False,
) -> FleetResult:
    """Replay `trace` through one policy; every request is served (no admission limit)."""
    policy = build_policy(routing)
    capacity_blocks = max(capacity_tokens // MOONCAKE_BLOCK_TOKENS, 1)
    ids = [f"r{i}" for i in range(replicas)]
    index = RadixIndex()
    for rid in ids:
        index.add_replica(rid, capacity_blocks=capacity_blocks)
    free_at = dict.fromkeys(ids, 0.0)
    in_prefill: dict[str, deque[float]] = {rid: deque() for rid in ids}
    served = dict.fromkeys(ids, 0)
    cached_total = prompt_total = 0
    ttfts: list[float] = []
    for req in tqdm(trace, desc=routing.policy, disable=not progress, leave=False):
        now = req.arrival_s
        blocks = req.full_blocks
        matched = index.match(blocks) if blocks else {}
        views = []
        for rid in ids:
            queue = in_prefill[rid]
            while queue and queue[0] <= now:
                queue.popleft()
            outstanding = len(queue)
            views.append(
                ReplicaView(
                    id=rid,
                    block_size=MOONCAKE_BLOCK_TOKENS,
                    matched_blocks=matched.get(rid, 0),
                    running=min(outstanding, 1),
                    waiting=max(outstanding - 1, 0),
                    queued_prefill_tokens=int(max(free_at[rid] - now, 0.0) * prefill_rate),
                    prefill_rate=prefill_rate,
                )
            )
        route = RouteRequest(
            prompt_tokens=req.input_length, prefix_key=req.hash_ids[0], session=session_of(req)
        )
        chosen = policy.choose(route, views)[0]
        cached = min(matched.get(chosen, 0) * MOONCAKE_BLOCK_TOKENS, req.input_length)
        done = max(now, free_at[chosen]) + (req.input_length - cached) / prefill_rate
        free_at[chosen] = done
        in_prefill[chosen].append(done)
        served[chosen] += 1
        ttfts.append(done - now)
        cached_total += cached
        prompt_total += req.input_length
        if blocks:
            index.insert(chosen, blocks)
    counts = [served[rid] for rid in ids]
    return FleetResult(
        hit_rate=cached_total / max(prompt_total, 1),
        ttft_mean_s=statistics.fmean(ttfts) if ttfts else 0.0,
        ttft_p99_s=percentile(ttfts, 0.99) if ttfts else 0.0,
        imbalance=max(counts) / statistics.fmean(counts) if sum(counts) else 1.0,
        requests_per_replica=counts,
    )


def pooled_hit_rate(trace: list[TraceRequest], capacity_tokens: int) -> float:
    """The bound no router over these replicas can beat much: one LRU cache as large as the fleet's."""
    index = RadixIndex()
    index.add_replica("pool", capacity_blocks=max(capacity_tokens // MOONCAKE_BLOCK_TOKENS, 1))
    cached_total = prompt_total = 0
    for req in trace:
        blocks = req.full_blocks
        if blocks:
            cached_total += index.match(blocks).get("pool", 0) * MOONCAKE_BLOCK_TOKENS
            index.insert("pool", blocks)
        prompt_total += req.input_length
    return cached_total / max(prompt_total, 1)


def run(args: argparse.Namespace) -> dict:
    trace = load_trace(args.trace, speed=args.speed, limit=args.limit)
    policies: dict[str, dict[str, float]] = {}
    rows = []
    for name in tqdm(args.policies or POLICY_NAMES, desc="policies"):
        result = simulate(
            trace,
            RoutingConfig(policy=name),
            args.replicas,
            args.capacity_tokens,
            args.prefill_rate,
            progress=True,
        )
        policies[name] = result.summary()
        rows.append([name, result.hit_rate, result.ttft_mean_s, result.ttft_p99_s, result.imbalance])
    pooled = pooled_hit_rate(trace, args.replicas * args.capacity_tokens)
    rows.append(["pooled bound", pooled, "", "", ""])
    title = (
        f"routing replay: {Path(args.trace).name}, {len(trace)} requests, {args.replicas} replicas x "
        f"{args.capacity_tokens:,} tokens, prefill {args.prefill_rate:,.0f} tok/s, speed {args.speed}"
    )
    print(format_table(title, ["policy", "hit rate", "TTFT mean s", "TTFT p99 s", "imbalance"], rows))
    payload = {"policies": policies, "pooled_bound": {"hit_rate": pooled}}
    if args.json:
        write_json(args.json, payload)
    plot = args.plot or (Path(args.json).with_suffix(".png") if args.json else None)
    if plot:
        bar_panels(
            plot,
            title,
            [
                ("hit rate", {n: p["hit_rate"] for n, p in policies.items()}),
                ("TTFT mean (s)", {n: p["ttft_mean_s"] for n, p in policies.items()}),
                ("TTFT p99 (s)", {n: p["ttft_p99_s"] for n, p in policies.items()}),
                ("imbalance (max/mean)", {n: p["imbalance"] for n, p in policies.items()}),
            ],
            reference={0: ("pooled bound", pooled), 3: ("balanced", 1.0)},
        )
        print(f"plot: {plot}")
    return payload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--capacity-tokens", type=int, default=1_000_000, help="KV cache per replica")
    parser.add_argument("--prefill-rate", type=float, default=10_000.0, help="prompt tokens/s per replica")
    parser.add_argument("--speed", type=float, default=1.0, help="trace time compression factor")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--policies", nargs="*", choices=POLICY_NAMES, default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="PNG path (default: next to --json)")
