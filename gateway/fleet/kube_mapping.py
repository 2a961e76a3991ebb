"""What a Kubernetes object means for the replica set: a pod, or an EndpointSlice, as the replicas it
stands for (none while it is not ready), and an InferencePool as the pods it selects and their ports.

Pure functions over lightkube's objects, apart from gateway.fleet.kubernetes's watch I/O. What the
cluster holds is input like a client's: an annotation anybody with edit rights on a pod can set, or a
pool spec, is validated with bounds, and one that fails costs that pod or that pool (skipped, counted in
gateway.rejections), never the watch.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from pydantic import ValidationError

from gateway.fleet.discovery import MAX_BLOCK_SIZE, MAX_NAME_CHARS, MAX_URL_CHARS
from gateway.gateway_config import KubernetesSection, ReplicaEntry
from gateway.rejections import Rejections

if TYPE_CHECKING:
    from lightkube.resources.core_v1 import Pod
    from lightkube.resources.discovery_v1 import EndpointSlice

# A replica's entry by its id (the pod's name, with the port when the pod serves on several).
Entries = dict[str, ReplicaEntry]

ANNOTATION = "prefixgate.io/"
# Where the pod IP goes in a KV events annotation (tcp://{ip}:5557).
IP_PLACEHOLDER = "{ip}"
# A pool selecting more ports than this, or more labels, is no pool of inference servers.
MAX_TARGET_PORTS = 8
MAX_SELECTOR_LABELS = 32
# Kubernetes' own limits: a label key (with its prefix) and a label value.
MAX_LABEL_KEY_CHARS = 317
MAX_LABEL_VALUE_CHARS = 63

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
Endpoint = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_URL_CHARS)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class _Annotations(msgspec.Struct):
    """A pod's prefixgate.io/* annotations (values are strings: numbers in decimal)."""

    kind: Literal["openai", "bundled"] | None = msgspec.field(name="prefixgate.io/kind", default=None)
    model: Name | None = msgspec.field(name="prefixgate.io/model", default=None)
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)] | None = msgspec.field(
        name="prefixgate.io/block-size", default=None
    )
    kv_events: Endpoint | None = msgspec.field(name="prefixgate.io/kv-events", default=None)
    kv_events_replay: Endpoint | None = msgspec.field(name="prefixgate.io/kv-events-replay", default=None)


class _TargetPort(msgspec.Struct):
    number: Port


class _Selector(msgspec.Struct):
    matchLabels: Annotated[
        dict[
            Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_LABEL_KEY_CHARS)],
            Annotated[str, msgspec.Meta(max_length=MAX_LABEL_VALUE_CHARS)],
        ],
        msgspec.Meta(min_length=1, max_length=MAX_SELECTOR_LABELS),
    ]


class _PoolSpec(msgspec.Struct):
    selector: _Selector
    targetPorts: Annotated[list[_TargetPort], msgspec.Meta(min_length=1, max_length=MAX_TARGET_PORTS)]


@dataclass(frozen=True, slots=True)
class Pool:
    """What an InferencePool says: the labels of its pods, and the ports they serve on."""

    labels: dict[str, str]
    ports: tuple[int, ...]


_INVALID = (msgspec.ValidationError, TypeError, ValueError)


def pool_of(obj: Mapping[str, Any], rejections: Rejections) -> Pool | None:
    """An InferencePool's selector and target ports, or None (counted) when its spec is not one."""
    try:
        spec = msgspec.convert(obj.get("spec"), _PoolSpec)
    except _INVALID as error:
        rejections.reject("kubernetes", f"InferencePool {_name_of(obj)!r:.80}", error)
        return None
    return Pool(dict(spec.selector.matchLabels), tuple(dict.fromkeys(p.number for p in spec.targetPorts)))


def pod_entries(
    pod: Pod, ports: tuple[int, ...], section: KubernetesSection, rejections: Rejections
) -> Entries:
    """The replicas a pod stands for, one per port: none while it is not ready (running, with an IP, not
    being deleted, its Ready condition True), and none (counted) when its annotations are invalid."""
    meta, status = pod.metadata, pod.status
    if meta is None or not meta.name or meta.deletionTimestamp is not None or status is None:
        return {}
    ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
    if status.phase != "Running" or not ready or not status.podIP:
        return {}
    what = f"pod {meta.namespace or section.namespace}/{meta.name:.80}"
    try:
        ip = ipaddress.ip_address(status.podIP)
        found = msgspec.convert(
            {k: v for k, v in (meta.annotations or {}).items() if k.startswith(ANNOTATION)},
            _Annotations,
            strict=False,
        )
        return _entries(meta.name, ip, _ports(ports, section), section, found)
    except (*_INVALID, ValidationError) as error:
        rejections.reject("kubernetes", what, error)
        return {}


def slice_entries(endpoints: EndpointSlice, section: KubernetesSection, rejections: Rejections) -> Entries:
    """The ready endpoints of a Service's EndpointSlice, one replica per endpoint and port (named after
    the pod behind it, else its address). A slice carries no pod annotations: the section's settings
    apply to all."""
    ports = tuple(p.port for p in endpoints.ports or [] if p.port is not None and p.protocol in (None, "TCP"))
    found: Entries = {}
    for endpoint in endpoints.endpoints or []:
        conditions = endpoint.conditions
        # Kubernetes: a ready condition left unset means ready; a terminating endpoint is not.
        if conditions is not None and (conditions.ready is False or conditions.terminating):
            continue
        for address in endpoint.addresses[:1]:
            target = endpoint.targetRef
            name = target.name if target is not None and target.name else address
            try:
                ip = ipaddress.ip_address(address)
                if len(name) > MAX_NAME_CHARS:
                    raise ValueError("names an object with too long a name")
                found |= _entries(name, ip, _ports(ports, section), section, _Annotations())
            except (*_INVALID, ValidationError) as error:
                rejections.reject("kubernetes", f"EndpointSlice endpoint {address!r:.80}", error)
    return found


def _ports(ports: tuple[int, ...], section: KubernetesSection) -> tuple[int, ...]:
    return (section.port,) if section.port is not None else ports


def _entries(
    name: str,
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
    ports: tuple[int, ...],
    section: KubernetesSection,
    found: _Annotations,
) -> Entries:
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    events = None if found.kv_events is None else found.kv_events.replace(IP_PLACEHOLDER, host)
    replay = None if found.kv_events_replay is None else found.kv_events_replay.replace(IP_PLACEHOLDER, host)
    entries = {}
    for port in ports:
        rid = name if len(ports) == 1 else f"{name}:{port}"
        entry = ReplicaEntry(
            url=f"http://{host}:{port}",
            id=rid,
            kind=found.kind or section.kind,
            model=found.model or section.model,
            kv_events=events,
            kv_events_replay=replay,
            **({"block_size": found.block_size} if found.block_size is not None else {}),
        )
        entries[rid] = entry
    return entries


def _name_of(obj: Mapping[str, Any]) -> object:
    meta = obj.get("metadata")
    return meta.get("name") if isinstance(meta, dict) else None
