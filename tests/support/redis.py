"""Private redis-servers for tests: started on a free loopback port, with no persistence."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.local_fleet import start_redis
from protocol.loopback_ports import free_port


def start_redis_server(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    """A private redis-server on 127.0.0.1:port with no persistence, answering PING when this returns
    (bench.local_fleet's, as the benchmarks start theirs); a test restarts Redis at the same port."""
    try:
        return start_redis(workdir, port).proc
    except RuntimeError as error:
        pytest.fail(str(error))


@contextmanager
def private_redis(workdir: Path) -> Iterator[str]:
    """redis://127.0.0.1:PORT/0 of a redis-server started for the block, stopped after it."""
    port = free_port()
    proc = start_redis_server(port, workdir)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
