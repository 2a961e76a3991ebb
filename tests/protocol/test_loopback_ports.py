"""Ports for servers about to start: bindable, never where the kernel puts outgoing connections'
local ports, never one in use."""

from __future__ import annotations

import socket

from protocol.loopback_ports import ephemeral_floor, free_port
from tests.support.servers import distinct_ports


def test_a_free_port_is_bindable_and_below_the_ephemeral_range() -> None:
    floor = ephemeral_floor()
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
