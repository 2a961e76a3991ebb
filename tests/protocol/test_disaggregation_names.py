"""The roles a worker announces are the roles the gateway's policies route, and mixed is the old default."""

from __future__ import annotations

from policies import ReplicaView, Role
from protocol.disaggregation import DEFAULT_ROLE, ROLES


def test_the_roles_workers_announce_are_the_roles_policies_route() -> None:
    assert Role.__args__ == ROLES == ("mixed", "prefill", "decode")
    assert ReplicaView.__dataclass_fields__["role"].default == DEFAULT_ROLE
    assert DEFAULT_ROLE == "mixed", "a worker from before roles computes and decodes its own prompts"
