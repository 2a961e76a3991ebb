"""The processes of one `bench replay --sim-fleet` row: fresh simulated workers (empty caches) and,
over them, a gateway configured as the row says or a peer router, all ready before the row's replay
starts and all stopped after it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import yaml

from bench.local_fleet import LocalFleet, cli, spawn, stop, wait_ready, worker_command
from bench.peers import peer_router
from bench.replay_rows import FleetWorkers, Mode, row_gateway_config
from protocol.loopback_ports import free_port


@contextlib.contextmanager
def row_workers(
    workdir: Path, workers: FleetWorkers, kv_events: bool = False
) -> Iterator[tuple[LocalFleet, list[str]]]:
    """Fresh workers (empty caches), all ready, and (with `kv_events`) the endpoints where each
    publishes its KV events in vLLM's wire format, for a router that follows them. Stopped on the
    way out, with whatever else was added to the fleet."""
    workdir.mkdir(parents=True, exist_ok=True)
    fleet, endpoints = LocalFleet([], None), []
    try:
        for i in range(workers.spec.count):
            port = free_port()
            command = [*worker_command(workers.spec, f"w{i}", port), *workers.flags]
            if kv_events:
                endpoints.append(f"tcp://127.0.0.1:{free_port()}")
                command += [
                    "--kv-events-zmq",
                    endpoints[-1],
                    "--kv-events-replay",
                    f"tcp://127.0.0.1:{free_port()}",
                ]
            fleet.workers.append(spawn(f"worker-w{i}", command, f"http://127.0.0.1:{port}", workdir))
        wait_ready(fleet)
        yield fleet, endpoints
    finally:
        stop(fleet.children)


@contextlib.contextmanager
def row_fleet(
    workdir: Path,
    workers: FleetWorkers,
    policy: str,
    mode: Mode,
    pool: tuple[int, int],
    text: bool = False,
    prefix_aware: Mapping[str, float] | None = None,
) -> Iterator[str]:
    """Fresh workers (empty caches) and a gateway over them with the row's policy and mode, all ready;
    yields the gateway's URL and stops everything on the way out."""
    with row_workers(workdir, workers) as (fleet, _):
        port = free_port()
        config = workdir / "gateway.yaml"
        urls = [w.url for w in fleet.workers]
        model = workers.spec.model
        gateway = row_gateway_config(model, urls, policy, mode, pool, port, text, prefix_aware)
        config.write_text(yaml.safe_dump(gateway))
        command = cli("serve", "--config", str(config), "--log-level", "WARNING")
        fleet.gateway = spawn("gateway", command, f"http://127.0.0.1:{port}", workdir)
        try:
            wait_ready(fleet)
            yield fleet.gateway.url
        finally:
            stop([fleet.gateway])


@contextlib.contextmanager
def peer_fleet(workdir: Path, workers: FleetWorkers, router: str) -> Iterator[str]:
    """Fresh workers and the peer router over them, all ready; yields the router's URL. Workers
    publish KV events for the router that follows them (kv_aware)."""
    kv_aware = router.endswith("kv_aware")
    with row_workers(workdir, workers, kv_events=kv_aware) as (fleet, endpoints):
        urls = [w.url for w in fleet.workers]
        events = endpoints if kv_aware else None
        model = workers.spec.model
        with peer_router(
            router, urls, workdir, kv_events=events, block_size=workers.block_size, model=model
        ) as url:
            yield url
