"""Fixtures shared by several test folders, defined once here and imported by each folder's conftest.py
(a fixture is seen by the tests under the conftest that names it): simulated workers and gateways
served in-process, recording foreign backends, and `fleet` for workers or gateways that must be
processes of their own (to be stopped, killed, or measured)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.local_fleet import Fleet
from gateway.epp.serve import grpc_service
from gateway.gateway_config import parse_config
from gateway.http.app import create_app
from prefixgate.cli import build_parser
from tests.support.gateways import (
    SIM_MODEL,
    Answers,
    RecordingBackend,
    RunningGateway,
    SimWorker,
    sim_worker_args,
)
from tests.support.servers import ServerThread, free_port
from workers.worker_app import create_app as create_worker_app
from workers.worker_cli import build_worker, extra_contexts


@pytest.fixture
def start_sim_worker() -> Iterator[Callable[..., SimWorker]]:
    servers: list[ServerThread] = []

    def start(worker_id: str, *extra: str, port: int | None = None, host: str = "127.0.0.1") -> SimWorker:
        port = port or free_port()
        args = build_parser().parse_args(sim_worker_args(worker_id, port, *extra))
        worker = build_worker(args)
        server = ServerThread(create_worker_app(worker, contexts=extra_contexts(args)), port=port, host=host)
        servers.append(server)
        return SimWorker(server.start(), worker_id, worker, server, port)

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def start_gateway() -> Iterator[Callable[..., RunningGateway]]:
    """In-process gateways; `picker=True` adds the endpoint picker's gRPC services (gateway.epp) on a
    port of their own (RunningGateway.grpc_port)."""
    servers: list[ServerThread] = []

    def start(
        urls: list[str], wait_for: int | None = None, picker: bool = False, **config: Any
    ) -> RunningGateway:
        data = {
            "replicas": [{"url": u} for u in urls],
            "models": {SIM_MODEL: {"tokenizer": "default"}},
            "health": {"interval_s": 0.2, "load_interval_s": 0.05},
            # Gateways in the test runner's own interpreter leave its collector unfrozen: each freeze
            # collects the whole runner first (tests/gateway/test_collector.py passes collector={}).
            "collector": {"freeze": False},
            **config,
        }
        app = create_app(parse_config(data))
        grpc_port = free_port() if picker else None
        if grpc_port is not None:
            app.cleanup_ctx.append(grpc_service("127.0.0.1", grpc_port))
        server = ServerThread(app)
        servers.append(server)
        running = RunningGateway(server.start(), app, server, grpc_port)
        running.wait_routable(len(urls) if wait_for is None else wait_for)
        return running

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def recording_backend() -> Iterator[Callable[..., tuple[RecordingBackend, str]]]:
    started: list[RecordingBackend] = []

    def start(
        name: str,
        model: str = "foreign-m",
        answers: Answers | None = None,
    ) -> tuple[RecordingBackend, str]:
        backend = RecordingBackend(name, model, answers or {})
        started.append(backend)
        return backend, backend.server.start()

    yield start
    for backend in started:
        backend.server.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Child processes started by bench.local_fleet helpers (`fleet.add(...)`), all stopped after the test
    (SIGCONT first, for one left stopped)."""
    with Fleet(tmp_path / "fleet") as running:
        yield running
