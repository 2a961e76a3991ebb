"""The replicas a gateway routes to, as it believes them to be: identity, health, and load.

Load has two parts. A replica reports its queue (over HTTP, or through Redis) every fraction of a
second; between reports the gateway adds what it has itself placed there since, so a burst of
arrivals does not all pile onto the replica that looked idle at the last report. Requests still
running are in the next report, so only those dispatched after the report's time are added. That sum
is kept as requests come, start and end (Unreported), and counted afresh only when a report arrives:
a routing decision reads every replica's load, and a scan of its requests in flight for each would
cost a decision time in proportion to the fleet's concurrency.

With `serve --workers N` the gateway is N processes routing as one: each tells the others what it
placed (gateway.sync.siblings), and their requests count in a replica's load beside its own.

Pure state, no I/O: discovery (gateway.fleet.discovery) and the request path update it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from policies import ReplicaView, Role
from radix.reports import ReportedUnit

# The weight of one TTFT in a replica's speed: about the last 1 / SPEED_ALPHA TTFTs count. One TTFT's
# tokens per second swing twofold between replicas of one kind (decode steps, batching), and a rate
# of a few of them made identical replicas look 30 % apart in most decisions (docs/benchmarks.md).
SPEED_ALPHA = 0.02

Kind = Literal["bundled", "openai"]
Source = Literal["config", "registry", "admin", "kubernetes"]


@dataclass(slots=True)
class LoadReport:
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    # Gateway monotonic time the report describes; requests dispatched later are not in it.
    at: float = float("-inf")


@dataclass(slots=True)
class InFlight:
    dispatched: float
    # Prompt tokens this request adds to the replica's prefill queue until its first token.
    prefill_tokens: int
    # Prefill work queued ahead of it when it was placed: what its TTFT also paid for.
    queued_ahead: int
    started: bool = False
    # The replica's index tick when this request's prompt was recorded as predicted there (None: not
    # recorded): until its first token, blocks recorded since may not be computed yet.
    recorded_tick: int | None = None
    # KV blocks the request's uncached prompt takes there (computed or transferred).
    kv_blocks: int = 0


@dataclass(slots=True)
class Unreported:
    """What the gateway placed on a replica after its last report: requests running and waiting, the
    waiting ones' prefill tokens, and the KV blocks all of them take."""

    running: int = 0
    waiting: int = 0
    queued: int = 0
    kv_blocks: int = 0

    def add(self, req: InFlight) -> None:
        self.kv_blocks += req.kv_blocks
        if req.started:
            self.running += 1
        else:
            self.waiting += 1
            self.queued += req.prefill_tokens

    def remove(self, req: InFlight) -> None:
        self.kv_blocks -= req.kv_blocks
        if req.started:
            self.running -= 1
        else:
            self.waiting -= 1
            self.queued -= req.prefill_tokens


@dataclass(slots=True)
class Replica:
    id: str
    url: str
    kind: Kind
    model: str
    block_size: int
    # KV blocks: a bundled worker's pool, or a foreign backend's configured prior (None: none given).
    capacity_blocks: int | None
    max_context_len: int
    source: Source
    prefill_rate: float
    # TTFTs the prefill rate was learned from (gateway.forward.router pools the rates of replicas with few).
    rate_samples: int = 0
    # The same TTFTs' prefill work and seconds, averaged over many (SPEED_ALPHA): their ratio is the
    # replica's speed, which tells another kind of replica from noise (gateway.forward.router.routing_rates).
    speed_work: float = 0.0
    speed_seconds: float = 0.0
    max_waiting: int = 256
    incarnation: str | None = None
    healthy: bool = True
    draining: bool = False
    failures: int = 0
    # Gateway monotonic time this replica last went unhealthy (None while healthy).
    down_since: float | None = None
    _report: LoadReport = field(default_factory=LoadReport)
    # Requests in flight here, by handle (ReplicaSet.dispatched), and the sibling processes' by
    # (sibling, its handle): changed through ReplicaSet, which keeps `_unreported` their sum.
    inflight: dict[int, InFlight] = field(default_factory=dict)
    sibling_inflight: dict[tuple[int, int], InFlight] = field(default_factory=dict)
    _unreported: Unreported = field(default_factory=Unreported)
    # (recorded tick, handle) of own requests recorded in the index and placed here, a min-heap whose
    # entries for requests since started or ended are dropped when they reach its top (pending_horizon).
    _recorded: list[tuple[int, int]] = field(default_factory=list)
    # Prefill/decode disaggregation (policies.pd): its role, how a foreign one moves KV to its pair
    # (None: prefixgate's own), and an SGLang prefill server's bootstrap port.
    role: Role = "mixed"
    pd_protocol: str | None = None
    bootstrap_port: int | None = None
    # Its KV block in its own tokens, from the cached tokens it reports (radix.reports).
    reported: ReportedUnit = field(default_factory=ReportedUnit)
    # Whether its index entries are exact, from its KV events (a bundled worker's, or followed over
    # ZMQ), else predictions of the gateway's: decided when it joins, as its KV follower is started.
    precise: bool = False

    @property
    def speed(self) -> float:
        """Prefill tokens per second over its last ~1 / SPEED_ALPHA TTFTs, as a ratio of sums, so that a
        short TTFT caught between two decode steps weighs as little as it lasted (0: none yet)."""
        return self.speed_work / self.speed_seconds if self.speed_seconds > 0 else 0.0

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    @property
    def report(self) -> LoadReport:
        return self._report

    @report.setter
    def report(self, report: LoadReport) -> None:
        """A new report: the requests it covers (dispatched by its time) leave the gateway's own sum."""
        self._report = report
        self._unreported = Unreported()
        for req in itertools.chain(self.inflight.values(), self.sibling_inflight.values()):
            self.add_unreported(req)

    def load(self) -> tuple[int, int, int]:
        """(running, waiting, queued prefill tokens): the last report plus the gateway's own since."""
        own, report = self._unreported, self._report
        return (
            report.running + own.running,
            report.waiting + own.waiting,
            report.queued_prefill_tokens + own.queued,
        )

    def free_blocks(self) -> int | None:
        """KV blocks no sequence holds, as last reported less what the gateway placed there since (None:
        not reported, as for a foreign backend)."""
        report = self._report
        if report.kv_blocks_total <= 0:
            return None
        return max(report.kv_blocks_total - report.kv_blocks_used - self._unreported.kv_blocks, 0)

    def add_unreported(self, req: InFlight) -> None:
        if req.dispatched > self._report.at:
            self._unreported.add(req)

    def remove_unreported(self, req: InFlight) -> None:
        if req.dispatched > self._report.at:
            self._unreported.remove(req)

    def mark_started(self, req: InFlight) -> None:
        self.remove_unreported(req)
        req.started = True
        self.add_unreported(req)

    def view(self, matched_blocks: int, cached_blocks: int, prefill_rate: float) -> ReplicaView:
        """What a policy sees: this request's match, the load, how many blocks the index holds for the
        replica in all (how full its cache is believed to be), and the prefill rate to route by."""
        running, waiting, queued = self.load()
        return ReplicaView(
            id=self.id,
            healthy=self.routable,
            block_size=self.block_size,
            matched_blocks=matched_blocks,
            running=running,
            waiting=waiting,
            queued_prefill_tokens=queued,
            max_waiting=self.max_waiting,
            prefill_rate=prefill_rate,
            cached_blocks=cached_blocks,
            role=self.role,
            free_blocks=self.free_blocks(),
            pd_protocol=self.pd_protocol,
            local_prefill=not (self.role == "decode" and self.pd_protocol == "sglang"),
        )

    def pending_horizon(self) -> float:
        """Of the requests in flight here (radix.capacity.pending_horizon), read off a heap rather than a
        scan of them all: it is read at every decision and every answer."""
        recorded, inflight = self._recorded, self.inflight
        while recorded:
            req = inflight.get(recorded[0][1])
            if req is not None and not req.started:
                return recorded[0][0]
            heapq.heappop(recorded)
        return math.inf

    def add_recorded(self, handle: int, req: InFlight) -> None:
        if req.recorded_tick is None:
            return
        heapq.heappush(self._recorded, (req.recorded_tick, handle))
        if len(self._recorded) > 2 * len(self.inflight) + 64:  # ended requests under a long-waiting top
            self._recorded = [
                (r.recorded_tick, h)
                for h, r in self.inflight.items()
                if r.recorded_tick is not None and not r.started
            ]
            heapq.heapify(self._recorded)

    def to_json(self) -> dict[str, object]:
        running, waiting, queued = self.load()
        return {
            "id": self.id,
            "url": self.url,
            "kind": self.kind,
            "role": self.role,
            "pd_protocol": self.pd_protocol,
            "model": self.model,
            "block_size": self.block_size,
            "capacity_blocks": self.capacity_blocks,
            "max_context_len": self.max_context_len,
            "source": self.source,
            "incarnation": self.incarnation,
            "precise": self.precise,
            "healthy": self.healthy,
            "draining": self.draining,
            "inflight": len(self.inflight),
            "sibling_inflight": len(self.sibling_inflight),
            "load": {"running": running, "waiting": waiting, "queued_prefill_tokens": queued},
            "prefill_rate": round(self.prefill_rate, 1),
        }


def default_replica_id(url: str) -> str:
    parts = urlsplit(url)
    return parts.netloc or url


# What a process tells its siblings of its own accounting: ("dispatched", replica id, handle, time,
# prefill tokens, KV blocks), ("started", replica id, handle), ("finished", replica id, handle).
Announce = Callable[[tuple[object, ...]], None]


class ReplicaSet:
    """Replicas by id, grouped by model at lookup time (groups are small; no second map to keep)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Replica] = {}
        self._request_ids = itertools.count(1)
        # Set by gateway.sync.siblings when this process has siblings.
        self.announce: Announce | None = None

    def __contains__(self, replica_id: str) -> bool:
        return replica_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, replica_id: str) -> Replica | None:
        return self._by_id.get(replica_id)

    def all(self) -> list[Replica]:
        """By id: listings and metrics come out in a stable order whatever order replicas joined in."""
        return sorted(self._by_id.values(), key=lambda r: r.id)

    def by_url(self, url: str) -> Replica | None:
        return next((r for r in self._by_id.values() if r.url == url), None)

    def add(self, replica: Replica) -> None:
        if replica.id in self._by_id:
            raise ValueError(f"replica {replica.id!r} is already registered")
        self._by_id[replica.id] = replica

    def remove(self, replica_id: str) -> Replica | None:
        return self._by_id.pop(replica_id, None)

    def models(self) -> list[str]:
        return sorted({r.model for r in self._by_id.values()})

    def serving(self, model: str) -> list[Replica]:
        """Every replica of the model, routable or not: the policy skips unhealthy views itself."""
        return sorted((r for r in self._by_id.values() if r.model == model), key=lambda r: r.id)

    # -- the request path's accounting --------------------------------------------------------

    def dispatched(
        self,
        replica: Replica,
        now: float,
        prefill_tokens: int,
        recorded_tick: int | None = None,
        kv_blocks: int = 0,
    ) -> int:
        """Record a request placed on `replica`, which computes `prefill_tokens` of its prompt and takes
        `kv_blocks` more KV blocks; returns the handle for `started` and `finished`."""
        handle = next(self._request_ids)
        queued = replica.load()[2]
        req = InFlight(now, prefill_tokens, queued, recorded_tick=recorded_tick, kv_blocks=kv_blocks)
        replica.inflight[handle] = req
        replica.add_unreported(req)
        replica.add_recorded(handle, req)
        if self.announce is not None:
            self.announce(("dispatched", replica.id, handle, now, prefill_tokens, kv_blocks))
        return handle

    def started(self, replica: Replica, handle: int, ttft_s: float, *, alpha: float, min_tokens: int) -> None:
        """The first token arrived: learn the prefill rate from how long that took (docs/design.md §5)."""
        req = replica.inflight.get(handle)
        if req is None or req.started:
            return
        replica.mark_started(req)
        if self.announce is not None:
            self.announce(("started", replica.id, handle))
        work = req.prefill_tokens + req.queued_ahead
        if req.prefill_tokens >= min_tokens and ttft_s > 0:
            replica.prefill_rate += alpha * (work / ttft_s - replica.prefill_rate)
            replica.rate_samples += 1
            replica.speed_work += SPEED_ALPHA * (work - replica.speed_work)
            replica.speed_seconds += SPEED_ALPHA * (ttft_s - replica.speed_seconds)

    def finished(self, replica: Replica, handle: int) -> None:
        req = replica.inflight.pop(handle, None)
        if req is None:
            return
        replica.remove_unreported(req)
        if self.announce is not None:
            self.announce(("finished", replica.id, handle))

    # -- the siblings' accounting (gateway.sync.siblings) --------------------------------------

    def sibling_dispatched(
        self, sibling: int, replica_id: str, handle: int, at: float, prefill_tokens: int, kv_blocks: int
    ) -> None:
        """A sibling placed a request here at `at` (monotonic: one clock for every process of a host)."""
        replica = self._by_id.get(replica_id)
        if replica is None:
            return
        req = InFlight(at, prefill_tokens, 0, kv_blocks=kv_blocks)
        old = replica.sibling_inflight.get((sibling, handle))
        if old is not None:  # announced twice: the later one stands
            replica.remove_unreported(old)
        replica.sibling_inflight[sibling, handle] = req
        replica.add_unreported(req)

    def sibling_started(self, sibling: int, replica_id: str, handle: int) -> None:
        replica = self._by_id.get(replica_id)
        req = replica.sibling_inflight.get((sibling, handle)) if replica is not None else None
        if replica is not None and req is not None and not req.started:
            replica.mark_started(req)

    def sibling_finished(self, sibling: int, replica_id: str, handle: int) -> None:
        replica = self._by_id.get(replica_id)
        req = replica.sibling_inflight.pop((sibling, handle), None) if replica is not None else None
        if replica is not None and req is not None:
            replica.remove_unreported(req)

    def sibling_gone(self, sibling: int) -> None:
        """A sibling exited: its requests ended with it."""
        for replica in self._by_id.values():
            for key in [k for k in replica.sibling_inflight if k[0] == sibling]:
                replica.remove_unreported(replica.sibling_inflight.pop(key))
