"""The command lines as a user runs them: `prefixgate serve` from YAML (reloaded on SIGHUP without
dropping a request in flight) and `prefixgate up`, the local fleet of SmolLM2 workers, end to end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from bench.probes import wait_for
from tests.support.gateways import SIM_MODEL, SimWorker
from tests.support.servers import free_port


def write_config(path: Path, urls: list[str], policy: str) -> None:
    config = {
        "replicas": [{"url": u} for u in urls],
        "models": {SIM_MODEL: {"tokenizer": "none"}},
        "routing": {"policy": policy},
        "health": {"interval_s": 0.2},
    }
    path.write_text(yaml.safe_dump(config))


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[Path], tuple[str, subprocess.Popen[bytes]]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(config: Path) -> tuple[str, subprocess.Popen[bytes]]:
        port = free_port()
        command = [sys.executable, "-m", "prefixgate", "serve", "--config", str(config), "--port", str(port)]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, "the gateway to serve", timeout=60)
        return url, proc

    yield start
    for proc in procs:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serve_reloads_its_config_on_sighup_without_dropping_requests(
    tmp_path: Path, start_sim_worker: Callable[..., SimWorker], serve: Callable
) -> None:
    workers = [start_sim_worker(f"w{i}") for i in range(2)]
    config = tmp_path / "gateway.yaml"
    write_config(config, [workers[0].url], "round_robin")
    url, proc = serve(config)
    assert httpx.get(f"{url}/health").json()["policy"] == "round_robin"
    body = {"model": SIM_MODEL, "prompt": list(range(1000, 1100)), "max_tokens": 300, "stream": True}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60
    ) as response:
        lines = response.iter_lines()
        next(lines)
        write_config(config, [workers[1].url], "prefix_aware")
        proc.send_signal(signal.SIGHUP)
        wait_for(
            lambda: httpx.get(f"{url}/health").json()["policy"] == "prefix_aware", "the reload", timeout=5
        )
        # The request placed on the replica that left the config still streams to its end.
        rest = list(lines)
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
    replicas = httpx.get(f"{url}/admin/replicas").json()["replicas"]
    assert [r["id"] for r in replicas] == ["w1"]
    # A broken config is refused and the running one kept.
    config.write_text("routing: {policy: no_such_policy}\n")
    proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert httpx.get(f"{url}/health").json()["policy"] == "prefix_aware"


def test_serve_refuses_a_bad_config_with_the_key_named(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("listen: {port: 99999}\nroutng: {}\n")
    done = subprocess.run(
        [sys.executable, "-m", "prefixgate", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "gateway.listen.port" in done.stderr and "gateway.routng: unknown key" in done.stderr


@pytest.mark.real
def test_up_starts_the_local_fleet_and_shows_a_cache_hit() -> None:
    """The main job, as `make demo` runs it: two SmolLM2 workers, the gateway, the openai client.
    Ports 0: `up` binds every socket itself before starting anything, on ports the OS picks."""
    done = subprocess.run(
        [sys.executable, "-m", "prefixgate", "up", "--once", "--port", "0", "--worker-port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.count("served by worker-") == 2
    assert "cache hit: the second request reused" in out
    first, second = (line for line in out.splitlines() if "served by" in line)
    assert first.split("served by ")[1].split(",")[0] == second.split("served by ")[1].split(",")[0]
    assert " 0 of " in first and " 0 of " not in second


@pytest.mark.real
def test_ctrl_c_stops_the_fleet_cleanly() -> None:
    """Ctrl-C as a terminal sends it, to the whole foreground process group: `up` stops the gateway,
    then each worker once; nothing prints a traceback or a failed replica, and the workers' ports close."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixgate", "up", "--workers", "1", "--port", "0", "--worker-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a foreground job
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C stops the fleet" in line:
            break
    else:
        pytest.fail("".join(lines))
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "failed" not in out, out
    [worker_url] = [w.split("workers up: ")[1].split()[0] for w in lines if "workers up: " in w]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{worker_url}/health", timeout=2)


@pytest.mark.real
def test_up_with_a_prefill_worker_moves_the_prompt_to_the_decode_worker() -> None:
    """`up --prefill 1`: worker-0 computes prompts, worker-1 decodes them with the KV moved over."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefixgate",
            "up",
            "--once",
            "--port",
            "0",
            "--worker-port",
            "0",
            "--prefill",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.count("served by worker-1") == 2, "only the decode worker answers clients"
    moved = [line for line in out.splitlines() if "prompt computed by worker-0" in line]
    assert len(moved) == 2 and int(moved[0].split(", ")[1].split()[0]) > 0
    assert "cache hit: the second request reused" in out


def test_up_refuses_a_fleet_of_prefill_workers_only() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "prefixgate", "up", "--once", "--workers", "2", "--prefill", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--prefill must be in [0, --workers)" in done.stdout


@pytest.mark.parametrize("busy_flag", ["--port", "--worker-port"])
def test_up_refuses_a_busy_port_before_loading_anything(busy_flag: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        ports = {"--port": "0", "--worker-port": "0", busy_flag: str(port)}
        done = subprocess.run(
            [sys.executable, "-m", "prefixgate", "up", "--once", *(x for kv in ports.items() for x in kv)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "preparing SmolLM2" not in done.stdout
