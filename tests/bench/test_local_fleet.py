"""Ports for local fleets: free, and never where the kernel puts the local ports of outgoing connections."""

from __future__ import annotations

import socket

from bench.local_fleet import _ephemeral_floor, free_port
from tests.support.servers import distinct_ports


def test_a_free_port_is_bindable_and_below_the_ephemeral_range() -> None:
    floor = _ephemeral_floor()
    for _ in range(50):
        port = free_port()
        assert 1024 <= port < floor
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_picked() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        taken = held.getsockname()[1]
        assert taken not in {free_port() for _ in range(500)}
    assert len(set(distinct_ports(20))) == 20
