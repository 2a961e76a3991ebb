"""Discrete-event fleet simulator: a workload replayed through the gateway's real index and policies
onto simulated replicas that run the real scheduler and block manager under a cost model.

Virtual time: each replica is a SimEngine on its own VirtualClock, stepping whenever it has work;
the simulator advances whichever comes first, the next due request or the replica whose next step
starts soonest. A workload is sessions (bench.workloads): a session's later turn becomes due its
think time after the previous turn's answer ends on the virtual clock, so agent sessions are closed
loop here as over HTTP; a trace is sessions of one turn. The index is fed either by the replicas'
KV events (precise mode) or by the routing decisions alone, with a TTL, corrected by the cached
tokens each request reports and bounded by a capacity learned from them (approximate mode, as the
gateway in front of foreign backends, from a configured prior: `--capacity-priors`). With `--pd`,
the same workload runs on splits of the fleet into prefill and decode replicas instead (bench.pd,
bench.pd_bench); with `--ep`, an MoE model on the same GPUs in replicas of each expert-parallel
group size (bench.fleet_ep).
"""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import fleet_ep, pd_bench
from bench.fleet_result import FleetResult
from bench.latency import Slo
from bench.parallel import run_jobs
from bench.pd import DEFAULT_RESERVE_WAIT_S
from bench.replica import Replica, nominal_prefill_rate, replica_view
from bench.report import bar_panels, format_table, write_json
from bench.trace import load_trace, trace_sessions
from bench.units import TOKENS, UNITS, Unit, own_tokens, unit_of
from bench.workloads import (
    AGENT_WORKLOADS,
    AgentParams,
    GroupedParams,
    LongMixParams,
    Session,
    agent_sessions,
    grouped_sessions,
    longmix_sessions,
    nominal_order,
    scaled,
    total_turns,
)
from policies import POLICY_NAMES, RouteRequest, RoutingConfig, build_policy
from policies.config import parse_routing
from radix import RadixIndex, block_hashes
from radix.capacity import Predicted, capacity_prior, pending_horizon
from radix.reports import ReportedUnit, realised_blocks
from workers.engine.batch import StepOutput, sample_slots
from workers.engine.sampling_params import SamplingParams
from workers.sim.moe import Gate
from workers.sim.profiles import Profile, get_profile

MODES = ("precise", "approximate")
# The policies that read the index, and so route differently when it is predicted (approximate).
INDEX_POLICIES = ("prefix_aware", "cache_threshold")
# The generated workloads by name: bench.workloads.TUNED and HELD_OUT say which may be tuned on.
WORKLOADS = ("agent", "grouped", "longmix", "agent-zipf", "agent-tools", "agent-think")


@dataclass(slots=True)
class _Held:
    """A request on a replica: when it arrived, which turn of which session it is, and in approximate
    mode what the index predicted the replica held of it (checked against what it reuses) and the
    index tick its blocks were recorded at."""

    arrival: float
    session: int
    turn: int
    predicted: Predicted | None = None
    recorded_tick: int | None = None
    started: bool = False
    # The prompt's hashes and the replica's count of its tokens (approximate mode: what the report is
    # read against), or its in-flight record on an exact replica (precise mode: settled at its end).
    hashes: list[int] | None = None
    own_tokens: int = 0


class _FleetReplica(Replica):
    """A replica with the requests this simulator follows on it and the count it was sent."""

    def __init__(self, rid: str, profile: Profile, index: RadixIndex, precise: bool) -> None:
        super().__init__(rid, profile, index, precise)
        # Sequence id -> the requests it holds.
        self.requests: dict[int, _Held] = {}
        self.served = 0


def simulate(
    sessions: Sequence[Session],
    routing: RoutingConfig,
    profile: Profile,
    replicas: int,
    mode: str = "precise",
    prediction_ttl_s: float = 300.0,
    on_request_done: Callable[[], None] | None = None,
    capacity_scale: float | None = 1.0,
    unit: Unit = TOKENS,
) -> FleetResult:
    """One workload through the policy onto `replicas` simulated replicas. In approximate mode the
    index learns as the gateway does in front of foreign backends: each replica's configured capacity
    is `capacity_scale` times its true pool (None: not configured), taken as a guess
    (radix.capacity.capacity_prior), and corrected by the cached tokens each request reports at its
    first token, read as the gateway reads them (radix.reports). The replicas count prompts in `unit`
    (bench.units), which only approximate mode can follow. In precise mode, as in the gateway, a
    prompt counts as held by its replica from when it is routed there until its request ends."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if capacity_scale is not None and capacity_scale <= 0:
        raise ValueError(f"capacity_scale must be positive, got {capacity_scale}")
    precise = mode == "precise"
    if precise and unit.foreign:
        raise ValueError(
            f"replicas counting in {unit.name} publish no events in the gateway's blocks: "
            "route them in approximate mode"
        )
    policy = build_policy(routing)
    index = RadixIndex()
    own_profile = profile
    if unit.block_size is not None:
        own_profile = replace(profile, block_size=unit.block_size)
    fleet = [_FleetReplica(f"r{i}", own_profile, index, precise) for i in range(replicas)]
    reported = {r.id: ReportedUnit() for r in fleet}
    last_replica: dict[int, str] = {}
    moved = later_turns = 0
    configured = None if capacity_scale is None else max(1, round(profile.num_blocks * capacity_scale))
    for r in fleet:
        if precise:
            index.add_replica(r.id)
        else:
            index.add_replica(r.id, capacity_blocks=capacity_prior(configured, guessed=True), learn=True)
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

    def run_step(r: _FleetReplica) -> None:
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
                held = r.requests[seq.seq_id]
                held.started = True
                ttfts.append(now - held.arrival)
                cached_total += seq.num_cached_tokens
                if held.predicted is not None and held.hashes is not None:
                    report = reported[r.id]
                    report.observe(seq.num_cached_tokens)
                    realised = realised_blocks(
                        held.predicted.blocks,
                        seq.num_cached_tokens,
                        held.own_tokens if unit.foreign else None,
                        len(sessions[held.session].turns[held.turn].prompt),
                        profile.block_size,
                        report.block(profile.block_size),
                        len(held.hashes),
                    )
                    index.correct(r.id, held.predicted, realised)
            if seq.is_finished:
                held = r.requests.pop(seq.seq_id)
                if held.hashes is not None:
                    if precise:
                        index.settle(r.id, held.hashes)
                    else:
                        # As the gateway's Predictions.released: its blocks are the replica's most recent.
                        index.insert(r.id, held.hashes, expires_at=now + prediction_ttl_s)
                answered(held.session, held.turn, now)

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
        views = [replica_view(r, matched.get(r.id, 0), index, rate) for r in fleet]
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
        own = own_tokens(unit, tokens, profile.vocab_size)
        try:
            rid = chosen.engine.add_request(own, sampling)
        except ValueError:
            rejected += 1
            answered(session, turn, now)
            continue
        held = chosen.requests[rid] = _Held(now, session, turn, own_tokens=len(own))
        chosen.served += 1
        prompt_total += len(own)
        if turn:
            later_turns += 1
            moved += last_replica.get(session) != chosen.id
        last_replica[session] = chosen.id
        if hashes:
            # Approximate: predicted until its TTL; precise: in flight until settled at its end.
            held.hashes = hashes
            if not precise:
                horizon = pending_horizon(chosen.requests.values())
                held.predicted = index.predicted(chosen.id, hashes, horizon)
                held.recorded_tick = index.tick_now(chosen.id)
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
        moved_turns=moved / later_turns if later_turns else 0.0,
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


@dataclass(frozen=True, slots=True)
class Job:
    """One (policy, mode) to simulate; in approximate mode, with the replicas' configured capacity as
    a multiple of their true pool (None: not configured)."""

    policy: str
    mode: str
    capacity_scale: float | None = None

    @property
    def key(self) -> str:
        """Its name in the table and the JSON: the policy, then the mode unless precise, then the
        capacity unless it is the true one."""
        if self.mode == "precise":
            return self.policy
        name = f"{self.policy}_{self.mode}"
        if self.capacity_scale is None:
            return f"{name}_unset"
        return name if self.capacity_scale == 1.0 else f"{name}_x{self.capacity_scale:g}"


def jobs_of(
    policies: list[str],
    modes: list[str],
    capacity_scales: Sequence[float | None] = (1.0,),
    foreign: bool = False,
) -> list[Job]:
    """What to simulate: approximate mode changes only what the index policies read, so only they
    run in it, once per configured capacity. Replicas of a `foreign` unit publish no events the
    gateway could follow: every policy runs in approximate mode."""
    if foreign:
        if "approximate" not in modes:
            raise ValueError("replicas counting in another unit can only be routed in approximate mode")
        first = capacity_scales[0]
        index = [Job(p, "approximate", c) for c in capacity_scales for p in policies if p in INDEX_POLICIES]
        return index + [Job(p, "approximate", first) for p in policies if p not in INDEX_POLICIES]
    jobs = [Job(p, "precise") for p in policies if "precise" in modes]
    if "approximate" in modes:
        jobs += [Job(p, "approximate", c) for c in capacity_scales for p in policies if p in INDEX_POLICIES]
    return jobs


def prefix_aware_knob(text: str) -> tuple[str, float]:
    """`--prefix-aware KEY=VALUE`: a knob of policies.prefix_aware's config, checked when it is built."""
    key, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return key.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KEY=NUMBER, got {text!r}") from None


def parse_capacity_prior(text: str) -> float | None:
    """`--capacity-priors` value: a positive multiple of the true capacity, or 'unset'."""
    if text == "unset":
        return None
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a capacity prior is a positive multiple or 'unset', got {text!r}")
    return value


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


def generated_sessions(args: argparse.Namespace) -> tuple[list[Session], dict[str, Any]]:
    """`--workload`'s sessions and parameters from the flags both benches share: --seed, --sessions
    (agent workloads: sessions; longmix: requests) and --duration (agent workloads: the window
    sessions start in; grouped, longmix: prompts due later are left out), --rate (grouped, longmix),
    --limit (sessions) and --speed."""
    if args.workload in AGENT_WORKLOADS:
        params: AgentParams | GroupedParams | LongMixParams = replace(
            AGENT_WORKLOADS[args.workload], seed=args.seed
        )
        if args.sessions is not None:
            params = replace(params, sessions=args.sessions)
        if args.duration is not None:
            params = replace(params, start_window_s=args.duration)
        return scaled(agent_sessions(params)[: args.limit], args.speed), asdict(params)
    if args.workload == "grouped":
        params = GroupedParams(seed=args.seed)
        if args.rate is not None:
            params = replace(params, rate=args.rate)
        sessions = grouped_sessions(params)
    else:
        params = LongMixParams(seed=args.seed)
        if args.rate is not None:
            params = replace(params, rate=args.rate)
        if args.sessions is not None:
            params = replace(params, requests=args.sessions)
        sessions = longmix_sessions(params)
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
    pd = parser.add_argument_group("prefill/decode disaggregation (bench.pd): --pd replaces --policies")
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
