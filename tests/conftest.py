"""Shared fixtures: a real redis-server on a free loopback port, started and stopped by the tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.local_fleet import free_port, start_redis

__all__ = ["free_port", "start_redis_server"]


def interpret_triton_without_a_gpu() -> None:
    """Triton chooses between its interpreter and its compiler when triton.language is first imported,
    and importing transformers' model classes imports it (torch registers Triton ops), so the session's
    choice is made here, before any test module loads: without a CUDA device, the Triton attention
    kernels run in the interpreter (tests/workers/engine/test_attention_triton.py)."""
    if importlib.util.find_spec("torch") is None:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


interpret_triton_without_a_gpu()


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


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """redis://127.0.0.1:PORT/0 of a redis-server private to this test session, with no persistence."""
    with private_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url
