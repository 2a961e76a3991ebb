"""`make docker-smoke`'s fleet (docker/smoke/compose.yaml) holds together without Docker: it runs the
images docker/compose.yaml builds, every service on the host's loopback at a port of its own, its
gateway config loads and names the smoke Redis, and its Prometheus scrapes that gateway and workers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from gateway.gateway_config import load_config

DOCKER = Path(__file__).resolve().parents[2] / "docker"
SMOKE = DOCKER / "smoke"


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def test_the_smoke_fleet_runs_the_built_images_on_loopback_ports_of_their_own() -> None:
    built = {s["image"] for s in load(DOCKER / "compose.yaml")["services"].values() if "build" in s}
    services = load(SMOKE / "compose.yaml")["services"]
    assert {s["image"] for s in services.values()} <= built, "the smoke fleet runs an image no build makes"
    assert all(s["network_mode"] == "host" for s in services.values())
    assert all("ports" not in s and "build" not in s for s in services.values())
    config = load_config(SMOKE / "gateway.yaml")
    assert config.listen.host == "127.0.0.1" and config.replicas == []
    redis_port = int(services["redis"]["command"][services["redis"]["command"].index("--port") + 1])
    assert config.redis is not None and config.redis.url.startswith(f"redis://127.0.0.1:{redis_port}/")
    workers = {n: s["environment"] for n, s in services.items() if s["image"].startswith("prefixgate-worker")}
    assert len(workers) == 2
    for env in workers.values():
        assert env["PREFIXGATE_REDIS_URL"] == config.redis.url
        assert env["PREFIXGATE_WORKER_HOST"] == env["PREFIXGATE_ADVERTISE_HOST"] == "127.0.0.1"
    worker_ports = {int(env["PREFIXGATE_WORKER_PORT"]) for env in workers.values()}
    listen = services["prometheus"]["command"]
    (prometheus_port,) = [
        int(m) for arg in listen for m in re.findall(r"listen-address=127\.0\.0\.1:(\d+)", arg)
    ]
    ports = [redis_port, config.listen.port, prometheus_port, *worker_ports]
    assert len(ports) == len(set(ports)) == 5, f"two services share a port: {ports}"
    jobs = {
        j["job_name"]: j["static_configs"][0]["targets"]
        for j in load(SMOKE / "prometheus.yml")["scrape_configs"]
    }
    assert jobs["prefixgate-gateway"] == [f"127.0.0.1:{config.listen.port}"]
    assert sorted(jobs["prefixgate-worker"]) == [f"127.0.0.1:{port}" for port in sorted(worker_ports)]
