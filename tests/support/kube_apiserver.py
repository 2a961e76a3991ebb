"""A Kubernetes API server for tests, in-process on 127.0.0.1: pods, EndpointSlices and InferencePools in
the real wire format (lists with metadata.resourceVersion; `?watch=true&resourceVersion=N` streams
newline-delimited events), with what a test needs to provoke a watcher: objects changed under it (each
change bumps one global resourceVersion), watch streams cut, and history expired (a watch from before
it gets an ERROR event with a 410 Status, as a real server answers).

Selectors: labelSelector `k=v` / `k==v` / `k!=v` pairs, fieldSelector `metadata.name=NAME`. A watch with
a label selector sees an object that stops matching as DELETED and one that starts as ADDED, like the
real watch cache.
"""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.support.servers import ServerThread

# The collections served: (API prefix, plural) -> kind.
KINDS = {
    ("api/v1", "pods"): "Pod",
    ("apis/discovery.k8s.io/v1", "endpointslices"): "EndpointSlice",
    ("apis/inference.networking.k8s.io/v1", "inferencepools"): "InferencePool",
}


@dataclass
class _Event:
    version: int
    plural: str
    kind: str
    # The object after the change (for DELETED, as it was), and before it (None: created).
    obj: dict[str, Any]
    old: dict[str, Any] | None
    deleted: bool


@dataclass
class KubeApiServer:
    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    history: list[_Event] = field(default_factory=list)
    version: int = 1
    # Watches from a resourceVersion below this one are answered 410 Gone.
    oldest: int = 1
    # Every request, as (path, query): what a test asserts the watcher asked.
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    # Answer watches with an HTTP 410 rather than a 410 ERROR event.
    gone_as_http: bool = False

    def __post_init__(self) -> None:
        self._changed = asyncio.Condition()
        self._open = asyncio.Event()
        self._open.set()
        # The connections of the open watch streams, to cut.
        self._streams: set[asyncio.BaseTransport] = set()
        app = web.Application()
        app.router.add_get("/{prefix:api/v1|apis/[^/]+/[^/]+}/namespaces/{ns}/{plural}", self._collection)
        app.router.add_get("/{prefix:api/v1|apis/[^/]+/[^/]+}/namespaces/{ns}/{plural}/{name}", self._one)
        self.server = ServerThread(app)
        self.url = ""

    def start(self) -> str:
        self.url = self.server.start()
        return self.url

    def stop(self) -> None:
        self.server.stop()

    # -- what a test does (from its own thread) -------------------------------------------------

    def apply(self, plural: str, obj: dict[str, Any], namespace: str = "default") -> int:
        """Create or replace an object; returns its new resourceVersion."""
        return self._call(self._apply(plural, copy.deepcopy(obj), namespace))

    def delete(self, plural: str, name: str, namespace: str = "default") -> int:
        return self._call(self._delete(plural, name, namespace))

    def cut_watches(self, hold: bool = False) -> None:
        """Break every open watch stream mid-way; `hold`: new watches wait until `release()`."""
        self._call(self._cut(hold))

    def release(self) -> None:
        self._call(self._release())

    def expire_history(self) -> None:
        """Forget every event so far: a watch from an older resourceVersion is told 410 Gone."""
        self._call(self._expire())

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.server.loop).result(10)

    async def _apply(self, plural: str, obj: dict[str, Any], namespace: str) -> int:
        kind = _kind_of(plural)
        meta = obj.setdefault("metadata", {})
        meta["namespace"] = namespace
        key = (plural, namespace, meta["name"])
        old = self.objects.get(key)
        meta.setdefault("uid", f"uid-{meta['name']}")
        obj.update(apiVersion=_api_version(plural), kind=kind)
        return await self._record(plural, key, obj, old)

    async def _delete(self, plural: str, name: str, namespace: str) -> int:
        old = self.objects[(plural, namespace, name)]
        return await self._record(plural, (plural, namespace, name), None, old)

    async def _record(
        self, plural: str, key: Any, obj: dict[str, Any] | None, old: dict[str, Any] | None
    ) -> int:
        async with self._changed:
            self.version += 1
            if obj is None:
                assert old is not None
                del self.objects[key]
                obj = copy.deepcopy(old)
            else:
                self.objects[key] = obj
            obj["metadata"]["resourceVersion"] = str(self.version)
            event = _Event(
                self.version, plural, _kind_of(plural), copy.deepcopy(obj), old, key not in self.objects
            )
            self.history.append(event)
            self._changed.notify_all()
            return self.version

    async def _cut(self, hold: bool) -> None:
        if hold:
            self._open.clear()
        for transport in list(self._streams):
            transport.abort()

    async def _release(self) -> None:
        self._open.set()

    async def _expire(self) -> None:
        self.history.clear()
        self.oldest = self.version

    # -- the API ------------------------------------------------------------------------------

    async def _one(self, request: web.Request) -> web.Response:
        self.requests.append((request.path, dict(request.query)))
        key = (request.match_info["plural"], request.match_info["ns"], request.match_info["name"])
        obj = self.objects.get(key)
        if obj is None:
            return _status(404, "NotFound", f"{key[2]} not found")
        return web.json_response(obj)

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.path, dict(request.query)))
        prefix, plural, ns = (
            request.match_info["prefix"],
            request.match_info["plural"],
            request.match_info["ns"],
        )
        if (prefix, plural) not in KINDS:
            return _status(404, "NotFound", f"the server could not find the requested resource {plural}")
        match = _Selector(request.query.get("labelSelector", ""), request.query.get("fieldSelector", ""))
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, plural, ns, match)
        items = [o for (p, n, _), o in sorted(self.objects.items()) if p == plural and n == ns and match(o)]
        body = {
            "kind": f"{KINDS[(prefix, plural)]}List",
            "apiVersion": _api_version(plural),
            "metadata": {"resourceVersion": str(self.version)},
            "items": items,
        }
        return web.json_response(body)

    async def _watch(
        self, request: web.Request, plural: str, ns: str, match: _Selector
    ) -> web.StreamResponse:
        await self._open.wait()
        since = int(request.query.get("resourceVersion") or self.version)
        if since < self.oldest and self.gone_as_http:
            return _status(410, "Expired", f"too old resource version: {since} ({self.oldest})")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if since < self.oldest:
            gone = {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "code": 410,
                "reason": "Expired",
            }
            gone["message"] = f"too old resource version: {since} ({self.oldest})"
            await response.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            return response
        transport = request.transport
        assert transport is not None
        self._streams.add(transport)
        try:
            seen = since
            while True:
                async with self._changed:
                    await self._changed.wait_for(lambda after=seen: self.version > after)
                    events = [e for e in self.history if e.version > seen and e.plural == plural]
                    seen = self.version
                for event in events:
                    if event.obj["metadata"]["namespace"] != ns:
                        continue
                    kind = _event_type(event, match)
                    if kind is not None:
                        await response.write(json.dumps({"type": kind, "object": event.obj}).encode() + b"\n")
        finally:
            self._streams.discard(transport)


def pod(name: str, ip: str, ready: bool = True, app: str = "one", **annotations: str) -> dict[str, Any]:
    """A running pod at `ip`, labelled `app`, ready or not."""
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    meta = {"name": name, "labels": {"app": app}, "annotations": annotations}
    return {
        "metadata": meta,
        "spec": {"containers": []},
        "status": {"phase": "Running", "podIP": ip, "conditions": conditions},
    }


def pool(name: str, app: str, port: int) -> dict[str, Any]:
    """An InferencePool selecting the pods labelled `app`, served on `port`."""
    return {
        "metadata": {"name": name},
        "spec": {"selector": {"matchLabels": {"app": app}}, "targetPorts": [{"number": port}]},
    }


def _event_type(event: _Event, match: _Selector) -> str | None:
    """What a watch through `match` sees of a change: an object moving in or out of it is ADDED or DELETED."""
    was = event.old is not None and match(event.old)
    if event.deleted:
        return "DELETED" if was else None
    if match(event.obj):
        return "MODIFIED" if was else "ADDED"
    return "DELETED" if was else None


class _Selector:
    def __init__(self, labels: str, fields: str) -> None:
        self.labels = [part for part in labels.split(",") if part]
        self.fields = [part for part in fields.split(",") if part]

    def __call__(self, obj: dict[str, Any]) -> bool:
        have = obj["metadata"].get("labels") or {}
        for part in self.labels:
            if "!=" in part:
                key, value = part.split("!=", 1)
                if have.get(key) == value:
                    return False
            else:
                key, value = part.replace("==", "=").split("=", 1)
                if have.get(key) != value:
                    return False
        for part in self.fields:
            key, value = part.replace("==", "=").split("=", 1)
            if key != "metadata.name" or obj["metadata"].get("name") != value:
                return False
        return True


def _kind_of(plural: str) -> str:
    return next(kind for (_, p), kind in KINDS.items() if p == plural)


def _api_version(plural: str) -> str:
    prefix = next(prefix for prefix, p in KINDS if p == plural)
    return prefix.removeprefix("api/").removeprefix("apis/")


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason}
    return web.json_response({**body, "code": code}, status=code)
