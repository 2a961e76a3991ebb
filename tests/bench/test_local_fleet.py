"""The local fleet harness: the gateway config it writes, what ready means (for a worker, a gateway and
Redis), a child that dies while starting named with its log (or, with no log, its output on ours), a
child serving on a socket its parent bound, in a session of its own (`prefixgate up`'s workers), and a
Fleet that stops what it started, services last (its ports: tests/protocol/test_loopback_ports.py)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench.local_fleet import Child, Fleet, gateway_config, healthy, spawn, start_redis, stop, wait_healthy
from protocol.loopback_ports import free_port
from tests.bench.stub_server import serving


def test_the_gateway_config_routes_token_ids_over_the_workers() -> None:
    config = gateway_config("m", ["http://a", "http://b"], "round_robin", 8000)
    assert config == {
        "model": "m",
        "models": {"m": {"tokenizer": "none"}},
        "listen": {"host": "127.0.0.1", "port": 8000},
        "replicas": [{"url": "http://a"}, {"url": "http://b"}],
        "routing": {"policy": "round_robin"},
    }
    # No port: no listen section (start_gateway sets one); no policy: the gateway's default; a section
    # given replaces the whole of it.
    bare = gateway_config("m", [], redis={"url": "redis://r"}, routing={"policy": "least_load"})
    assert "listen" not in bare and bare["replicas"] == []
    assert bare["redis"] == {"url": "redis://r"} and bare["routing"] == {"policy": "least_load"}
    assert "routing" not in gateway_config("m", ["http://a"])


@pytest.fixture
def health_server() -> Iterator[tuple[Child, dict[str, Any]]]:
    """An HTTP child whose /health answers what the test puts in `reply` (status and body)."""
    reply: dict[str, Any] = {"status": 200, "body": {"status": "ok"}}

    async def health(request: web.Request) -> web.Response:
        return web.json_response(reply["body"], status=reply["status"])

    with serving(("GET", "/health", health)) as url:
        yield Child("stub", url, None, Path("/nonexistent")), reply  # type: ignore[arg-type]


def test_ready_means_200_and_for_a_gateway_its_replicas_routable(
    health_server: tuple[Child, dict[str, Any]],
) -> None:
    child, reply = health_server
    assert healthy(child) and healthy(child, "all")  # a worker: no replicas listed
    assert not healthy(child, 2)  # a gateway was expected
    reply["body"] = {"status": "ok", "replicas": {"routable": 1, "total": 2}}
    assert healthy(child) and healthy(child, 1)
    assert not healthy(child, 2) and not healthy(child, "all")
    reply["body"] = {"status": "degraded", "replicas": {"routable": 2, "total": 2}}
    assert healthy(child, 2) and healthy(child, "all")
    reply["status"], reply["body"] = 503, {"status": "unavailable", "replicas": {"routable": 0, "total": 0}}
    assert not healthy(child) and not healthy(child, 0) and not healthy(child, "all")


def test_nothing_listening_is_not_ready() -> None:
    child = Child("gone", f"http://127.0.0.1:{free_port()}", None, Path("/nonexistent"))  # type: ignore[arg-type]
    assert not healthy(child) and not healthy(child, "all")


def test_a_child_that_dies_while_starting_is_named_with_its_log(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import sys; print('bad config'); sys.exit(3)"]
    child = spawn("worker-x", command, f"http://127.0.0.1:{free_port()}", tmp_path)
    with pytest.raises(RuntimeError, match=r"worker-x exited with status 3 while starting:\nbad config"):
        wait_healthy([child], timeout_s=30, poll_s=0.01)


def test_a_child_without_a_work_folder_writes_to_our_output_and_dies_named_alone(
    capfd: pytest.CaptureFixture[str],
) -> None:
    command = [sys.executable, "-c", "import sys; print('bad config'); sys.exit(3)"]
    child = spawn("worker-x", command, f"http://127.0.0.1:{free_port()}", None)
    with pytest.raises(RuntimeError, match=r"^worker-x exited with status 3 while starting$"):
        wait_healthy([child], timeout_s=30, poll_s=0.01)
    assert child.log is None and "bad config" in capfd.readouterr().out


def test_a_child_serves_on_the_socket_its_parent_bound_in_a_session_of_its_own(tmp_path: Path) -> None:
    """The parent's copy of the socket is closed before the child is asked: the child's answers."""
    script = (
        "import http.server, socket, sys\n"
        "class Health(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200 if self.path == '/health' else 404)\n"
        "        self.end_headers()\n"
        "server = http.server.HTTPServer(('127.0.0.1', 0), Health, bind_and_activate=False)\n"
        "server.socket = socket.socket(fileno=int(sys.argv[1]))\n"
        "server.serve_forever()\n"
    )
    with socket.create_server(("127.0.0.1", 0)) as sock:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        command = [sys.executable, "-c", script, str(sock.fileno())]
        child = spawn("fd-server", command, url, tmp_path, pass_fds=(sock.fileno(),), new_session=True)
    try:
        wait_healthy([child], timeout_s=30, poll_s=0.05)
        assert os.getsid(child.pid) == child.pid != os.getsid(0)
    finally:
        stop([child])


def test_a_child_that_never_answers_times_out_with_its_name(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import time; time.sleep(30)"]
    child = spawn("gateway-y", command, f"http://127.0.0.1:{free_port()}", tmp_path)
    try:
        with pytest.raises(RuntimeError, match=r"gateway-y at http://127\.0\.0\.1:\d+ not ready in 0 s"):
            wait_healthy([child], timeout_s=0.3, poll_s=0.05)
    finally:
        stop([child])
    assert child.proc.returncode is not None


def test_redis_is_ready_when_it_answers_ping(tmp_path: Path) -> None:
    redis = start_redis(tmp_path)
    try:
        assert redis.url.startswith("redis://127.0.0.1:") and healthy(redis)
    finally:
        stop([redis])
    assert not healthy(redis)


def test_a_fleet_stops_its_children_then_its_services(tmp_path: Path) -> None:
    # Each child, stopped, appends its name to one file: the order they ended in.
    order = tmp_path / "order"
    script = (
        "import signal, sys, time\n"
        "def end(*_):\n"
        f"    open({str(order)!r}, 'a').write(sys.argv[1] + '\\n'); sys.exit(0)\n"
        "signal.signal(signal.SIGINT, end)\n"
        "print('up', flush=True)\n"
        "while True: time.sleep(0.01)\n"
    )

    def start(name: str) -> Child:
        return spawn(name, [sys.executable, "-c", script, name], "http://127.0.0.1:1", tmp_path)

    with Fleet(tmp_path) as fleet:
        service = fleet.add_service(start("service"))
        child = fleet.add(start("child"))
        for c in (service, child):
            while "up" not in c.log_tail():
                assert c.proc.poll() is None
    assert child.proc.returncode == 0 and service.proc.returncode == 0
    assert order.read_text().split() == ["child", "service"]
