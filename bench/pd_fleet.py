"""Prefill/decode disaggregation in the fleet simulator: the same GPUs split into prefill and decode
replicas, against all of them mixed.

A split P:D is P prefill and D decode replicas, one GPU of the profile each; P:0 is P mixed replicas
as `bench fleet` runs them. Every replica is the fleet simulator's (bench.replica): the real
scheduler (chunked prefill within the profile's token budget, decodes first) and block manager under
the cost model, on a virtual clock of its own, its KV events feeding the one index (precise mode)
that both halves of routing read.

A request's way through a split, as the gateway and the workers of a disaggregated fleet take it:
1. On arrival the gateway's pairing policy (policies.pd, default knobs) names the decode replica and
   the prefill replica, or none when the decode replica holds all of the prompt but a little: load,
   free KV and the decode replicas' own cached prefixes decide the one, prefix_aware among the
   prefill replicas the other. A decode replica's view counts the requests waiting for room there
   and the transfers on their way to it as queued requests (the gateway has them in flight there).
   Then the decode worker's side (workers.kv_handoff): it `reserve`s blocks for the prompt
   blocks it lacks before any prefill runs, so that a transfer never arrives to a full pool. With
   no room for them the request waits in the replica's queue of pending reservations, first come
   first served, retried after each of the replica's steps (steps are what free blocks); one that
   waits longer than the bound (`reserve_wait_s`) leaves the queue and the decode replica computes
   its prompt itself. Moving a long prefill onto a decode replica is what disaggregation is there
   to avoid, so the bound is long; the wait counts in TTFT. With a bound of 0 it computes the
   prompt at once.
2. The prefill replica runs the prompt's reusable blocks (every full block but the one holding the
   last token) as a request of max_tokens 1, its prefix cache helping, and pins them (`hold`)
   until they are sent.
3. The blocks the decode replica lacks, block_size x the profile's kv_bytes_per_token each, cross the
   profile's link. Each replica has one link, full duplex: a transfer needs the sender's outbound
   and the receiver's inbound side, and waits (FIFO) while either is busy.
4. When it ends, the decode replica `install`s the blocks between two of its steps (a step under
   way finishes first): they are prefix-cache blocks there like any it computed, with their KV
   events. The request joins its queue, computes the prompt's tail (under a block) and decodes.
Mixed replicas take each request whole, by prefix_aware over all of them.

Measures (bench.latency): TTFT from arrival to the first token of the replica that decodes (the
wait for room, prefill queue, prefill, transfer and the decode replica's queue included), every gap
between tokens, and both goodputs over the run's span, from the first arrival to the last token.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from bench.latency import LatencySummary, RequestLatency, Slo, summarize
from bench.replica import Replica, nominal_prefill_rate, replica_view
from bench.workloads import Session, total_turns
from policies import ReplicaView, Role, RouteRequest, RoutingConfig, build_pd, build_policy
from radix import RadixIndex, block_hashes
from workers.engine.batch import StepOutput, sample_slots
from workers.engine.block_manager import Reservation
from workers.engine.sampling_params import SamplingParams
from workers.sim.profiles import Profile

# How long a decode replica waits for room to receive a prompt's KV before it computes the prompt
# itself: the real decode worker's default.
DEFAULT_RESERVE_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class Split:
    prefill: int
    # 0: the `prefill` replicas are mixed ones.
    decode: int

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 0:
            raise ValueError(f"a split needs a prefill (or mixed) replica, got {self.prefill}:{self.decode}")

    @property
    def mixed(self) -> bool:
        return self.decode == 0

    @property
    def replicas(self) -> int:
        return self.prefill + self.decode

    @property
    def name(self) -> str:
        return f"{self.prefill} mixed" if self.mixed else f"{self.prefill}P:{self.decode}D"


def parse_splits(values: Iterable[str]) -> list[Split]:
    """Splits from `P:D` items, comma-separated within a value, in order."""
    splits = []
    for value in values:
        for item in value.split(","):
            p, sep, d = item.strip().partition(":")
            if not (sep and p.isdigit() and d.isdigit()):
                raise ValueError(f"a split is P:D (prefill:decode replicas, 4:0 for 4 mixed), got {item!r}")
            splits.append(Split(int(p), int(d)))
    return splits


@dataclass(slots=True)
class _Request:
    """A request as its client sees it, from arrival to its last token."""

    session: int
    turn: int
    arrival_s: float
    tokens: list[int]
    max_tokens: int
    first_s: float | None = None
    last_s: float = 0.0
    max_gap_s: float = 0.0
    emitted: int = 0
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    reserve_wait_s: float = 0.0


@dataclass(eq=False, slots=True)
class _Pull:
    """A request whose decode replica waits for room to reserve its prompt's KV, until `deadline_s`;
    `done` once it has left the queue (the deadline's wake-up then finds nothing to do)."""

    request: _Request
    source: int
    # The prompt's reusable blocks, which the prefill replica computes once room is reserved.
    hashes: list[int]
    deadline_s: float
    done: bool = False


@dataclass(slots=True)
class _Transfer:
    """A request's prefill on a prefill replica and its KV's way to the decode replica."""

    request: _Request
    source: int
    target: int
    reservation: Reservation
    # The prompt's reusable blocks, and the source's blocks holding them while they are sent.
    hashes: list[int]
    held: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PdResult:
    split: Split
    summary: LatencySummary
    # Requests by the way they went: mixed, transfer, decode_cached (the decode replica held the
    # prompt), no_room (it could not reserve within the bound, and prefilled it itself), rejected.
    routes: dict[str, int]
    latencies: tuple[RequestLatency, ...]


class PdFleet:
    """One split's fleet over a workload; `run` once, then its replicas can be inspected."""

    def __init__(
        self,
        sessions: Sequence[Session],
        profile: Profile,
        split: Split,
        *,
        slo: Slo | None = None,
        reserve_wait_s: float = DEFAULT_RESERVE_WAIT_S,
        on_request_done: Callable[[], None] | None = None,
    ) -> None:
        if not reserve_wait_s >= 0:
            raise ValueError(f"reserve_wait_s must be a non-negative number of seconds, got {reserve_wait_s}")
        self.sessions = sessions
        self.profile = profile
        self.split = split
        self.slo = slo or Slo()
        self.reserve_wait_s = reserve_wait_s
        self._done = on_request_done or (lambda: None)
        self.index = RadixIndex()
        first = "m" if split.mixed else "p"
        self.prefill = [Replica(f"{first}{i}", profile, self.index, True) for i in range(split.prefill)]
        self.decode = [Replica(f"d{i}", profile, self.index, True) for i in range(split.decode)]
        self.replicas = self.prefill + self.decode
        for r in self.replicas:
            self.index.add_replica(r.id)
        self._pos = {r.id: i for i, r in enumerate(self.replicas)}
        # What the gateway routes by: prefix_aware over a mixed fleet, the prefill/decode pairing
        # policy over a split one (its prefill ranking prefix_aware's too).
        self.mixed_policy = build_policy(RoutingConfig(policy="prefix_aware"))
        self.pd_policy = build_pd(RoutingConfig())
        self.roles: list[Role] = ["mixed" if split.mixed else "prefill"] * split.prefill
        self.roles += ["decode"] * split.decode
        self.rate = nominal_prefill_rate(profile)
        # Token values only feed decode blocks' hashes, which no other request shares (bench.fleet).
        self.filler = next(t for t in range(profile.vocab_size) if t not in profile.eos_token_ids)
        self._order = itertools.count()
        # Turns due as (time, tie-break, session, turn); replicas by their next step's start; transfers
        # by their end; retries of a decode replica's pending reservations (after its steps, and at a
        # waiting request's deadline, which names it).
        self._due = [(s.start_s, next(self._order), i, 0) for i, s in enumerate(sessions)]
        heapq.heapify(self._due)
        self._busy: list[tuple[float, int]] = []
        self._stepping: set[int] = set()
        self._landing: list[tuple[float, int, _Transfer]] = []
        self._retries: list[tuple[float, int, int, _Pull | None]] = []
        # Per replica (decode ones only): requests waiting for room, first come first served.
        self._pending: list[deque[_Pull]] = [deque() for _ in self.replicas]
        # Per replica: sequence id -> what it serves; when its links' sides are free next.
        self._jobs: list[dict[int, _Request | _Transfer]] = [{} for _ in self.replicas]
        self._out_free = [0.0] * len(self.replicas)
        self._in_free = [0.0] * len(self.replicas)
        # Per replica (decode ones only): requests routed to it for a transfer that has not landed
        # (waiting for room included).
        self._inbound = [0] * len(self.replicas)
        self.gaps: list[float] = []
        self.latencies: list[RequestLatency] = []
        self.routes: Counter[str] = Counter()

    def run(self) -> PdResult:
        while self._due or self._busy or self._landing or self._retries:
            kv = self._landing[0][0] if self._landing else math.inf
            step = self._busy[0][0] if self._busy else math.inf
            retry = self._retries[0][0] if self._retries else math.inf
            due = self._due[0][0] if self._due else math.inf
            # At one instant: a retry first (a step's effects apply when it is taken from the heap, at
            # its start, so a step starting now would show the retry blocks it frees only later, and
            # KV landing now leaves blocks evictable that its request is about to use); KV lands
            # before a step starts (the step can admit its request); arrivals last, behind those
            # already waiting.
            if retry <= min(kv, step, due):
                _, _, i, pull = heapq.heappop(self._retries)
                if pull is None or not pull.done:
                    self._admit(i, retry)
            elif kv <= min(step, due):
                self._land(heapq.heappop(self._landing)[2], kv)
            elif step <= due:
                self._step(heapq.heappop(self._busy)[1])
            else:
                _, _, session, turn = heapq.heappop(self._due)
                self._route(due, session, turn)
        stalled = [r.id for i, r in enumerate(self.replicas) if r.engine.has_work() or self._pending[i]]
        if stalled:
            raise RuntimeError(f"replicas {stalled} were left with work that nothing would wake")
        start = min((s.start_s for s in self.sessions), default=0.0)
        end = max(r.clock.now() for r in self.replicas)
        summary = summarize(self.latencies, self.gaps, total_turns(self.sessions), end - start, self.slo)
        return PdResult(self.split, summary, dict(self.routes), tuple(self.latencies))

    # -- routing ----------------------------------------------------------------------------------

    def _route(self, now: float, session: int, turn: int) -> None:
        spec = self.sessions[session].turns[turn]
        tokens = list(spec.prompt)
        request = _Request(session, turn, now, tokens, spec.max_tokens)
        if not self._fits(len(tokens), spec.max_tokens):
            self.routes["rejected"] += 1
            self._answered(session, turn, now)
            return
        bs = self.profile.block_size
        hashes = block_hashes(tokens, bs, self.profile.model_name)
        matched = self.index.match(hashes) if hashes else {}
        route = RouteRequest(
            len(tokens), prefix_key=hashes[0] if hashes else 0, session=self.sessions[session].key or None
        )
        views = [self._view(i, matched) for i in range(len(self.replicas))]
        if self.split.mixed:
            self.routes["mixed"] += 1
            self._start(self._pos[self.mixed_policy.choose(route, views)[0]], request, now)
            return
        pair = self.pd_policy.choose(route, views)[0]
        target = self._pos[pair.decode]
        if pair.prefill is None:
            self.routes["decode_cached"] += 1
            self._start(target, request, now)
            return
        # The decode worker's side (workers.kv_handoff): reserve, wait for room, or compute the
        # prompt itself. A request behind others waiting keeps its place, so only the head tries.
        usable = (len(tokens) - 1) // bs
        pull = _Pull(request, self._pos[pair.prefill], hashes[:usable], now + self.reserve_wait_s)
        queue = self._pending[target]
        queue.append(pull)
        self._inbound[target] += 1
        if 0 < self.reserve_wait_s < math.inf:
            heapq.heappush(self._retries, (pull.deadline_s, next(self._order), target, pull))
        if len(queue) == 1:
            self._admit(target, now)

    def _admit(self, i: int, now: float) -> None:
        """Decode replica i's pending reservations, in order: each that fits starts its prefill, one
        past its deadline is computed here; the first that neither fits nor is due stops the rest.
        Every request waits the same bound, so deadlines are in queue order and the head's is the
        first to pass."""
        queue = self._pending[i]
        block_manager = self.replicas[i].engine.block_manager
        while queue:
            pull = queue[0]
            request = pull.request
            reservation = block_manager.reserve(request.tokens)
            if reservation is None and pull.deadline_s > now:
                return
            queue.popleft()
            pull.done = True
            request.reserve_wait_s = now - request.arrival_s
            if reservation is None or not reservation.blocks:
                if reservation is not None:
                    block_manager.release(reservation)
                self.routes["no_room" if reservation is None else "decode_cached"] += 1
                self._inbound[i] -= 1
                self._start(i, request, now)
                continue
            self.routes["transfer"] += 1
            self._prefill(_Transfer(request, pull.source, i, reservation, pull.hashes), now)

    def _prefill(self, transfer: _Transfer, now: float) -> None:
        """Room is reserved: the prefill replica computes the prompt's reusable blocks."""
        prompt = transfer.request.tokens[: len(transfer.hashes) * self.profile.block_size]
        sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        seq_id = self.replicas[transfer.source].engine.add_request(prompt, sampling)
        self._jobs[transfer.source][seq_id] = transfer
        self._wake(transfer.source, now)

    def _fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Whether a replica could run the request at all (the engine's own checks on adding it),
        decided on arrival as a worker would refuse it, not after its prefill has moved."""
        p = self.profile
        peak_blocks = -(-(prompt_tokens + max_tokens - 1) // p.block_size)
        return prompt_tokens + max_tokens <= p.max_context_len and peak_blocks <= p.num_blocks

    def _view(self, i: int, matched: dict[str, int]) -> ReplicaView:
        """Replica i as the gateway sees it; a decode replica's transfers on their way count as queued
        requests (the gateway has them in flight there), their reserved blocks as used."""
        r = self.replicas[i]
        view = replica_view(r, matched.get(r.id, 0), self.index, self.rate)
        return replace(
            view,
            waiting=view.waiting + self._inbound[i],
            role=self.roles[i],
            free_blocks=r.engine.block_manager.num_free_blocks,
        )

    # -- replicas ---------------------------------------------------------------------------------

    def _start(self, i: int, request: _Request, now: float) -> None:
        """The request whole on replica i, from its cached prefix on: the way a mixed replica, or a
        decode replica after the transfer, serves it."""
        sampling = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
        self._jobs[i][self.replicas[i].engine.add_request(request.tokens, sampling)] = request
        self._wake(i, now)

    def _wake(self, i: int, now: float) -> None:
        """Schedule replica i's next step, if it has work and none is scheduled; an idle replica's
        clock catches up with `now` first."""
        r = self.replicas[i]
        if i in self._stepping or not r.engine.has_work():
            return
        r.clock.advance_to(now)
        self._stepping.add(i)
        heapq.heappush(self._busy, (r.clock.now(), i))

    def _step(self, i: int) -> None:
        self._stepping.discard(i)
        r = self.replicas[i]
        scheduler = r.engine.scheduler
        # A schedule that preempted admits nothing; the second one admits. Both empty: every block
        # the replica could use is held for KV on its way, and the transfer's end wakes it.
        chunks = scheduler.schedule(r.clock.now()) or scheduler.schedule(r.clock.now())
        if not chunks:
            return
        outputs = [StepOutput(slot.seq_id, self.filler) for slot in sample_slots(chunks)]
        r.clock.wait(r.engine.runner.step_time(chunks))
        now = r.clock.now()
        jobs = self._jobs[i]
        for seq in scheduler.update(chunks, outputs, now):
            job = jobs[seq.seq_id]
            if isinstance(job, _Transfer):
                del jobs[seq.seq_id]
                self._send(job, now)
                continue
            self._token(job, now)
            if seq.is_finished:
                del jobs[seq.seq_id]
                self._finish(job, now)
        if self._pending[i]:
            heapq.heappush(self._retries, (now, next(self._order), i, None))
        self._wake(i, now)

    # -- KV transfer ------------------------------------------------------------------------------

    def _send(self, transfer: _Transfer, now: float) -> None:
        """The prefill is done: pin its blocks and put what the decode replica lacks on the link."""
        src, dst = transfer.source, transfer.target
        transfer.held = self.replicas[src].engine.block_manager.hold(transfer.hashes)
        moved = len(transfer.reservation.blocks) * self.profile.block_size * self.profile.kv_bytes_per_token
        start = max(now, self._out_free[src], self._in_free[dst])
        end = start + self.profile.link.time(moved)
        self._out_free[src] = self._in_free[dst] = end
        transfer.request.transfer_s = end - now
        transfer.request.transfer_bytes = moved
        heapq.heappush(self._landing, (end, next(self._order), transfer))

    def _land(self, transfer: _Transfer, now: float) -> None:
        """The KV has arrived: installed at the decode replica, let go at the prefill replica."""
        src, dst = transfer.source, transfer.target
        self.replicas[dst].engine.block_manager.install(
            transfer.reservation, len(transfer.reservation.blocks)
        )
        self.replicas[src].engine.block_manager.unhold(transfer.held)
        self._inbound[dst] -= 1
        self._wake(src, now)
        self._start(dst, transfer.request, now)

    # -- measures ---------------------------------------------------------------------------------

    def _token(self, request: _Request, now: float) -> None:
        if request.first_s is None:
            request.first_s = now
        else:
            gap = now - request.last_s
            self.gaps.append(gap)
            request.max_gap_s = max(request.max_gap_s, gap)
        request.last_s = now
        request.emitted += 1

    def _finish(self, request: _Request, now: float) -> None:
        assert request.first_s is not None
        gaps = request.emitted - 1
        self.latencies.append(
            RequestLatency(
                ttft_s=request.first_s - request.arrival_s,
                mean_itl_s=(request.last_s - request.first_s) / gaps if gaps else None,
                max_itl_s=request.max_gap_s if gaps else None,
                transfer_s=request.transfer_s,
                transfer_bytes=request.transfer_bytes,
                reserve_wait_s=request.reserve_wait_s,
            )
        )
        self._answered(request.session, request.turn, now)

    def _answered(self, session: int, turn: int, now: float) -> None:
        """A turn ended (answered or refused): the session's next one is due after its think time."""
        self._done()
        turns = self.sessions[session].turns
        if turn + 1 < len(turns):
            heapq.heappush(self._due, (now + turns[turn + 1].think_s, next(self._order), session, turn + 1))


def simulate_pd(
    sessions: Sequence[Session],
    profile: Profile,
    split: Split,
    slo: Slo | None = None,
    reserve_wait_s: float = DEFAULT_RESERVE_WAIT_S,
    on_request_done: Callable[[], None] | None = None,
) -> PdResult:
    return PdFleet(
        sessions, profile, split, slo=slo, reserve_wait_s=reserve_wait_s, on_request_done=on_request_done
    ).run()
