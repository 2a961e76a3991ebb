"""A replica SIGKILLed under load: requests that have not streamed a byte are retried on the next
choice and succeed, a streaming one is continued on the survivor, nothing hangs, and the
dead replica leaves the rotation, then rejoins with a cleared cache once restarted."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.probes import wait_for
from tests.support.gateways import SIM_MODEL, RunningGateway, sim_worker_args
from tests.support.servers import free_port

# Workers that lost their port to another process as they started, tried again on a new one.
START_TRIES = 3


@pytest.fixture
def spawn_worker() -> Iterator[Callable[[str, int | None], tuple[subprocess.Popen[bytes], int]]]:
    """Start a simulated worker as `worker_id` on `port` and wait until it is the one answering there;
    with no port, on a free one, tried again on another should a process bind it first (free_port can
    only say it was free when it looked)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(worker_id: str, port: int) -> subprocess.Popen[bytes] | None:
        args = sim_worker_args(worker_id, port, "--log-level", "WARNING")
        proc = subprocess.Popen([sys.executable, "-m", "prefixgate", *args])
        procs.append(proc)

        def up() -> bool:
            if proc.poll() is not None:
                return True
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            except httpx.HTTPError:
                return False
            return health.status_code == 200 and health.json().get("worker_id") == worker_id

        wait_for(up, f"worker {worker_id}", timeout=60)
        return proc if proc.poll() is None else None

    def spawn(worker_id: str, port: int | None = None) -> tuple[subprocess.Popen[bytes], int]:
        for _ in range(START_TRIES if port is None else 1):
            chosen = port or free_port()
            proc = start(worker_id, chosen)
            if proc is not None:
                return proc, chosen
        raise AssertionError(f"worker {worker_id} exited as it started (its port taken?)")

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def long_request(gateway: RunningGateway, stream: bool) -> httpx.Response:
    body = {
        "model": SIM_MODEL,
        "prompt": list(range(1000, 1200)),
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": stream,
    }
    return httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60)


def test_a_killed_replica_costs_no_request_that_had_not_started_streaming(
    spawn_worker: Callable[[str, int | None], tuple[subprocess.Popen[bytes], int]],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    procs, ports = {}, {}
    for rid in ("k0", "k1"):
        procs[rid], ports[rid] = spawn_worker(rid, None)
    gateway = start_gateway(
        [f"http://127.0.0.1:{p}" for p in ports.values()],
        routing={"policy": "round_robin"},
        health={"interval_s": 0.2, "failures": 2, "load_interval_s": 0.05},
    )
    body = {"model": SIM_MODEL, "prompt": list(range(1000, 1100)), "max_tokens": 2000, "ignore_eos": True}
    with ThreadPoolExecutor(8) as pool:
        with httpx.stream("POST", f"{gateway.url}/v1/completions", json={**body, "stream": True}) as response:
            lines = response.iter_lines()  # held: a dropped iterator closes the stream
            next(lines)
            victim = response.headers["x-prefixgate-replica"]
            # Round robin puts half of these on the victim too; none has answered when it dies.
            pending = [pool.submit(long_request, gateway, False) for _ in range(6)]
            time.sleep(0.3)
            procs[victim].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            tail = [line for line in lines if line]
        answers = [f.result(timeout=60) for f in pending]
    survivor = next(rid for rid in ports if rid != victim)
    # Non-streaming requests had sent nothing to their clients: every one retried and served.
    assert [a.status_code for a in answers] == [200] * 6
    assert {a.headers["x-prefixgate-replica"] for a in answers} == {survivor}
    # The stream had: it is continued on the survivor (gateway.forward.migration), and ends whole.
    assert tail[-1] == "data: [DONE]" and '"finish_reason":"length"' in tail[-2]
    assert not any("upstream_failed" in line for line in tail)
    down_since = wait_for(
        lambda: gateway.state.replicas.get(victim).down_since, "the victim to leave", timeout=5
    )
    assert down_since - killed < 2.0
    assert {long_request(gateway, False).headers["x-prefixgate-replica"] for _ in range(4)} == {survivor}
    # Restarted on the same port: back in the rotation, with the old cache forgotten.
    spawn_worker(victim, ports[victim])
    wait_for(lambda: gateway.state.replicas.get(victim).routable, "the victim to rejoin", timeout=10)
    assert gateway.state.index.blocks_of(victim) == 0
    assert victim in {long_request(gateway, False).headers["x-prefixgate-replica"] for _ in range(4)}
