"""Real processes for the benchmarks that measure HTTP hops: simulated workers and a gateway, each
started from the `prefixgate` command line as a process of its own.

Separate processes because the load generator, the workers and the gateway must not share one
interpreter lock: in one process each would queue behind the others' Python and the measurement
would be of the lock. Started from the CLI because that is what an operator runs. Every process is
stopped on the way out (SIGINT, then SIGKILL), errors included; each writes to a log file in the
work folder, whose tail is shown when a process fails to start. Every process gets the same KV
transfer secret in its environment (`transfer_secret`), so prefill and decode workers pair up, and a
benchmark can sign a pairing itself.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from protocol.transfer_auth import SECRET_ENV
from workers.sim.profiles import get_profile

# Each process imports the worker stack (torch included, about 4 s of CPU); a fleet of five starting
# at once on two shared cores needs a good margin.
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 10.0
REDIS_START_TIMEOUT_S = 10.0
POLL_S = 0.2
LOG_TAIL_CHARS = 3000


# Ports free_port picks among, just below the ephemeral range.
_PORTS_BELOW_EPHEMERAL = 12_000


def free_port() -> int:
    """A loopback port nothing is bound to now, below the kernel's ephemeral range: one from that range
    (the kernel's own pick) can be taken, before its server binds it, as the local port of any outgoing
    connection (a gateway's, a health probe's), which once kept a fleet test's worker from starting;
    below it, the race is only with other starters, spread by the random pick."""
    floor = _ephemeral_floor()
    for _ in range(200):
        port = random.randrange(max(1024, floor - _PORTS_BELOW_EPHEMERAL), floor)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in the {_PORTS_BELOW_EPHEMERAL} below {floor}")


def _ephemeral_floor() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's default when it cannot say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@dataclass(frozen=True, slots=True)
class SimWorkers:
    """`count` simulated workers, each with this profile (a name or a calibrate .json) and pool."""

    count: int
    profile: str = "h100-8b"
    block_size: int | None = None  # None: the profile's
    num_blocks: int | None = None  # None: the profile's pool

    @property
    def model(self) -> str:
        return get_profile(self.profile).model_name


@dataclass(slots=True)
class Child:
    """One started process and the base URL it serves."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return ""


@dataclass(slots=True)
class LocalFleet:
    workers: list[Child]
    gateway: Child | None

    @property
    def children(self) -> list[Child]:
        return [*self.workers, *([self.gateway] if self.gateway else [])]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefixgate", *args]


def worker_command(spec: SimWorkers, worker_id: str, port: int) -> list[str]:
    command = cli("worker", "--sim", "--sim-profile", spec.profile, "--port", str(port), "--id", worker_id)
    if spec.block_size is not None:
        command += ["--block-size", str(spec.block_size)]
    if spec.num_blocks is not None:
        command += ["--num-blocks", str(spec.num_blocks)]
    return [*command, "--log-level", "WARNING"]


def gateway_config(model: str, worker_urls: Sequence[str], policy: str, port: int) -> dict[str, Any]:
    """Embedded mode (no Redis) over the given workers. The model routes on the token ids the clients
    send, so the gateway loads no tokenizer (`none`): it would only slow the first request."""
    return {
        "model": model,
        "models": {model: {"tokenizer": "none"}},
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [{"url": url} for url in worker_urls],
        "routing": {"policy": policy},
    }


@functools.cache
def transfer_secret() -> str:
    """The KV transfer secret of the fleets this process starts: the environment's, or one made now."""
    return os.environ.get(SECRET_ENV) or secrets.token_hex(32)


def spawn(name: str, command: list[str], url: str, workdir: Path) -> Child:
    log = workdir / f"{name}.log"
    env = {**os.environ, SECRET_ENV: transfer_secret()}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    return Child(name, url, proc, log)


def _ready(child: Child, replicas: int | None) -> bool:
    """Its /health answers 200; for a gateway, with every one of `replicas` routable."""
    try:
        response = httpx.get(f"{child.url}/health", timeout=1.0)
    except httpx.HTTPError:
        return False
    if response.status_code != 200:
        return False
    return replicas is None or response.json()["replicas"]["routable"] == replicas


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(workdir: Path, port: int | None = None, timeout_s: float = REDIS_START_TIMEOUT_S) -> Child:
    """A private redis-server on 127.0.0.1 (a free port by default) with no persistence, answering PING
    when this returns; its `url` is the redis:// URL to hand to workers and gateways. `stop` ends it
    like any other child (SIGINT: redis-server shuts down at once, saving nothing)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server, or `make test`)")
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    command = [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "",
        "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning",
    ]  # fmt: skip
    child = spawn(f"redis-{port}", command, f"redis://127.0.0.1:{port}/0", workdir)
    deadline = time.monotonic() + timeout_s
    while not _pong(port):
        if child.proc.poll() is not None or time.monotonic() > deadline:
            stop([child])
            raise RuntimeError(f"redis-server on port {port} did not start:\n{child.log_tail()}")
        time.sleep(0.05)
    return child


def wait_ready(fleet: LocalFleet, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until every worker and the gateway (all replicas routable) answer, or RuntimeError naming the
    process that died or did not come up, with the tail of its log."""
    deadline = time.monotonic() + timeout_s
    waiting = list(fleet.children)
    while waiting:
        for child in waiting:
            if child.proc.poll() is not None:
                raise RuntimeError(
                    f"{child.name} exited with status {child.proc.returncode} while starting:\n"
                    f"{child.log_tail()}"
                )
        replicas = len(fleet.workers)
        waiting = [c for c in waiting if not _ready(c, replicas if c is fleet.gateway else None)]
        if waiting and time.monotonic() > deadline:
            child = waiting[0]
            raise RuntimeError(
                f"{child.name} at {child.url} not ready in {timeout_s:.0f} s:\n{child.log_tail()}"
            )
        if waiting:
            time.sleep(POLL_S)


def stop(children: Sequence[Child], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGINT to all (aiohttp's graceful stop), then SIGKILL to any still running at the deadline."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


@contextlib.contextmanager
def local_fleet(workdir: Path, workers: SimWorkers, policy: str | None = None) -> Iterator[LocalFleet]:
    """`workers` fresh simulated workers (empty caches) and, given a policy, a gateway in front of them,
    all started at once (the gateway retries replicas until they answer) and ready when this yields."""
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = LocalFleet([], None)
    try:
        for i in range(workers.count):
            port = free_port()
            command = worker_command(workers, f"w{i}", port)
            fleet.workers.append(spawn(f"worker-w{i}", command, f"http://127.0.0.1:{port}", workdir))
        if policy is not None:
            port = free_port()
            config = workdir / f"gateway-{policy}.yaml"
            urls = [w.url for w in fleet.workers]
            config.write_text(yaml.safe_dump(gateway_config(workers.model, urls, policy, port)))
            command = cli("serve", "--config", str(config), "--log-level", "WARNING")
            fleet.gateway = spawn(f"gateway-{policy}", command, f"http://127.0.0.1:{port}", workdir)
        wait_ready(fleet)
        yield fleet
    finally:
        stop(fleet.children)
