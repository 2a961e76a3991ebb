"""Discrete-event fleet simulator: a trace replayed through the gateway's real index and policies
onto simulated replicas that run the real scheduler and block manager under a cost model.

Virtual time: each replica is a SimEngine on its own VirtualClock, stepping whenever it has work;
the simulator advances whichever comes first, the next arrival or the replica whose current step
ends soonest. The index is fed either by the replicas' KV events (precise mode) or by the routing
decisions alone, with a TTL and each replica's capacity (approximate mode).
"""

from __future__ import annotations

import argparse
import heapq
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

from tqdm import tqdm

from bench.report import bar_panels, format_table, write_json
from bench.trace import TraceRequest, load_trace, prompt_tokens
from policies import POLICY_NAMES, ReplicaView, RouteRequest, RoutingConfig, build_policy
from radix import RadixIndex, block_hashes
from workers.engine.batch import StepOutput, sample_slots
from workers.engine.sampling_params import SamplingParams
from workers.sim.cost_model import chunk_shape
from workers.sim.engine import SimEngine
from workers.sim.profiles import Profile, get_profile
from workers.sim.runner import VirtualClock

MODES = ("precise", "approximate")


def nominal_prefill_rate(profile: Profile) -> float:
    """Prompt tokens per second of one full-budget prefill step: what est_ttft divides by."""
    tokens = profile.max_num_batched_tokens
    return tokens / profile.cost.time(chunk_shape(0, tokens))


@dataclass(frozen=True, slots=True)
class FleetResult:
    hit_rate: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_tok_s: float
    imbalance: float
    completed: int
    rejected: int

    def summary(self) -> dict[str, float]:
        return {
            "hit_rate": self.hit_rate,
            "ttft_mean_s": self.ttft_mean_s,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p99_s": self.ttft_p99_s,
            "throughput_tok_s": self.throughput_tok_s,
            "imbalance": self.imbalance,
        }


class _Replica:
    def __init__(self, rid: str, profile: Profile, index: RadixIndex, precise: bool) -> None:
        self.id = rid
        self.clock = VirtualClock()
        callbacks = {}
        if precise:
            callbacks = {
                "on_stored": lambda hashes, parent: index.insert(rid, hashes),
                "on_removed": lambda hashes: index.remove(rid, hashes),
                "on_cleared": lambda: index.clear(rid),
            }
        self.engine = SimEngine(profile, clock=self.clock, **callbacks)
        self.arrivals: dict[int, float] = {}
        self.served = 0


def simulate(
    trace: list[TraceRequest],
    routing: RoutingConfig,
    profile: Profile,
    replicas: int,
    mode: str = "precise",
    prediction_ttl_s: float = 300.0,
    on_request_done: Callable[[], None] | None = None,
) -> FleetResult:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    policy = build_policy(routing)
    precise = mode == "precise"
    index = RadixIndex()
    fleet = [_Replica(f"r{i}", profile, index, precise) for i in range(replicas)]
    for r in fleet:
        index.add_replica(r.id, capacity_blocks=None if precise else profile.num_blocks)
    by_id = {r.id: r for r in fleet}
    rate = nominal_prefill_rate(profile)
    filler = next(t for t in range(profile.vocab_size) if t not in profile.eos_token_ids)
    ttfts: list[float] = []
    cached_total = prompt_total = produced = rejected = 0
    # Replicas with work, by the end time of their current step.
    busy: list[tuple[float, int]] = []
    pending = iter(trace)
    nxt = next(pending, None)
    done = on_request_done or (lambda: None)

    def run_step(r: _Replica) -> None:
        """One engine step on the replica's clock: the SimEngine's scheduler and runner, without the
        per-token text deltas a server needs and a simulator does not."""
        nonlocal produced, cached_total
        scheduler, runner = r.engine.scheduler, r.engine.runner
        chunks = scheduler.schedule(r.clock.now())
        # Token values only feed decode blocks' hashes, which no other request shares: one fixed
        # non-EOS token keeps the sampling out of the hot loop.
        outputs = [StepOutput(slot.seq_id, filler) for slot in sample_slots(chunks)]
        r.clock.wait(runner.step_time(chunks))
        now = r.clock.now()
        for seq in scheduler.update(chunks, outputs, now):
            produced += 1
            if seq.num_output_tokens == 1:
                ttfts.append(now - r.arrivals[seq.seq_id])
                cached_total += seq.num_cached_tokens
            if seq.is_finished:
                del r.arrivals[seq.seq_id]
                done()

    while nxt is not None or busy:
        if busy and (nxt is None or busy[0][0] <= nxt.arrival_s):
            _, i = heapq.heappop(busy)
            r = fleet[i]
            run_step(r)
            if r.engine.has_work():
                heapq.heappush(busy, (r.clock.now(), i))
            continue
        request, nxt = nxt, next(pending, None)
        now = request.arrival_s
        tokens = prompt_tokens(request, profile.vocab_size)
        hashes = block_hashes(tokens, profile.block_size, profile.model_name)
        if not precise:
            index.expire(now)
        matched = index.match(hashes) if hashes else {}
        views = []
        for r in fleet:
            stats = r.engine.stats()
            views.append(
                ReplicaView(
                    id=r.id,
                    block_size=profile.block_size,
                    matched_blocks=matched.get(r.id, 0),
                    running=stats.running,
                    waiting=stats.waiting,
                    queued_prefill_tokens=stats.queued_prefill_tokens,
                    max_waiting=profile.max_num_seqs,
                    prefill_rate=rate,
                )
            )
        route = RouteRequest(
            prompt_tokens=len(tokens),
            prefix_key=hashes[0] if hashes else 0,
            session=str(request.hash_ids[1] if len(request.hash_ids) > 1 else request.hash_ids[0]),
        )
        chosen = by_id[policy.choose(route, views)[0]]
        idle = not chosen.engine.has_work()
        if idle:
            chosen.clock.advance_to(now)
        sampling = SamplingParams(temperature=0.0, max_tokens=max(request.output_length, 1), ignore_eos=True)
        try:
            rid = chosen.engine.add_request(tokens, sampling)
        except ValueError:
            rejected += 1
            done()
            continue
        chosen.arrivals[rid] = now
        chosen.served += 1
        prompt_total += len(tokens)
        if not precise and hashes:
            index.insert(chosen.id, hashes, expires_at=now + prediction_ttl_s)
        if idle:
            heapq.heappush(busy, (chosen.clock.now(), fleet.index(chosen)))
    end = max(r.clock.now() for r in fleet)
    counts = [r.served for r in fleet]
    ordered = sorted(ttfts)
    return FleetResult(
        hit_rate=cached_total / max(prompt_total, 1),
        ttft_mean_s=statistics.fmean(ttfts) if ttfts else 0.0,
        ttft_p50_s=ordered[len(ordered) // 2] if ordered else 0.0,
        ttft_p99_s=ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0,
        throughput_tok_s=produced / max(end - trace[0].arrival_s, 1e-9),
        imbalance=max(counts) / statistics.fmean(counts) if sum(counts) else 1.0,
        completed=len(ttfts),
        rejected=rejected,
    )


def pooled_hit_rate(trace: list[TraceRequest], profile: Profile, replicas: int) -> float:
    """One LRU prefix cache as large as the whole fleet's KV, fed every request: the bound routing chases."""
    index = RadixIndex()
    index.add_replica("pool", capacity_blocks=profile.num_blocks * replicas)
    cached = total = 0
    for request in trace:
        hashes = block_hashes(
            prompt_tokens(request, profile.vocab_size), profile.block_size, profile.model_name
        )
        # A request never reuses its own last token's block (the engine computes at least one token).
        usable = hashes[: (request.input_length - 1) // profile.block_size]
        if usable:
            cached += index.match(usable).get("pool", 0) * profile.block_size
        if hashes:
            index.insert("pool", hashes)
        total += request.input_length
    return cached / max(total, 1)


# Requests finished across every job of a run, for the one progress bar the parent draws.
_finished: Synchronized | None = None


def _init_job(counter: Synchronized) -> None:
    global _finished
    _finished = counter


def _count_one() -> None:
    assert _finished is not None
    with _finished.get_lock():
        _finished.value += 1


def _run_job(
    trace: list[TraceRequest], policy: str, mode: str, profile: Profile, replicas: int
) -> FleetResult:
    return simulate(trace, RoutingConfig(policy=policy), profile, replicas, mode, on_request_done=_count_one)


def jobs_of(policies: list[str], modes: list[str]) -> list[tuple[str, str]]:
    """(policy, mode) pairs to simulate: approximate mode changes only what prefix_aware reads."""
    return [(p, m) for m in modes for p in policies if m == "precise" or p == "prefix_aware"]


def run(args: argparse.Namespace) -> dict:
    profile = get_profile(args.profile)
    trace = load_trace(args.trace, speed=args.speed, limit=args.limit)
    jobs = jobs_of(args.policies or list(POLICY_NAMES), args.modes)
    workers = max(1, min(len(jobs), args.workers or os.cpu_count() or 1))
    # Each job is one single-threaded simulation: processes, one per core, run them side by side.
    counter = multiprocessing.get_context("fork").Value("q", 0)
    with ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("fork"), initializer=_init_job, initargs=(counter,)
    ) as pool:
        futures = {job: pool.submit(_run_job, trace, *job, profile, args.replicas) for job in jobs}
        desc = f"{len(jobs)} simulations on {workers} processes"
        with tqdm(total=len(trace) * len(jobs), desc=desc) as bar:
            while not all(f.done() for f in futures.values()):
                time.sleep(0.5)
                bar.update(counter.value - bar.n)
            bar.update(counter.value - bar.n)
        outcomes = {job: f.result() for job, f in futures.items()}
    results: dict[str, dict[str, float]] = {}
    rows = []
    for (name, mode), result in outcomes.items():
        key = name if mode == "precise" else f"{name}_{mode}"
        results[key] = result.summary()
        rows.append(
            [
                key,
                result.hit_rate,
                result.ttft_mean_s,
                result.ttft_p50_s,
                result.ttft_p99_s,
                result.throughput_tok_s,
                result.imbalance,
            ]
        )
    pooled = pooled_hit_rate(trace, profile, args.replicas)
    rows.append(["pooled bound", pooled, "", "", "", "", ""])
    title = (
        f"fleet simulation: {Path(args.trace).name}, {len(trace)} requests, "
        f"{args.replicas} x {profile.name}, speed {args.speed}"
    )
    print(
        format_table(
            title, ["policy", "hit rate", "TTFT mean s", "p50 s", "p99 s", "out tok/s", "imbalance"], rows
        )
    )
    payload = {
        "trace": str(args.trace),
        "requests": len(trace),
        "replicas": args.replicas,
        "profile": profile.name,
        "speed": args.speed,
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
                ("TTFT p99 (s)", {n: p["ttft_p99_s"] for n, p in results.items()}),
                ("imbalance (max/mean)", {n: p["imbalance"] for n, p in results.items()}),
            ],
            reference={0: ("pooled bound", pooled), 3: ("balanced", 1.0)},
        )
    return payload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--profile", default="h100-8b", help="sim profile name or JSON path")
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--policies", nargs="*", choices=POLICY_NAMES, default=None)
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    parser.add_argument("--workers", type=int, default=None, help="processes (default: one per core)")
    parser.add_argument("--json", default=None)
