"""Picking a loopback port for a server about to start (local fleets, tests, the expert-parallel
rendezvous): one nothing holds, and none that an outgoing connection could take first."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ports free_port picks among, just below the ephemeral range.
_PORTS_BELOW_EPHEMERAL = 12_000


def free_port() -> int:
    """A loopback port nothing is bound to now, below the kernel's ephemeral range: one from that range
    (the kernel's own pick) can be taken, before its server binds it, as the local port of any outgoing
    connection (a gateway's, a health probe's), which once kept a fleet test's worker from starting;
    below it, the race is only with other starters, spread by the random pick."""
    floor = ephemeral_floor()
    for _ in range(200):
        port = random.randrange(max(1024, floor - _PORTS_BELOW_EPHEMERAL), floor)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in the {_PORTS_BELOW_EPHEMERAL} below {floor}")


def distinct_ports(count: int) -> list[int]:
    """Loopback ports nothing listens on now, all different (free_port)."""
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return list(ports)


def ephemeral_floor() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's default when it cannot say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
