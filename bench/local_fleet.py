"""Real processes for the benchmarks that measure HTTP hops: simulated workers and a gateway, each
started from the `prefixgate` command line as a process of its own.

Separate processes because the load generator, the workers and the gateway must not share one
interpreter lock: in one process each would queue behind the others' Python and the measurement
would be of the lock. Started from the CLI because that is what an operator runs. Every process is
stopped on the way out (SIGINT, then SIGKILL), errors included; each writes to a log file in the
work folder, whose tail is shown when a process fails to start (`prefixgate up`'s workers write to
the terminal instead). Every process gets the same KV transfer secret in its environment
(`transfer_secret`), so prefill and decode workers pair up, and a benchmark can sign a pairing itself.

The one harness for local fleets: `local_fleet` starts a whole one (workers and a gateway); `Fleet`
holds processes started one by one (`start_worker`, `start_gateway`, `start_redis`), as the chaos
scenarios, the soak and the fault tests build theirs; `wait_healthy` is what ready means for all;
`prefixgate up` starts its workers with `spawn` and stops them with `stop`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml

from bench.probes import wait_for
from protocol.loopback_ports import free_port
from protocol.transfer_auth import SECRET_ENV
from workers.sim.profiles import get_profile

# Each process imports the worker stack (torch included, about 4 s of CPU); a fleet of five starting
# at once on two shared cores needs a good margin.
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 10.0
REDIS_START_TIMEOUT_S = 10.0
POLL_S = 0.2
# A redis-server answers within milliseconds of starting: polled finer than the Python processes.
REDIS_POLL_S = 0.05
LOG_TAIL_CHARS = 3000


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
    """One started process and the base URL it serves; `log` None: its output went to this process's."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path | None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self) -> str:
        if self.log is None:
            return ""
        try:
            return self.log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return ""

    def failure(self, what: str) -> str:
        """`what` happened to this child, followed by the tail of its log when there is one to show."""
        tail = self.log_tail()
        return f"{self.name} {what}:\n{tail}" if tail else f"{self.name} {what}"


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


# A gateway's `collector` section by name (gateway.collector): "tuned" is its default, "python" Python's
# collector as it comes, "freeze" and "young" each half of the default alone.
COLLECTORS: dict[str, dict[str, Any]] = {
    "tuned": {},
    "python": {"young_threshold": None, "freeze": False},
    "freeze": {"young_threshold": None},
    "young": {"freeze": False},
}


def gateway_config(
    model: str,
    worker_urls: Sequence[str],
    policy: str | None = None,
    port: int | None = None,
    **sections: Any,
) -> dict[str, Any]:
    """A gateway over the given workers, embedded mode (no Redis) unless `sections` add one; `sections`
    replace whole top-level sections. The model routes on the token ids the clients send, so the
    gateway loads no tokenizer (`none`): it would only slow the first request. Without a `port` the
    config has no `listen` (start_gateway sets it); without a `policy`, the gateway's default."""
    config: dict[str, Any] = {"model": model, "models": {model: {"tokenizer": "none"}}}
    if port is not None:
        config["listen"] = {"host": "127.0.0.1", "port": port}
    config["replicas"] = [{"url": url} for url in worker_urls]
    if policy is not None:
        config["routing"] = {"policy": policy}
    return {**config, **sections}


@functools.cache
def transfer_secret() -> str:
    """The KV transfer secret of the fleets this process starts: the environment's, or one made now."""
    return os.environ.get(SECRET_ENV) or secrets.token_hex(32)


def spawn(
    name: str,
    command: list[str],
    url: str,
    workdir: Path | None,
    *,
    pass_fds: Sequence[int] = (),
    new_session: bool = False,
) -> Child:
    """`command` started as `name`, its output in `name`.log in `workdir`, or, with no `workdir`, on
    this process's own (a terminal an operator watches). `pass_fds`: descriptors it inherits (a
    listening socket its parent bound); `new_session`: a session of its own, which a terminal's
    Ctrl-C does not reach, so that the parent alone decides when and how often it is signalled."""
    env = {**os.environ, SECRET_ENV: transfer_secret()}
    log = workdir / f"{name}.log" if workdir is not None else None
    with log.open("wb") if log is not None else contextlib.nullcontext() as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT if log is not None else None,
            stdin=subprocess.DEVNULL,
            env=env,
            pass_fds=pass_fds,
            start_new_session=new_session,
        )
    return Child(name, url, proc, log)


def start_worker(
    workdir: Path, spec: SimWorkers, worker_id: str, *flags: str, port: int | None = None
) -> Child:
    """One simulated worker of `spec` on `port` (a free one by default); `flags` go last and win."""
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    command = [*worker_command(spec, worker_id, port), *flags]
    return spawn(f"worker-{worker_id}", command, f"http://127.0.0.1:{port}", workdir)


def start_gateway(
    workdir: Path, name: str, config: Mapping[str, Any], *flags: str, command: str = "serve"
) -> Child:
    """`prefixgate serve` (or `command`: epp) on a free port with `config` (its `listen` is set here),
    written to `name`.yaml in the work folder; `flags` go last."""
    port = free_port()
    path = workdir / f"{name}.yaml"
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({**config, "listen": {"host": "127.0.0.1", "port": port}}))
    argv = cli(command, "--config", str(path), "--log-level", "WARNING", *flags)
    return spawn(name, argv, f"http://127.0.0.1:{port}", workdir)


def _pong(url: str) -> bool:
    """A redis-server at this redis:// URL answers PING."""
    host, port = url.removeprefix("redis://").split("/")[0].split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def healthy(child: Child, routable: int | Literal["all"] | None = None) -> bool:
    """A Redis child answers PING; any other, /health with 200 and, given `routable`, that many of the
    replicas it lists (a gateway) routable, or (`all`) every one it lists, at least one, when it
    lists any."""
    if child.url.startswith("redis://"):
        return _pong(child.url)
    try:
        response = httpx.get(f"{child.url}/health", timeout=1.0)
    except httpx.HTTPError:
        return False
    if response.status_code != 200 or routable is None:
        return response.status_code == 200
    try:
        replicas = response.json().get("replicas")
    except (ValueError, AttributeError):
        replicas = None
    if not isinstance(replicas, dict):
        return routable == "all"
    if routable == "all":
        return replicas["routable"] == replicas["total"] > 0
    return replicas["routable"] == routable


def wait_healthy(
    children: Sequence[Child],
    timeout_s: float = START_TIMEOUT_S,
    *,
    routable: Mapping[str, int] | Literal["all"] = "all",
    poll_s: float = POLL_S,
) -> None:
    """Until every child is `healthy`, or RuntimeError naming the process that died or did not come
    up, with the tail of its log. `routable`: how many replicas each gateway, by name, must route to
    (the others need only answer), or `all`: every gateway all the replicas it lists."""
    waiting = list(children)

    def ready(child: Child) -> bool:
        return healthy(child, routable if isinstance(routable, str) else routable.get(child.name))

    def up() -> bool:
        for child in children:
            if child.proc.poll() is not None:
                raise RuntimeError(
                    child.failure(f"exited with status {child.proc.returncode} while starting")
                )
        waiting[:] = [c for c in waiting if not ready(c)]
        return not waiting

    try:
        wait_for(up, "the fleet to start", timeout=timeout_s, interval=poll_s)
    except TimeoutError as error:
        child = waiting[0]
        raise RuntimeError(child.failure(f"at {child.url} not ready in {timeout_s:.0f} s")) from error


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
    try:
        wait_healthy([child], timeout_s, poll_s=REDIS_POLL_S)
    except RuntimeError as error:
        stop([child])
        raise RuntimeError(f"redis-server on port {port} did not start: {error}") from error
    return child


def wait_ready(fleet: LocalFleet, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until every worker and the gateway (every worker routable) answer; see wait_healthy."""
    gateway = {fleet.gateway.name: len(fleet.workers)} if fleet.gateway else {}
    wait_healthy(fleet.children, timeout_s, routable=gateway)


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


class Fleet(contextlib.ExitStack):
    """Processes started one by one, all stopped on exit (SIGCONT first, for one left stopped): workers
    and gateways (`add`) first, then the services they use (`add_service`: a redis-server), so that
    workers leave the registry cleanly."""

    def __init__(self, workdir: Path) -> None:
        super().__init__()
        self.workdir = workdir
        self.children: list[Child] = []
        self.services: list[Child] = []
        self.callback(self._stop_all)

    def add(self, child: Child) -> Child:
        self.children.append(child)
        return child

    def add_service(self, child: Child) -> Child:
        self.services.append(child)
        return child

    def _stop_all(self) -> None:
        for child in self.children:
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGCONT)
        stop(self.children)
        stop(self.services)


@contextlib.contextmanager
def local_fleet(workdir: Path, workers: SimWorkers, policy: str | None = None) -> Iterator[LocalFleet]:
    """`workers` fresh simulated workers (empty caches) and, given a policy, a gateway in front of them,
    all started at once (the gateway retries replicas until they answer) and ready when this yields."""
    fleet = LocalFleet([], None)
    try:
        for i in range(workers.count):
            fleet.workers.append(start_worker(workdir, workers, f"w{i}"))
        if policy is not None:
            config = gateway_config(workers.model, [w.url for w in fleet.workers], policy)
            fleet.gateway = start_gateway(workdir, f"gateway-{policy}", config)
        wait_ready(fleet)
        yield fleet
    finally:
        stop(fleet.children)
