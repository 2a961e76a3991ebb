"""The gateway's lifecycle: the background work that keeps what requests read (gateway.gateway_state)
true — replicas joining and leaving, health, load, the index kept in sync, and config reloads.

Everything here runs on one asyncio loop, which is what makes the index, the replica set and the
policy safe to share with requests without locks. Replicas come from three places — the YAML list, the Redis
registry and the admin API — and all go through `activate` and `deactivate`, so the index, the KV
sync and the metrics always agree on who exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import aiohttp
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.collector import Pauses, freeze_long_lived, space_young_collections, thaw
from gateway.fleet.discovery import Probe, ProbeFailed, fetch_load, probe, read_registry
from gateway.fleet.predictions import Predictions
from gateway.fleet.replicas import Replica, Source
from gateway.fleet.response_owners import ResponseOwners
from gateway.forward.upstream_client import UpstreamClient
from gateway.gateway_config import TEXT_SPEC, GatewayConfig, ReplicaEntry
from gateway.gateway_state import GatewayState, tokenizers_of
from gateway.sync.bundled_events import IndexSync
from gateway.sync.zmq_events import ZmqSource, ZmqSync
from protocol.cancellation import check_cancelled
from protocol.redis_client import connect
from radix.capacity import capacity_prior

if TYPE_CHECKING:
    from gateway.fleet.kubernetes import KubernetesReplicas
    from gateway.sync.siblings import Siblings

log = logging.getLogger("prefixgate.gateway")

REDIS_TIMEOUT_S = 5.0


class Gateway:
    """The lifecycle around a GatewayState: what requests read (`state`), and what keeps it true."""

    def __init__(self, config: GatewayConfig, gateway_id: str, siblings: Siblings | None = None) -> None:
        self.state = GatewayState(config, gateway_id)
        # The other processes of a `serve --workers N` (None: this process is the gateway).
        self.siblings = siblings
        # Static and admin-added entries not yet answering (probed every health interval).
        self.pending: dict[str, tuple[ReplicaEntry, Source]] = {}
        # Health checks, load reads and the KV followers' own HTTP; requests go by `state.upstream`.
        self.session: aiohttp.ClientSession
        self.redis: Redis | None = None
        self.sync: IndexSync
        # Replicas configured with `kv_events`: their vLLM-format KV events followed over ZMQ.
        self.zmq_sync: ZmqSync
        # Whether the last registry read reached Redis (None: no Redis configured).
        self.redis_ok: bool | None = None
        # Registry replicas missing from the last registry reads, and since when (monotonic).
        self._unlisted: dict[str, float] = {}
        # The replicas of the `kubernetes` section, watched from the cluster (None: not configured).
        self.kubernetes: KubernetesReplicas | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # The garbage collector's pauses while this gateway runs (gateway.collector).
        self.pauses = Pauses()
        self.state.metrics.watch_collector(self.pauses)
        self._started = False

    async def start(self) -> None:
        limits = self.state.config.limits
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=limits.connect_timeout_s),
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            auto_decompress=False,
            # A replica's Set-Cookie is for the client it answered: a jar would send it on upstream
            # with every other client's requests.
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self.state.upstream = UpstreamClient()
        if self.state.config.redis is not None:
            # The workers' fail-fast client: a read on a dead or restarted server errors out (and the
            # follower backs off) instead of waiting forever; above XREAD's block time.
            self.redis = connect(self.state.config.redis.url, REDIS_TIMEOUT_S, decode_responses=True)
            self.redis_ok = False
        rejections = self.state.metrics.rejections
        self.sync = IndexSync(self.state.index, self.session, self.redis, rejections=rejections)
        self.zmq_sync = ZmqSync(self.state.index, rejections=rejections)
        self.state.predictions = Predictions(
            self.state.index,
            ttl_s=self.state.config.approximate.ttl_s,
            redis=self.redis,
            gateway_id=self.state.gateway_id,
            rejections=rejections,
        )
        self.state.predictions.start()
        responses = self.state.config.responses
        self.state.response_owners = ResponseOwners(
            ttl_s=responses.ttl_s, max_entries=responses.max_entries, redis=self.redis
        )
        if self.siblings is not None:
            await self.siblings.start(self)
        for entry in self.state.config.replicas:
            self.pending[entry.url] = (entry, "config")
        await self._probe_pending()
        # Ready means ready: every model known now can be tokenized before the first request comes.
        await self.state.tokenizers.load(self.known_models())
        self._spawn(self._health_loop, self.state.config.health.interval_s)
        self._watch_kubernetes()
        if self.redis is not None:
            self._spawn(self._registry_loop, self.state.config.redis.poll_interval_s)
        else:
            self._spawn(self._load_loop, self.state.config.health.load_interval_s)
        collector = self.state.config.collector
        space_young_collections(collector.young_threshold)
        if collector.freeze:
            freeze_long_lived()
        self.pauses.install()
        self._started = True

    async def close(self) -> None:
        self.pauses.uninstall()
        if self.state.config.collector.freeze:
            thaw()
        if self.siblings is not None:
            await self.siblings.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.kubernetes is not None:
            await self.kubernetes.close()
        await self.sync.close()
        await self.zmq_sync.close()
        await self.state.predictions.close()
        await self.session.close()
        self.state.upstream.close()
        if self.redis is not None:
            await self.redis.aclose()
        self.state.tokenizers.close()

    def _spawn(self, step: Callable[[], Awaitable[None]], period_s: float) -> None:
        async def loop() -> None:
            while True:
                check_cancelled()
                await asyncio.sleep(period_s)
                try:
                    await step()
                except Exception:
                    log.exception("background step %s failed; retrying next period", step.__name__)

        self._tasks.append(asyncio.create_task(loop(), name=step.__name__))

    # -- replicas -----------------------------------------------------------------------------

    def activate(self, found: Probe, source: Source) -> Replica:
        config = self.state.config
        # A model routed on its text matches no KV event's token blocks: its replicas are predicted.
        text = config.tokenizer_for(found.model) == TEXT_SPEC
        if text and found.kv_events is not None:
            log.error(
                "replica %s: model %r is routed on its text; its KV events are not followed",
                found.id,
                found.model,
            )
        approximate = self.state.approximate_everywhere or text
        # Configured KV events are followed whatever the kind: the operator named them.
        events = None if approximate else found.kv_events
        precise = events is not None or (found.kind == "bundled" and not approximate)
        replica = Replica(
            id=found.id,
            url=found.url,
            kind=found.kind,
            model=found.model,
            block_size=found.block_size,
            capacity_blocks=found.capacity_blocks,
            max_context_len=found.max_context_len,
            source=source,
            prefill_rate=config.learning.prefill_rate_prior,
            max_waiting=found.max_waiting,
            incarnation=found.incarnation,
            role=found.role,
            pd_protocol=found.pd_protocol,
            bootstrap_port=found.bootstrap_port,
            precise=precise,
        )
        self.state.replicas.add(replica)
        self.state.tokenizers.ensure(replica.model)
        # A predicted replica's capacity is learned; a foreign backend's configured one is a guess.
        prior = None if precise else capacity_prior(replica.capacity_blocks, guessed=replica.kind == "openai")
        self.state.index.add_replica(replica.id, capacity_blocks=prior, learn=not precise)
        if self._started and config.collector.freeze:
            freeze_long_lived()  # its index, which grows for as long as it serves, with the rest
        if events is not None:
            self.zmq_sync.start(
                replica.id, replica.model, replica.block_size, ZmqSource(events, found.kv_events_replay)
            )
        elif precise:
            self.sync.start(replica.id, replica.url)
        log.info(
            "replica %s joined: %s %s %s at %s (%s)",
            replica.id,
            replica.kind,
            replica.role,
            replica.model,
            replica.url,
            source,
        )
        return replica

    async def deactivate(self, replica_id: str) -> Replica | None:
        replica = self.state.replicas.remove(replica_id)
        if replica is None:
            return None
        self.sync.stop(replica_id)
        self.zmq_sync.stop(replica_id)
        self.state.index.drop_replica(replica_id)
        self.state.metrics.forget_replica(replica_id, replica.model)
        log.info("replica %s left", replica_id)
        return replica

    async def add_entry(self, entry: ReplicaEntry, source: Source) -> Replica | None:
        """Probe a replica and activate it; if it does not answer yet, keep probing it. A pending entry
        withdrawn while it was probed (a reload dropped it, its pod left) is not activated."""
        was_pending = self.pending.get(entry.url)
        try:
            found: Probe | ProbeFailed = await probe(self.session, entry, self.state.config.health.timeout_s)
        except ProbeFailed as error:
            found = error
        if was_pending is not None and self.pending.get(entry.url) is not was_pending:
            return None
        if isinstance(found, ProbeFailed):
            log.warning("replica %s is not answering yet: %s", entry.url, found)
            self.pending.setdefault(entry.url, (entry, source))
            return None
        self.pending.pop(entry.url, None)
        existing = self.state.replicas.get(found.id) or self.state.replicas.by_url(found.url)
        if existing is not None:
            return existing
        _check_announced(entry, found)
        return self.activate(found, source)

    def _watch_kubernetes(self, current: dict[str, ReplicaEntry] | None = None) -> None:
        section = self.state.config.kubernetes
        if section is None:
            return
        from gateway.fleet.kubernetes import KubernetesReplicas  # lightkube: an optional extra

        rejections = self.state.metrics.rejections
        self.kubernetes = KubernetesReplicas(section, self._join_pod, self._leave_pod, rejections, current)
        self.kubernetes.start()

    async def _join_pod(self, entry: ReplicaEntry) -> None:
        self.pending[entry.url] = (entry, "kubernetes")
        await self.add_entry(entry, "kubernetes")

    async def _leave_pod(self, replica_id: str, entry: ReplicaEntry) -> None:
        """A pod deleted, or no longer ready: it gets no new request from now on."""
        if self.pending.get(entry.url, (None, None))[1] == "kubernetes":
            del self.pending[entry.url]
        replica = self.state.replicas.get(replica_id)
        if replica is not None and replica.source == "kubernetes":
            await self.deactivate(replica_id)

    async def _probe_pending(self) -> None:
        await asyncio.gather(*(self.add_entry(entry, src) for entry, src in list(self.pending.values())))

    async def _check(self, replica: Replica) -> None:
        entry = ReplicaEntry(url=replica.url, id=replica.id, kind=replica.kind, model=replica.model)
        try:
            found = await probe(self.session, entry, self.state.config.health.timeout_s)
        except ProbeFailed:
            self.state.mark_failure(replica)
            return
        followed = self.sync.states.get(replica.id)
        if followed is not None and followed.incarnation not in (None, found.incarnation):
            # A restarted worker lost its cache: forget it now, before the replica is routable again,
            # rather than when its KV follower notices the new incarnation.
            self.state.index.clear(replica.id)
            log.info("replica %s restarted (incarnation %s)", replica.id, found.incarnation)
        if not replica.healthy:
            log.info("replica %s is healthy again", replica.id)
        replica.failures = 0
        replica.healthy = True
        replica.down_since = None
        replica.incarnation = found.incarnation
        replica.max_waiting = found.max_waiting
        if replica.kind == "bundled" and replica.role != found.role:
            # Restarted with another --role: routed as what it is now.
            log.info("replica %s is now a %s worker (was %s)", replica.id, found.role, replica.role)
            replica.role = found.role

    async def _health_loop(self) -> None:
        await asyncio.gather(self._probe_pending(), *(self._check(r) for r in self.state.replicas.all()))

    async def _load_loop(self) -> None:
        timeout_s = self.state.config.health.timeout_s

        async def one(replica: Replica) -> None:
            # A silent replica keeps its last report: the health check decides what silence means.
            with contextlib.suppress(ProbeFailed):
                replica.report = await fetch_load(self.session, replica.url, timeout_s)

        await asyncio.gather(*(one(r) for r in self.state.replicas.all() if r.kind == "bundled"))

    async def _registry_loop(self) -> None:
        assert self.redis is not None
        try:
            registered = await read_registry(self.redis, self.state.metrics.rejections)
        except RedisError as error:
            # Keep routing on what is known; the KV followers and predictions back off on their own.
            if self.redis_ok:
                log.warning("Redis is unreachable, routing on the local index: %r", error)
            self.redis_ok = False
            # Idle connections opened before an outage are dead after it (Redis restarted): dropped now,
            # so the first reads after it come back do not each fail once on one of them.
            await self.redis.connection_pool.disconnect(inuse_connections=False)
            return
        if not self.redis_ok:
            log.info("Redis is reachable")
        self.redis_ok = True
        live = set()
        for item in registered:
            live.add(item.probe.id)
            replica = self.state.replicas.get(item.probe.id) or self.state.replicas.by_url(item.probe.url)
            if replica is None:
                replica = self.activate(item.probe, "registry")
            if item.load is not None and item.load.at > replica.report.at:
                replica.report = item.load
        now = time.monotonic()
        grace = self.state.config.redis.registry_grace_s if self.state.config.redis is not None else 0.0
        for rid in [rid for rid in self._unlisted if rid in live or rid not in self.state.replicas]:
            del self._unlisted[rid]
        for replica in self.state.replicas.all():
            if replica.source != "registry" or replica.id in live:
                continue
            # Unlisted: it left (deregistered, or its heartbeat expired), or Redis lost the registry.
            # A replica that still answers its health checks gets the grace to re-register.
            since = self._unlisted.setdefault(replica.id, now)
            if not replica.healthy or now - since >= grace:
                await self.deactivate(replica.id)

    async def reload(self, config: GatewayConfig) -> None:
        """Apply a new config without dropping requests in flight: they hold their replica objects,
        and removed replicas only stop receiving new requests."""
        tokenizers = tokenizers_of(config)
        watched = self.state.config.kubernetes
        self.state.configure(config)
        await tokenizers.load(self.known_models())
        self.state.tokenizers.close()
        self.state.tokenizers = tokenizers
        urls = {e.url for e in config.replicas}
        for replica in self.state.replicas.all():
            if replica.source == "config" and replica.url not in urls:
                await self.deactivate(replica.id)
        for url, (_, source) in list(self.pending.items()):
            if source == "config" and url not in urls:
                del self.pending[url]
        for entry in config.replicas:
            if self.state.replicas.by_url(entry.url) is None:
                self.pending[entry.url] = (entry, "config")
        await self._probe_pending()
        if config.kubernetes != watched:
            current = None
            if self.kubernetes is not None:
                await self.kubernetes.close()
                current, self.kubernetes = self.kubernetes.current, None
            if config.kubernetes is None:
                for replica_id, entry in (current or {}).items():
                    await self._leave_pod(replica_id, entry)
            # The new watcher reconciles its predecessor's replicas against its first list.
            self._watch_kubernetes(current)
        log.info(
            "configuration reloaded: %d replicas, policy %s", len(self.state.replicas), self.state.policy.name
        )

    def known_models(self) -> list[str]:
        """The models configured or served by a replica known now."""
        named = set(self.state.config.models) | set(self.state.replicas.models())
        if self.state.config.model is not None:
            named.add(self.state.config.model)
        return sorted(named)

    def refresh_metrics(self) -> None:
        m = self.state.metrics
        m.index_entries.set(len(self.state.index))
        m.inflight.set(self.state.inflight)
        if self.redis_ok is not None:
            m.redis_up.set(1 if self.redis_ok else 0)
        for r in self.state.replicas.all():
            m.replica_healthy.labels(r.id, r.model).set(1 if r.routable else 0)
            m.replica_inflight.labels(r.id).set(len(r.inflight))
            m.replica_prefill_rate.labels(r.id).set(r.prefill_rate)
            capacity = self.state.index.capacity_of(r.id) if r.id in self.state.index.replicas else None
            if capacity is not None:
                m.replica_capacity.labels(r.id).set(capacity)
        for rid, state in (self.sync.states | self.zmq_sync.states).items():
            m.sync_lag.labels(rid).set(state.lag_s())
            m.sync_resyncs.labels(rid).set(state.resyncs)


def _check_announced(entry: ReplicaEntry, found: Probe) -> None:
    """A bundled worker's own role wins over the entry's: it is what the worker does whatever the YAML
    says. A disagreement is a configuration mistake, logged as an error for the operator to fix."""
    if found.kind != "bundled":
        return
    if "role" in entry.model_fields_set and entry.role != found.role:
        log.error(
            "replica %s: the config says role %s but the worker announces %s; routing it as %s (fix the "
            "entry's role, or the worker's --role)",
            entry.url,
            entry.role,
            found.role,
            found.role,
        )
    if entry.pd_protocol is not None:
        log.error(
            "replica %s is a prefixgate worker: its pd_protocol %s is ignored (bundled workers move KV "
            "their own way)",
            entry.url,
            entry.pd_protocol,
        )
