"""Every query of the Grafana dashboard returns data from a real Prometheus scraping a real fleet.

The fleet is two simulated workers and a gateway sharing state through Redis, as in docker/compose.yaml;
Prometheus runs with configs/prometheus.yml itself, its service discovery pointed at these processes
(job names and relabelling as deployed, so the worker `replica` label is the deployed one). Traffic
comes in two rounds, one before Prometheus's first scrape and one after, so that every counter has moved
between two samples and rates, ratios and quantiles come out as numbers rather than NaN. A refused
request and a worker killed under traffic fill the error panel."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from redis import Redis

from bench.probes import wait_for
from tests.support.gateways import SIM_MODEL, RunningGateway, SimWorker, sim_worker_args
from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_YML = ROOT / "configs" / "prometheus.yml"
DASHBOARD = ROOT / "configs" / "grafana" / "dashboards" / "prefixgate.json"
INSTALL_HINT = (
    "is not installed: run `make test` (as root it installs Debian's package), "
    "or `apt-get install prometheus`"
)
# Grafana's variables, made concrete: the window spans both traffic rounds and many 1 s scrapes.
WINDOW = "1m"
VARIABLES = {"$__rate_interval": WINDOW, "$__interval": "1s", "$__range": WINDOW}
PREFIXES = [[1000 + 97 * p + (7 * i) % 20_000 for i in range(160)] for p in range(3)]


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} {INSTALL_HINT}")
    return path


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title / legend, PromQL with Grafana's variables substituted) for every target."""
    queries = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"{panel['title']}: unknown variable in {expr}"
            queries.append((f"{panel['title']} / {target.get('legendFormat', '')}", expr))
    return queries


def scrape_config(gateways: list[str], workers: list[str]) -> dict[str, Any]:
    """configs/prometheus.yml scraping this test's processes every second."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    targets = {"prefixgate-gateway": gateways, "prefixgate-worker": workers}
    for job in config["scrape_configs"]:
        assert job["job_name"] in targets, f"a job this test does not know: {job['job_name']}"
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    return config


@contextmanager
def running_prometheus(config: dict[str, Any], workdir: Path) -> Iterator[str]:
    """A private Prometheus on a free loopback port, its storage in workdir, stopped on exit."""
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    log = (workdir / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary("prometheus"),
            f"--config.file={config_file}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: ready(url, proc, workdir), "Prometheus to be ready", timeout=30, interval=0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def ready(url: str, proc: subprocess.Popen[bytes], workdir: Path) -> bool:
    if proc.poll() is not None:
        log = (workdir / "prometheus.log").read_text()
        pytest.fail(f"prometheus exited with {proc.returncode}:\n{log[-2000:]}")
    try:
        return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def has_numbers(result: list[dict[str, Any]]) -> bool:
    """Some series with a finite value: a NaN (0/0, a quantile of nothing) is no data to a reader."""
    return any(math.isfinite(float(series["value"][1])) for series in result)


def traffic(gateway: RunningGateway) -> dict[int, str]:
    """One round: shared-prefix completions (two per prefix, so the second hits the cache), a streamed
    one, and a refused one. Returns the replica that served each prefix last."""
    served = {}
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        for p, prefix in enumerate(PREFIXES):
            for suffix in range(2):
                body = {"model": SIM_MODEL, "prompt": [*prefix, 5, 6 + suffix], "max_tokens": 2}
                response = client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                served[p] = response.headers["x-prefixgate-replica"]
        body = {"model": SIM_MODEL, "prompt": [*PREFIXES[0], 9], "max_tokens": 8, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert any("[DONE]" in line for line in response.iter_lines())
        invalid = {"model": SIM_MODEL, "prompt": [1, 2], "max_tokens": -1}
        refused = client.post("/v1/completions", json=invalid)
        assert refused.status_code == 400, refused.text
    return served


def healthy(url: str, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, f"the worker process exited with {proc.returncode}"
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def upstream_errors(gateway: RunningGateway) -> bool:
    return "prefixgate_gateway_upstream_errors_total{" in httpx.get(f"{gateway.url}/metrics").text


def test_promtool_accepts_the_deployed_prometheus_config() -> None:
    result = subprocess.run(
        [binary("promtool"), "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def doomed_worker() -> Iterator[Callable[[str, int, str], subprocess.Popen[bytes]]]:
    """A simulated worker in a process of its own, so that it can die the way workers die (SIGKILL):
    registered until its heartbeat expires, its connections reset."""
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(worker_id: str, port: int, redis: str) -> subprocess.Popen[bytes]:
        args = sim_worker_args(worker_id, port, "--redis", redis, "--log-level", "WARNING")
        procs.append(subprocess.Popen([sys.executable, "-m", "prefixgate", *args]))
        return procs[-1]

    yield spawn
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_every_dashboard_query_returns_data_from_a_live_fleet(
    redis_url: str,
    start_sim_worker: Callable[..., SimWorker],
    doomed_worker: Callable[[str, int, str], subprocess.Popen[bytes]],
    start_gateway: Callable[..., RunningGateway],
    tmp_path: Path,
) -> None:
    queries = dashboard_queries()
    binary("prometheus")  # fail before starting anything
    # A database of its own: no other test's registrations reach this gateway.
    redis = re.sub(r"/\d+$", "/9", redis_url)
    with Redis.from_url(redis) as client:
        client.flushdb()
    # Workers are named by address:port, as docker/worker-entrypoint.sh names them, so that the
    # `replica` label Prometheus gives a worker target matches the gateway's series about that worker.
    ports = [free_port(), free_port()]
    kept, doomed = (f"127.0.0.1:{port}" for port in ports)
    victim = doomed_worker(doomed, ports[1], redis)
    start_sim_worker(kept, "--redis", redis, "--heartbeat", "0.5", "--load-period", "0.1", port=ports[0])
    wait_for(
        lambda: healthy(f"http://{doomed}", victim), "the worker process to start", timeout=45, interval=0.2
    )
    # Slow health checks: the killed worker below must still be chosen, to fail a forward.
    gateway = start_gateway(
        [],
        wait_for=2,
        redis={"url": redis, "poll_interval_s": 0.1},
        health={"interval_s": 5.0, "load_interval_s": 0.05},
    )
    traffic(gateway)

    config = scrape_config([gateway.url.removeprefix("http://")], [kept, doomed])
    with running_prometheus(config, tmp_path) as prometheus:
        # Every target scraped once: round one's counters are in, so round two's make them move.
        wait_for(
            lambda: len(query(prometheus, "up == 1")) == 3,
            "a first scrape of all targets",
            timeout=15,
            interval=0.2,
        )
        traffic(gateway)
        # A worker dies while the gateway still routes to it: forwards fail and are retried elsewhere.
        victim.kill()
        prompts = iter([[*PREFIXES[i % len(PREFIXES)], 11, i] for i in range(100)])

        def failed_forward() -> bool:
            body = {"model": SIM_MODEL, "prompt": next(prompts), "max_tokens": 2}
            response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
            assert response.status_code == 200, response.text
            return upstream_errors(gateway)

        wait_for(failed_forward, "a failed forward to the killed worker", timeout=5, interval=0.2)

        def missing() -> list[str]:
            return [f"{name}: {expr}" for name, expr in queries if not has_numbers(query(prometheus, expr))]

        deadline = time.monotonic() + 20
        while (empty := missing()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not empty, "dashboard queries with no data:\n" + "\n".join(empty)
