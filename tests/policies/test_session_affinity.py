"""session_affinity: sticky, and stable under fleet changes (consistent hashing)."""

from __future__ import annotations

from policies import ReplicaView, RouteRequest
from policies.session_affinity import SessionAffinity


def ids(n: int) -> list[ReplicaView]:
    return [ReplicaView(id=f"r{i}") for i in range(n)]


def assignment(policy: SessionAffinity, replicas: list[ReplicaView], sessions: int = 2000) -> dict[str, str]:
    return {
        f"user-{s}": policy.choose(RouteRequest(10, session=f"user-{s}"), replicas)[0]
        for s in range(sessions)
    }


def test_sessions_stick_and_spread() -> None:
    policy = SessionAffinity()
    first = assignment(policy, ids(4))
    assert first == assignment(policy, ids(4))
    counts = {rid: list(first.values()).count(rid) for rid in ("r0", "r1", "r2", "r3")}
    assert min(counts.values()) > 300


def test_leaving_replica_moves_only_its_own_sessions() -> None:
    policy = SessionAffinity()
    before = assignment(policy, ids(5))
    after = assignment(policy, [r for r in ids(5) if r.id != "r2"])
    moved = {s for s in before if before[s] != after[s]}
    assert moved == {s for s in before if before[s] == "r2"}


def test_joining_replica_takes_about_its_share() -> None:
    policy = SessionAffinity()
    before = assignment(policy, ids(4))
    after = assignment(policy, ids(5))
    moved = [s for s in before if before[s] != after[s]]
    assert all(after[s] == "r4" for s in moved)
    assert 0.1 < len(moved) / len(before) < 0.3


def test_unhealthy_replica_falls_back_then_recovers() -> None:
    policy = SessionAffinity()
    request = RouteRequest(10, session="alice")
    home = policy.choose(request, ids(3))
    sick = [ReplicaView(id=r.id, healthy=r.id != home[0]) for r in ids(3)]
    assert policy.choose(request, sick) == home[1:]
    assert policy.choose(request, ids(3)) == home


def test_no_session_key_falls_back_to_least_load() -> None:
    replicas = [ReplicaView(id="busy", running=5), ReplicaView(id="idle")]
    assert SessionAffinity().choose(RouteRequest(10), replicas)[0] == "idle"
