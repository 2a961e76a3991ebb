"""Replicas discovered from a Kubernetes cluster: list, then watch, the pods an InferencePool selects (and
the pool itself, whose selector and ports can change), or a Service's EndpointSlices.

Every change reconciles the replica set against what the cluster holds now (gateway.fleet.kube_mapping
says which replicas an object stands for): a replica that appears joins, one that leaves, stops being
ready or changes leaves (and rejoins as what it is now). The set is the union over every object, so an
event seen twice, or a relist, adds nobody twice. A watch that breaks resumes from the last
resourceVersion it saw, so nothing is missed; one the server no longer holds history for (410 Gone) is
a relist, reconciled, so what changed meanwhile (pods added, pods deleted) is neither lost nor doubled.
Every `resync_s` the set is listed again anyway, a safety net for a watch that went silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod
from lightkube.resources.discovery_v1 import EndpointSlice

from gateway.fleet.kube_mapping import Entries, Pool, pod_entries, pool_of, slice_entries
from gateway.gateway_config import KubernetesSection, ReplicaEntry
from gateway.rejections import Rejections

log = logging.getLogger("prefixgate.gateway.kubernetes")

InferencePool = create_namespaced_resource(
    "inference.networking.k8s.io", "v1", "InferencePool", "inferencepools"
)
SERVICE_LABEL = "kubernetes.io/service-name"
# Waits between attempts after an error (the API server down, a stream refused), doubling up to the max.
RETRY_MIN_S = 0.1
RETRY_MAX_S = 5.0
# One request to the API server, the watch streams aside (they wait as long as nothing changes).
REQUEST_TIMEOUT_S = 10.0

Join = Callable[[ReplicaEntry], Awaitable[None]]
Leave = Callable[[str, ReplicaEntry], Awaitable[None]]


class Relist(Exception):
    """The watch cannot go on from where it was (410 Gone, or the resync is due): list again."""


def client_for(section: KubernetesSection) -> AsyncClient:
    """A client of the configured API server, else of the cluster the gateway runs in, else of the
    kubeconfig's current context."""
    timeout = httpx2.Timeout(REQUEST_TIMEOUT_S)
    if section.api_server is None:
        return AsyncClient(namespace=section.namespace, timeout=timeout)
    config = KubeConfig.from_one(cluster=Cluster(server=section.api_server), user=User())
    return AsyncClient(config, namespace=section.namespace, timeout=timeout)


class KubernetesReplicas:
    """Keeps the gateway's `kubernetes` replicas what the cluster says: `join` and `leave` (the
    gateway's) are awaited one at a time, in the order the cluster changed."""

    def __init__(
        self,
        section: KubernetesSection,
        join: Join,
        leave: Leave,
        rejections: Rejections,
        current: Entries | None = None,
    ) -> None:
        self.section = section
        self.join = join
        self.leave = leave
        self.rejections = rejections
        # The replicas joined so far, by id: a restarted watcher is handed its predecessor's.
        self.current: Entries = dict(current or {})
        self._client = client_for(section)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        main = self._follow_pool() if self.section.inference_pool is not None else self._follow_service()
        self._task = asyncio.create_task(main, name="kubernetes")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._client.close()

    async def reconcile(self, wanted: Entries) -> None:
        """Make the joined set `wanted`: leave what is gone or changed, then join what is new."""
        for rid, entry in list(self.current.items()):
            if wanted.get(rid) != entry:
                del self.current[rid]
                await self.leave(rid, entry)
        for rid, entry in wanted.items():
            if rid not in self.current:
                self.current[rid] = entry
                await self.join(entry)

    async def _follow_service(self) -> None:
        labels = {SERVICE_LABEL: self.section.service}

        async def changed(slices: dict[str, Entries]) -> None:
            await self.reconcile(_union(slices))

        await self._follow(
            EndpointSlice, labels, lambda s: slice_entries(s, self.section, self.rejections), changed
        )

    async def _follow_pool(self) -> None:
        """Follow the pool; whenever its selector or ports change, follow the pods it selects now."""
        pods: asyncio.Task[None] | None = None
        following: Pool | None = None

        async def changed(pools: dict[str, Pool | None]) -> None:
            nonlocal pods, following
            pool = pools.get(str(self.section.inference_pool))
            if pool == following and pods is not None:
                return
            if pods is not None:
                pods.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pods
                pods = None
            following = pool
            if pool is None:
                log.warning(
                    "InferencePool %s is missing or invalid: no replicas", self.section.inference_pool
                )
                await self.reconcile({})
                return
            log.info("following the pods of InferencePool %s: %s", self.section.inference_pool, pool)
            pods = asyncio.create_task(self._follow_pods(pool), name="kubernetes-pods")

        try:
            fields = {"metadata.name": self.section.inference_pool}
            await self._follow(InferencePool, None, lambda p: pool_of(p, self.rejections), changed, fields)
        finally:
            if pods is not None:
                pods.cancel()

    async def _follow_pods(self, pool: Pool) -> None:
        async def changed(pods: dict[str, Entries]) -> None:
            await self.reconcile(_union(pods))

        await self._follow(
            Pod, pool.labels, lambda p: pod_entries(p, pool.ports, self.section, self.rejections), changed
        )

    async def _follow(
        self,
        kind: Any,
        labels: dict[str, Any] | None,
        meaning: Callable[[Any], Any],
        changed: Callable[[dict[str, Any]], Awaitable[None]],
        fields: dict[str, Any] | None = None,
    ) -> None:
        """List the objects, then watch them, for ever: `changed` sees each object's `meaning` by name
        after the list and after every event. A broken watch resumes from the last resourceVersion
        seen; 410 Gone, and every resync_s, is a relist."""
        namespace, retry = self.section.namespace, RETRY_MIN_S
        while True:
            try:
                listed = self._client.list(kind, namespace=namespace, labels=labels, fields=fields)
                objects = {_name(obj): meaning(obj) async for obj in listed}
                version = listed.resourceVersion
                await changed(objects)
                retry = RETRY_MIN_S
                async with asyncio.timeout(self.section.resync_s):
                    while True:
                        try:
                            stream = self._client.watch(
                                kind,
                                namespace=namespace,
                                labels=labels,
                                fields=fields,
                                resource_version=version,
                            )
                            async for event, obj in stream:
                                version = _version(obj) or version
                                if event in ("ADDED", "MODIFIED"):
                                    objects[_name(obj)] = meaning(obj)
                                elif event == "DELETED":
                                    objects.pop(_name(obj), None)
                                else:
                                    continue  # BOOKMARK: only the version moves on
                                await changed(objects)
                                retry = RETRY_MIN_S
                        except httpx2.HTTPError as error:
                            if _gone(error):
                                raise Relist from None
                            log.info(
                                "watch of %s broke (%r); resuming from %s", kind.__name__, error, version
                            )
                            await asyncio.sleep(retry)
                            retry = min(retry * 2, RETRY_MAX_S)
            except (TimeoutError, Relist):
                log.debug("relisting %s", kind.__name__)
            except Exception as error:  # the API server down, forbidden, garbled: retried
                log.warning("listing %s failed (%r); retrying in %.1f s", kind.__name__, error, retry)
                await asyncio.sleep(retry)
                retry = min(retry * 2, RETRY_MAX_S)


def _gone(error: httpx2.HTTPError) -> bool:
    """410 Gone: as an ERROR event in the stream (a Status), or as the watch request's own answer."""
    if isinstance(error, ApiError) and error.status is not None and error.status.code == 410:
        return True
    return (
        isinstance(error, httpx2.HTTPStatusError)
        and error.response is not None
        and error.response.status_code == 410
    )


def _name(obj: Any) -> str:
    return str(obj.metadata.name) if obj.metadata is not None else ""


def _version(obj: Any) -> str | None:
    return obj.metadata.resourceVersion if obj.metadata is not None else None


def _union(by_object: dict[str, Entries]) -> Entries:
    found: Entries = {}
    for entries in by_object.values():
        found |= entries
    return found
