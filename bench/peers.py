"""The peer routers the benchmarks compare prefixgate with, installed from PyPI and run as processes.

SGLang's router (sglang-router) and vLLM's (vllm-router) are what a fleet would run in prefixgate's
place, so the benchmarks put them over the same workers under the same load. They live in a venv of
their own (`peers_python`): each pins its own web stack (fastapi, uvicorn), which must not move the
project's, and neither is a dependency of prefixgate. The venv is made once per set of pins and kept
under the cache root (~/.cache/prefixgate/venvs/peers), a marker file saying which pins it holds.

A row (PEER_ROWS) is a router and one of its policies, run with that router's own defaults for the
policy: the flags given are only those without which it would not run here (a variant, of
PEER_VARIANTS, run only when named in full, adds flags of the router's own). The router's port and
its Prometheus exporter's, which default to fixed ports that rows run side by side would share, both
on 127.0.0.1; the workers; the policy; and for vllm-router's kv_aware, which follows the workers' KV
events, their ZMQ endpoints (vLLM's wire format: vLLM's own `--kv-events-config`, or `prefixgate
worker --kv-events-zmq`), their block size and model, which it requires.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from bench.local_fleet import Child, spawn, stop
from protocol.loopback_ports import free_port
from protocol.models import cache_root

PEER_PINS = ("sglang-router==0.3.2", "vllm-router==0.1.17")
PEER_ROWS: tuple[str, ...] = ("sglang cache_aware", "vllm-router cache_aware", "vllm-router kv_aware")
# Rows run only when named in full: a router's policy with flags of its own beside its defaults.
# sglang's cache_aware balances by load only once two workers' loads differ by more than 64 requests,
# which a small fleet never reaches: on two vLLM servers it sent every request of a run to one of
# them (docs/benchmarks.md). Balanced, it goes by load once they differ by two (and by half).
PEER_VARIANTS: dict[str, tuple[str, ...]] = {
    "sglang cache_aware balanced": ("--balance-abs-threshold", "1"),
}
# Each router's launcher module and the spelling of its log level for warnings (quieter than their
# default, which logs at info; the log stays in the work folder).
_LAUNCHERS = {
    "sglang": ("sglang_router.launch_router", "warn"),
    "vllm-router": ("vllm_router.launch_router", "warning"),
}
MARKER = "prefixgate-peers.txt"
INSTALL_TIMEOUT_S = 900.0
# The routers start in about a second; a loaded two-core machine can take many times that.
START_TIMEOUT_S = 60.0
POLL_S = 0.2


def peers_venv() -> Path:
    return cache_root() / "venvs" / "peers"


def peers_python() -> Path:
    """The python of a venv holding PEER_PINS, made on first use (a minute at most, from PyPI) and
    reused while its marker names the same pins; RuntimeError saying why when it cannot be made.
    Concurrent callers (rows, tests) wait for one another on a lock beside the venv."""
    venv = peers_venv()
    python = venv / "bin" / "python"
    wanted = "\n".join(PEER_PINS) + "\n"
    if _marked(venv, wanted):
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with (venv.parent / "peers.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _marked(venv, wanted):
            shutil.rmtree(venv, ignore_errors=True)
            _run([sys.executable, "-m", "venv", str(venv)], f"could not make a venv at {venv}")
            install = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *PEER_PINS]
            _run(install, f"could not install {' '.join(PEER_PINS)} from PyPI into {venv}")
            (venv / MARKER).write_text(wanted)
    return python


def _marked(venv: Path, wanted: str) -> bool:
    try:
        return (venv / MARKER).read_text() == wanted
    except OSError:
        return False


def _run(command: list[str], failure: str) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeError(f"{failure}: {error}") from None
    if done.returncode != 0:
        raise RuntimeError(f"{failure} (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def peer_command(
    python: Path,
    name: str,
    worker_urls: Sequence[str],
    port: int,
    metrics_port: int,
    *,
    kv_events: Sequence[str] | None = None,
    block_size: int = 16,
    model: str | None = None,
) -> list[str]:
    """The command line of the row `name` (of PEER_ROWS or PEER_VARIANTS) over `worker_urls`, on `port`."""
    if name not in PEER_ROWS and name not in PEER_VARIANTS:
        known = ", ".join([*PEER_ROWS, *PEER_VARIANTS])
        raise ValueError(f"unknown peer router {name!r}; expected one of {known}")
    if not worker_urls:
        raise ValueError("a peer router needs at least one worker")
    router, policy = name.split()[:2]
    module, quiet = _LAUNCHERS[router]
    command = [str(python), "-m", module, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--worker-urls", *worker_urls, "--policy", policy]
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    if policy == "kv_aware":
        if kv_events is None or len(kv_events) != len(worker_urls) or model is None:
            raise ValueError(f"{name} follows KV events: give each worker's ZMQ endpoint and the model")
        for url, endpoint in zip(worker_urls, kv_events, strict=True):
            command += ["--kv-event-source", f"{url}={endpoint}"]
        command += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
    return [*command, *PEER_VARIANTS.get(name, ()), "--log-level", quiet]


@contextlib.contextmanager
def peer_router(
    name: str,
    worker_urls: Sequence[str],
    workdir: Path,
    *,
    kv_events: Sequence[str] | None = None,
    block_size: int = 16,
    model: str | None = None,
) -> Iterator[str]:
    """The row `name` (one of PEER_ROWS) as a process on a free 127.0.0.1 port over `worker_urls`
    (which must be up), yielding its base URL once it answers `GET /v1/models` with a model, and
    stopped on the way out. Its log is `workdir`/<name>.log; RuntimeError with the log's tail when it
    exits or does not answer in START_TIMEOUT_S. `kv_events`, `block_size` and `model` are kv_aware's: the
    workers' KV event endpoints, in their order, and their block size and model."""
    port = free_port()
    command = peer_command(
        peers_python(),
        name,
        worker_urls,
        port,
        free_port(),
        kv_events=kv_events,
        block_size=block_size,
        model=model,
    )
    workdir.mkdir(parents=True, exist_ok=True)
    child = spawn(name.replace(" ", "-"), command, f"http://127.0.0.1:{port}", workdir)
    try:
        _wait_answering(child, START_TIMEOUT_S)
        yield child.url
    finally:
        stop([child])


def _wait_answering(child: Child, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _answers(child.url):
        if child.proc.poll() is not None:
            raise RuntimeError(
                f"{child.name} exited with status {child.proc.returncode} while starting:\n{child.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{child.name} at {child.url} not answering in {timeout_s:.0f} s:\n{child.log_tail()}"
            )
        time.sleep(POLL_S)


def _answers(url: str) -> bool:
    """`GET /v1/models` lists a model: the router is up and has a worker to ask."""
    try:
        response = httpx.get(f"{url}/v1/models", timeout=2.0)
        return response.status_code == 200 and bool(response.json().get("data"))
    except (httpx.HTTPError, ValueError, AttributeError):
        return False
