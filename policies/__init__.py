"""Pure routing policies (docs/design.md §5), each a choice over a read-only view of the replicas."""

from policies.pd import Pair, PdConfig, PrefillDecode
from policies.routing_config import (
    ConfigError,
    PolicyName,
    RoutingConfig,
    build_pd,
    build_policy,
    parse_routing,
)
from policies.view import Policy, ReplicaView, Role, RouteRequest

POLICY_NAMES: tuple[str, ...] = PolicyName.__args__

__all__ = [
    "POLICY_NAMES",
    "ConfigError",
    "Pair",
    "PdConfig",
    "Policy",
    "PrefillDecode",
    "ReplicaView",
    "Role",
    "RouteRequest",
    "RoutingConfig",
    "build_pd",
    "build_policy",
    "parse_routing",
]
