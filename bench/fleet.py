"""Discrete-event fleet simulator: a workload replayed through the gateway's real index and policies
onto simulated replicas that run the real scheduler and block manager under a cost model.

Virtual time: each replica is a SimEngine on its own VirtualClock, stepping whenever it has work;
the simulator advances whichever comes first, the next due request or the replica whose next step
starts soonest. A workload is sessions (bench.workloads): a session's later turn becomes due its
think time after the previous turn's answer ends on the virtual clock, so agent sessions are closed
loop here as over HTTP; a trace is sessions of one turn. The index is fed either by the replicas'
KV events (precise mode) or by the routing decisions alone, with a TTL and each replica's capacity
(approximate mode).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.report import bar_panels, format_table, write_json
from bench.trace import load_trace, trace_sessions
from bench.workloads import (
    AgentParams,
    GroupedParams,
    Session,
    agent_sessions,
    grouped_sessions,
    nominal_order,
    scaled,
    total_turns,
)
from policies import POLICY_NAMES, ReplicaView, RouteRequest, RoutingConfig, build_policy
from radix import RadixIndex, block_hashes
from workers.engine.batch import StepOutput, sample_slots
from workers.engine.sampling_params import SamplingParams
from workers.sim.cost_model import chunk_shape
from workers.sim.engine import SimEngine
from workers.sim.profiles import Profile, get_profile
from workers.sim.runner import VirtualClock

MODES = ("precise", "approximate")
# The policies that read the index, and so route differently when it is predicted (approximate).
INDEX_POLICIES = ("prefix_aware", "cache_threshold")
WORKLOADS = ("agent", "grouped")


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
        # Sequence id -> (arrival time, session, turn) of the requests it holds.
        self.requests: dict[int, tuple[float, int, int]] = {}
        self.served = 0


def simulate(
    sessions: Sequence[Session],
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
    # Replicas with work, by the start time of their next step.
    busy: list[tuple[float, int]] = []
    # Turns due, as (time, tie-break, session, turn): every session's first, later ones as answered.
    order = itertools.count()
    due = [(s.start_s, next(order), i, 0) for i, s in enumerate(sessions)]
    heapq.heapify(due)
    done = on_request_done or (lambda: None)

    def answered(session: int, turn: int, now: float) -> None:
        """A turn ended (answered or refused): the session's next one is due after its think time."""
        done()
        turns = sessions[session].turns
        if turn + 1 < len(turns):
            heapq.heappush(due, (now + turns[turn + 1].think_s, next(order), session, turn + 1))

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
                ttfts.append(now - r.requests[seq.seq_id][0])
                cached_total += seq.num_cached_tokens
            if seq.is_finished:
                _, session, turn = r.requests.pop(seq.seq_id)
                answered(session, turn, now)

    while due or busy:
        if busy and (not due or busy[0][0] <= due[0][0]):
            _, i = heapq.heappop(busy)
            r = fleet[i]
            run_step(r)
            if r.engine.has_work():
                heapq.heappush(busy, (r.clock.now(), i))
            continue
        now, _, session, turn = heapq.heappop(due)
        request = sessions[session].turns[turn]
        tokens = list(request.prompt)
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
                    cached_blocks=index.blocks_of(r.id),
                )
            )
        route = RouteRequest(
            prompt_tokens=len(tokens),
            prefix_key=hashes[0] if hashes else 0,
            session=sessions[session].key or None,
        )
        chosen = by_id[policy.choose(route, views)[0]]
        idle = not chosen.engine.has_work()
        if idle:
            chosen.clock.advance_to(now)
        sampling = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
        try:
            rid = chosen.engine.add_request(tokens, sampling)
        except ValueError:
            rejected += 1
            answered(session, turn, now)
            continue
        chosen.requests[rid] = (now, session, turn)
        chosen.served += 1
        prompt_total += len(tokens)
        if not precise and hashes:
            index.insert(chosen.id, hashes, expires_at=now + prediction_ttl_s)
        if idle:
            heapq.heappush(busy, (chosen.clock.now(), fleet.index(chosen)))
    end = max(r.clock.now() for r in fleet)
    counts = [r.served for r in fleet]
    ordered = sorted(ttfts)
    first = min((s.start_s for s in sessions), default=0.0)
    return FleetResult(
        hit_rate=cached_total / max(prompt_total, 1),
        ttft_mean_s=statistics.fmean(ttfts) if ttfts else 0.0,
        ttft_p50_s=ordered[len(ordered) // 2] if ordered else 0.0,
        ttft_p99_s=ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0,
        throughput_tok_s=produced / max(end - first, 1e-9),
        imbalance=max(counts) / statistics.fmean(counts) if sum(counts) else 1.0,
        completed=len(ttfts),
        rejected=rejected,
    )


def pooled_hit_rate(sessions: Sequence[Session], profile: Profile, replicas: int) -> float:
    """One LRU prefix cache as large as the whole fleet's KV, fed every request in its nominal order
    (answers instant): the bound routing chases."""
    index = RadixIndex()
    index.add_replica("pool", capacity_blocks=profile.num_blocks * replicas)
    cached = total = 0
    for turn in nominal_order(sessions):
        tokens = list(turn.prompt)
        hashes = block_hashes(tokens, profile.block_size, profile.model_name)
        # A request never reuses its own last token's block (the engine computes at least one token).
        usable = hashes[: (len(tokens) - 1) // profile.block_size]
        if usable:
            cached += index.match(usable).get("pool", 0) * profile.block_size
        if hashes:
            index.insert("pool", hashes)
        total += len(tokens)
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


def _run_job(sessions: list[Session], policy: str, mode: str, profile: Profile, replicas: int) -> FleetResult:
    return simulate(
        sessions, RoutingConfig(policy=policy), profile, replicas, mode, on_request_done=_count_one
    )


def jobs_of(policies: list[str], modes: list[str]) -> list[tuple[str, str]]:
    """(policy, mode) pairs to simulate: approximate mode changes only what the index policies read."""
    return [(p, m) for m in modes for p in policies if m == "precise" or p in INDEX_POLICIES]


def fleet_profile(name: str, block_size: int | None, num_blocks: int | None) -> Profile:
    """The named profile, with its block size and pool overridden where given (a pool smaller than an
    H100's is what puts a small workload's caches under pressure)."""
    profile = get_profile(name)
    if block_size is not None:
        profile = replace(profile, block_size=block_size)
    if num_blocks is not None:
        profile = replace(profile, kv_capacity_tokens=num_blocks * profile.block_size)
    return profile


def generated_sessions(args: argparse.Namespace) -> tuple[list[Session], dict[str, Any]]:
    """`--workload`'s sessions and parameters from the flags both benches share: --seed, --sessions
    and --duration (agent: the window sessions start in; grouped: prompts due later are left out),
    --rate (grouped), --limit (sessions) and --speed."""
    if args.workload == "agent":
        params: AgentParams | GroupedParams = AgentParams(seed=args.seed)
        if args.sessions is not None:
            params = replace(params, sessions=args.sessions)
        if args.duration is not None:
            params = replace(params, start_window_s=args.duration)
        sessions = agent_sessions(params)
    else:
        params = GroupedParams(seed=args.seed)
        if args.rate is not None:
            params = replace(params, rate=args.rate)
        sessions = grouped_sessions(params)
        if args.duration is not None:
            sessions = [s for s in sessions if s.start_s < args.duration]
    return scaled(sessions[: args.limit], args.speed), asdict(params)


def workload_of(args: argparse.Namespace, profile: Profile) -> tuple[str, list[Session], dict[str, Any]]:
    """The workload's name, sessions and parameters (none for a trace), a pure function of the flags."""
    if args.trace is not None:
        trace = load_trace(args.trace, speed=args.speed, limit=args.limit)
        return Path(args.trace).name, trace_sessions(trace, profile.vocab_size), {}
    return args.workload, *generated_sessions(args)


def run(args: argparse.Namespace) -> dict:
    profile = fleet_profile(args.profile, args.block_size, args.num_blocks)
    workload, sessions, params = workload_of(args, profile)
    requests = total_turns(sessions)
    jobs = jobs_of(args.policies or list(POLICY_NAMES), args.modes)
    workers = max(1, min(len(jobs), args.workers or os.cpu_count() or 1))
    # Each job is one single-threaded simulation: processes, one per core, run them side by side.
    counter = multiprocessing.get_context("fork").Value("q", 0)
    with ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("fork"), initializer=_init_job, initargs=(counter,)
    ) as pool:
        futures = {job: pool.submit(_run_job, sessions, *job, profile, args.replicas) for job in jobs}
        desc = f"{len(jobs)} simulations on {workers} processes"
        with tqdm(total=requests * len(jobs), desc=desc) as bar:
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
    pooled = pooled_hit_rate(sessions, profile, args.replicas)
    rows.append(["pooled bound", pooled, "", "", "", "", ""])
    title = (
        f"fleet simulation: {workload}, {requests} requests, {args.replicas} x {profile.name} "
        f"({profile.num_blocks} blocks of {profile.block_size}), speed {args.speed:g}"
    )
    print(
        format_table(
            title, ["policy", "hit rate", "TTFT mean s", "p50 s", "p99 s", "out tok/s", "imbalance"], rows
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", default=None, help="Mooncake-format JSONL trace")
    source.add_argument(
        "--workload", choices=WORKLOADS, default=None, help="generated: agent sessions or grouped prefixes"
    )
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--profile", default="h100-8b", help="sim profile name or JSON path")
    parser.add_argument("--block-size", type=int, default=None, help="KV block size (default: the profile's)")
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks per replica (default: the profile's)"
    )
    parser.add_argument("--speed", type=float, default=1.0, help="time compression (2 = twice as fast)")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests (sessions)")
    parser.add_argument(
        "--sessions", type=int, default=None, help=f"agent sessions (default {AgentParams().sessions})"
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help=f"grouped prompts per second (default {GroupedParams().rate:g})",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help=f"agent: the window sessions start in (default {AgentParams().start_window_s:g} s); "
        "grouped: prompts due later are left out",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the generated workloads")
    parser.add_argument("--policies", nargs="*", choices=POLICY_NAMES, default=None)
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    parser.add_argument("--workers", type=int, default=None, help="processes (default: one per core)")
    parser.add_argument("--json", default=None)
