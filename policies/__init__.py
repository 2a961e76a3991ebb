"""Pure routing policies (DESIGN §5), each a choice over a read-only view of the replicas."""

from policies.config import ConfigError, PolicyName, RoutingConfig, build_policy, parse_routing
from policies.view import Policy, ReplicaView, RouteRequest

POLICY_NAMES: tuple[str, ...] = PolicyName.__args__

__all__ = [
    "POLICY_NAMES",
    "ConfigError",
    "Policy",
    "ReplicaView",
    "RouteRequest",
    "RoutingConfig",
    "build_policy",
    "parse_routing",
]
