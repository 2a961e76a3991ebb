"""Replicas as Envoy names them: `ip:port` endpoints, which the picker answers in and a subset hint asks
in. Envoy's override-host balancer reads addresses only, so a replica whose URL names a host by name
cannot be picked (discovery from Kubernetes gives pods' addresses)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

# Where the picker names its choice: a request header, and the same value in Envoy's dynamic metadata
# under the load balancer's namespace (the endpoint picker protocol of the Gateway API Inference
# Extension). The value is a comma-separated list, the first choice first, then the fallbacks.
DESTINATION = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
# Where Envoy may restrict the choice: a list of endpoints in the request's filter metadata.
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"


def endpoint_of(url: str) -> str | None:
    """`ip:port` of a replica's URL (`[ip6]:port`), or None when its host is a name or it has no port."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        address = ipaddress.ip_address(parts.hostname or "")
    except ValueError:
        return None
    if port is None:
        return None
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


def destination(endpoints: Iterable[str]) -> str:
    return ",".join(endpoints)
