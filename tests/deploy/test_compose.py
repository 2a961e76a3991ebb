"""The deployment files hold together without Docker: the compose file names the fleet the issue asks
for, everything it builds from or mounts exists (and survives each Dockerfile's .dockerignore), the
gateway config it mounts loads, Prometheus scrapes services and ports that compose exposes, Grafana's
provisioning finds the datasource and the dashboard, the gateway image's weightless model folder still
tokenizes, and the worker entrypoint starts a worker that registers under the address it computed."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from gateway.gateway_config import load_config
from protocol.models import default_gguf_path, load_tokenizer_spec
from protocol.redis_keys import worker_key
from tests.support.servers import free_port
from workers.engine.loader import convert_gguf, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
GRAFANA = ROOT / "configs" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "prefixgate.json"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = load_yaml(COMPOSE)
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def replicas(service: dict[str, Any]) -> int:
    return int((service.get("deploy") or {}).get("replicas", 1))


def command_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command") or []
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def bind_mounts(service: dict[str, Any]) -> list[tuple[Path, str]]:
    """(host path in the repo, container path) of each bind mount; named volumes are skipped."""
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append(((DOCKER / source).resolve(), target))
    return mounts


def container_path(service: dict[str, Any], inside: str) -> Path | None:
    """The repo file a container sees at `inside`, through the service's bind mounts."""
    for host, target in bind_mounts(service):
        if inside == target or inside.startswith(target.rstrip("/") + "/"):
            return host / os.path.relpath(inside, target)
    return None


def container_ports(service: dict[str, Any]) -> set[int]:
    ports = {int(str(p)) for p in service.get("expose", [])}
    ports |= {int(str(p).split(":")[-1].split("/")[0]) for p in service.get("ports", [])}
    return ports


def gateway_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose["services"].items() if command_of(s)[:1] == ["serve"]}


def worker_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        n: s
        for n, s in compose["services"].items()
        if "Dockerfile.worker" in (s.get("build") or {}).get("dockerfile", "")
    }


def test_the_compose_file_runs_redis_two_gateways_two_workers_prometheus_and_grafana(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    assert {"redis", "prometheus", "grafana"} <= services.keys()
    assert sum(replicas(s) for s in gateway_services(compose).values()) == 2
    assert sum(replicas(s) for s in worker_services(compose).values()) == 2
    for name, service in {**gateway_services(compose), **worker_services(compose)}.items():
        assert "redis" in service.get("depends_on", {}), f"{name} starts before Redis"


def test_every_build_and_bind_mount_names_a_file_in_the_repo(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        if "build" in service:
            context = (DOCKER / service["build"]["context"]).resolve()
            assert context == ROOT, f"{name}: build from the repository root"
            assert (context / service["build"]["dockerfile"]).is_file(), name
        else:
            assert "image" in service, f"{name} has neither build nor image"
        for host, _ in bind_mounts(service):
            assert host.exists(), f"{name} mounts {host}, which does not exist"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name}: volume {source} is not declared"


def test_the_gpu_override_swaps_the_workers_for_the_cuda_image(compose: dict[str, Any]) -> None:
    override = load_yaml(DOCKER / "compose.gpu.yaml")["services"]
    assert set(override) <= set(compose["services"]), "the override names a service compose lacks"
    worker = override["worker"]
    assert (ROOT / worker["build"]["dockerfile"]).name == "Dockerfile.worker-cuda"
    assert (DOCKER / worker["build"]["context"]).resolve() == ROOT
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices and all("gpu" in d["capabilities"] for d in devices)


def dockerfile_copies(dockerfile: Path) -> list[str]:
    """Sources of each COPY from the build context (COPY --from copies between stages)."""
    sources = []
    for line in dockerfile.read_text().replace("\\\n", " ").splitlines():
        words = line.split()
        if words[:1] != ["COPY"]:
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if not any(w.startswith("--from=") for w in words[1:]):
            sources.extend(args[:-1])
    return sources


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, enough for an allowlist: the last matching pattern wins, `!` re-includes, and a
    pattern that matches a folder covers what is inside it."""
    verdict = False
    parts = path.split("/")
    for pattern in patterns:
        negated = pattern.startswith("!")
        glob = pattern.lstrip("!").strip("/")
        if glob.startswith("**/"):
            hit = any(fnmatch.fnmatchcase(part, glob[3:]) for part in parts)
        else:
            hit = any(fnmatch.fnmatchcase("/".join(parts[:i]), glob) for i in range(1, len(parts) + 1))
        if hit:
            verdict = not negated
    return verdict


@pytest.mark.parametrize("name", ["Dockerfile.gateway", "Dockerfile.worker", "Dockerfile.worker-cuda"])
def test_dockerfile_copy_sources_exist_and_reach_the_build(name: str) -> None:
    dockerfile = DOCKER / name
    ignore = DOCKER / f"{name}.dockerignore"
    patterns = [
        line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    sources = dockerfile_copies(dockerfile)
    assert "pyproject.toml" in sources
    for source in sources:
        assert (ROOT / source).exists(), f"{name}: COPY {source}: no such file in the repo"
        assert not ignored(source, patterns), f"{name}: COPY {source} is excluded by {ignore.name}"
    # What the image runs must reach it: the gateway and what it imports; a worker image, everything.
    pyproject = (ROOT / "pyproject.toml").read_text()
    needed = ["radix", "policies", "protocol", "gateway", "prefixgate"]
    if name != "Dockerfile.gateway":
        needed += ["workers", "bench"]
    for package in needed:
        assert f'"{package}*"' in pyproject and package in sources, f"{name} misses {package}/"
    assert ignored(".venv/bin/python", patterns) and ignored("tests/conftest.py", patterns)
    # The wheelhouse (docker/wheelhouse.sh) reaches the build as a bind mount, not a layer.
    for mount in re.findall(r"--mount=type=bind,source=([^,\s]+)", dockerfile.read_text()):
        assert not ignored(f"{mount}/torch.whl", patterns), f"{name}: the mount of {mount} is excluded"


def test_the_mounted_gateway_config_loads_and_discovers_workers_through_redis(
    compose: dict[str, Any],
) -> None:
    for name, service in gateway_services(compose).items():
        command = command_of(service)
        path = container_path(service, command[command.index("--config") + 1])
        assert path is not None and path.is_file(), f"{name}: its --config is not a mounted repo file"
        config = load_config(path)
        assert config.listen.host == "0.0.0.0" and config.listen.port in container_ports(service)
        assert config.redis is not None and config.redis.url.startswith("redis://redis:")
        assert config.replicas == [], "compose gateways discover workers from the Redis registry"
        env = service.get("environment", {})
        assert {config.auth.api_keys_env, config.auth.admin_token_env} <= set(env), name
    for name, service in worker_services(compose).items():
        assert service["environment"]["PREFIXGATE_REDIS_URL"].startswith("redis://redis:"), name


def test_prometheus_scrapes_services_and_ports_that_compose_exposes(compose: dict[str, Any]) -> None:
    services = compose["services"]
    path = container_path(services["prometheus"], "/etc/prometheus/prometheus.yml")
    assert path == ROOT / "configs" / "prometheus.yml"
    scrape = load_yaml(path)["scrape_configs"]
    targets: list[tuple[str, int]] = []
    for job in scrape:
        for static in job.get("static_configs", []):
            targets += [(t.rsplit(":", 1)[0], int(t.rsplit(":", 1)[1])) for t in static["targets"]]
        for dns in job.get("dns_sd_configs", []):
            targets += [(n, int(dns["port"])) for n in dns["names"]]
    scraped = {host for host, _ in targets}
    assert set(gateway_services(compose)) <= scraped and set(worker_services(compose)) <= scraped
    for host, port in targets:
        assert host in services, f"scrape target {host} is no compose service"
        assert port in container_ports(services[host]), f"{host} does not expose {port}"


def provisioned(folder: Path, key: str) -> list[dict[str, Any]]:
    """The entries under `key` of every provisioning file in the folder (Grafana reads them all)."""
    files = sorted(folder.glob("*.yaml"))
    assert files, f"no provisioning files in {folder}"
    return [entry for file in files for entry in load_yaml(file)[key]]


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    provisioning = container_path(grafana, "/etc/grafana/provisioning")
    assert provisioning == GRAFANA / "provisioning"
    sources = provisioned(provisioning / "datasources", "datasources")
    assert [d["type"] for d in sources] == ["prometheus"]
    assert sources[0]["url"] == "http://prometheus:9090"
    assert 9090 in container_ports(compose["services"]["prometheus"])
    providers = provisioned(provisioning / "dashboards", "providers")
    assert providers
    for provider in providers:
        folder = container_path(grafana, provider["options"]["path"])
        assert folder is not None and (folder / DASHBOARD.name).is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert container_path(grafana, home) == DASHBOARD


def test_every_dashboard_panel_queries_the_provisioned_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {d["uid"] for d in provisioned(GRAFANA / "provisioning" / "datasources", "datasources")}
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel["datasource"]["uid"] in uids, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target.get("datasource", panel["datasource"])["uid"] in uids, panel["title"]


def test_the_gateway_image_installs_no_torch_and_tokenizes_from_the_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dockerfile.gateway installs the gateway alone (with uvloop, the endpoint picker's gRPC and the
    Kubernetes client: the `fast`, `epp` and `kubernetes` extras, and no other) and
    reads the default tokenizer from the GGUF into its cache at build time: the same ids as the worker's
    converted folder, with no weights at all."""
    dockerfile = (DOCKER / "Dockerfile.gateway").read_text().replace("\\\n", " ")
    installs = [line for line in dockerfile.splitlines() if line.startswith("RUN") and "pip install" in line]
    extras = {extra for line in installs for extra in re.findall(r"\[([^\]]*)\]", line)}
    extras = {name for extra in extras for name in extra.split(",")}
    assert installs and not any("torch" in line for line in installs), installs
    assert extras <= {"fast", "epp", "kubernetes"}, installs
    assert "default_tokenizer()" in dockerfile
    monkeypatch.setenv("PREFIXGATE_CACHE", str(tmp_path / "cache"))
    tokenizer = load_tokenizer_spec("default")
    assert tokenizer is not None
    assert not list((tmp_path / "cache").rglob("*.safetensors"))
    converted = convert_gguf(default_gguf_path())  # the worker tests' cache; converted once if missing
    text = "Hello world, <|im_start|>user\nhéllo 東京 🦙<|im_end|>"
    assert tokenizer.encode(text) == load_tokenizer(converted).encode(text)


def test_the_worker_entrypoint_registers_a_worker_named_by_its_address(redis_url: str) -> None:
    """The compose workers' entrypoint, run here with its address lookup and a private Redis database;
    it binds loopback here (PREFIXGATE_WORKER_HOST) instead of every interface."""
    port = free_port()
    address = socket.gethostbyname(socket.gethostname())
    worker_redis = redis_url.rsplit("/", 1)[0] + "/6"
    env = {
        **os.environ,
        # The image has `python` and `prefixgate` on PATH; here they are this interpreter's neighbours.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PREFIXGATE_WORKER_HOST": "127.0.0.1",
        "PREFIXGATE_WORKER_PORT": str(port),
        "PREFIXGATE_REDIS_URL": worker_redis,
    }
    env.pop("PREFIXGATE_ADVERTISE_HOST", None)
    script = DOCKER / "worker-entrypoint.sh"
    assert os.access(script, os.X_OK), "worker-entrypoint.sh must be executable"
    args = ["--sim", "--sim-profile", "h100-8b", "--log-level", "WARNING"]
    proc = subprocess.Popen([str(script), *args], env=env)
    registry = redis.Redis.from_url(worker_redis, decode_responses=True)
    key = worker_key(f"{address}:{port}")
    try:
        deadline = time.monotonic() + 45
        while not (entry := registry.hgetall(key)):
            assert proc.poll() is None, f"the entrypoint exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"no worker registered as {key}"
            time.sleep(0.2)
        assert entry["url"] == f"http://{address}:{port}"
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["worker_id"] == entry["id"]
    finally:
        proc.terminate()
        proc.wait(10)
        registry.flushdb()
        registry.close()
