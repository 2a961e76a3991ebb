"""The fleet simulator's discrete-event loop: a workload replayed through the gateway's real index and
policies onto simulated replicas that run the real scheduler and block manager under a cost model,
in virtual time; and the pooled bound, one cache as large as the whole fleet's, that routing chases.
A module of its own so that `bench fleet` (bench.fleet), for its policies and its --ep layouts alike,
and the tests run it without the command line.

Virtual time: each replica is a SimEngine on its own VirtualClock, stepping whenever it has work;
the simulator advances whichever comes first, the next due request or the replica whose next step
starts soonest. A workload is sessions (bench.workloads): a session's later turn becomes due its
think time after the previous turn's answer ends on the virtual clock, so agent sessions are closed
loop here as over HTTP; a trace is sessions of one turn. The index is fed either by the replicas'
KV events (precise mode) or by the routing decisions alone, with a TTL, corrected by the cached
tokens each request reports and bounded by a capacity learned from them (approximate mode, as the
gateway in front of foreign backends, from a configured prior: `--capacity-priors`).
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from bench.fleet_result import FleetResult
from bench.replica import Replica, nominal_prefill_rate, replica_view
from bench.units import TOKENS, Unit, own_tokens
from bench.workloads import Session, nominal_order
from policies import RouteRequest, RoutingConfig, build_policy
from radix import RadixIndex, block_hashes
from radix.capacity import Predicted, capacity_prior, pending_horizon
from radix.reports import ReportedUnit, realised_blocks
from workers.engine.batch import StepOutput, sample_slots
from workers.engine.sampling_params import SamplingParams
from workers.sim.profiles import Profile

MODES = ("precise", "approximate")


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
                    if not precise:
                        # As the gateway's Predictions.released: its blocks are the replica's most recent.
                        index.insert(r.id, held.hashes, expires_at=now + prediction_ttl_s)
                    index.unpin(r.id, held.hashes)
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
            # Pinned until the request ends (gateway.fleet.expectations); approximate: predicted until
            # its TTL too.
            held.hashes = hashes
            if not precise:
                horizon = pending_horizon(chosen.requests.values())
                held.predicted = index.predicted(chosen.id, hashes, horizon)
                held.recorded_tick = index.tick_now(chosen.id)
                index.insert(chosen.id, hashes, expires_at=now + prediction_ttl_s)
            index.pin(chosen.id, hashes)
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
    prompts = (turn.prompt for turn in nominal_order(sessions))
    return lru_hit_rate(prompts, profile.block_size, profile.num_blocks * replicas)


def lru_hit_rate(prompts: Iterable[Sequence[int]], block_size: int, capacity_blocks: int | None) -> float:
    """The share of the prompts' tokens one LRU prefix cache of `capacity_blocks` (None: unbounded)
    holds as each arrives, fed them in order."""
    index = RadixIndex()
    index.add_replica("pool", capacity_blocks=capacity_blocks)
    cached = total = 0
    for prompt in prompts:
        tokens = list(prompt)
        hashes = block_hashes(tokens, block_size, "pool")
        # A request never reuses its own last token's block (the engine computes at least one token).
        usable = hashes[: (len(tokens) - 1) // block_size]
        if usable:
            cached += index.match(usable).get("pool", 0) * block_size
        if hashes:
            index.insert("pool", hashes)
        total += len(tokens)
    return cached / max(total, 1)
