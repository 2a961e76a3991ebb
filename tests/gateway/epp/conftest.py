"""The gateway as Envoy's endpoint picker: in-process gateways with the picker's gRPC services
(`start_gateway(..., picker=True)`), the real Envoy in front of them (bench.envoy), simulated workers
and test backends behind."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.envoy import loopback_config, running_envoy
from protocol.loopback_ports import distinct_ports
from tests.support.fixtures import recording_backend, start_gateway, start_sim_worker

__all__ = ["recording_backend", "start_gateway", "start_sim_worker"]


@pytest.fixture
def start_envoy(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Envoy on the deployed config, in front of `replicas` (ports on 127.0.0.1, or `ip:port`) with the
    picker at `picker_port`; returns its URL."""
    stack: list[Any] = []

    def start(picker_port: int, replicas: list[int | str], picker: bool = True) -> str:
        listen, admin = distinct_ports(2)
        endpoints = [r if isinstance(r, str) else f"127.0.0.1:{r}" for r in replicas]
        config = loopback_config(picker_port, endpoints, listen, admin, picker=picker)
        context = running_envoy(config, tmp_path, name=f"envoy-{len(stack)}")
        url = context.__enter__()
        stack.append(context)
        return url

    yield start
    for context in reversed(stack):
        context.__exit__(None, None, None)
