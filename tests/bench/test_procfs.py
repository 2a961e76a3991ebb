"""The /proc reader: a live process's resident and peak memory and CPU seconds, and a clear error for
a process that is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.procfs import cpu_s, own_cpu_s, proc_stat, rss_bytes


def test_rss_is_read_from_proc() -> None:
    assert 10 * 2**20 < rss_bytes(os.getpid()) < 64 * 2**30


HOLD = """
import sys
held = bytearray(128 * 2**20)
held[::4096] = b"x" * len(held[::4096])  # every page touched: resident, not just reserved
print("held", flush=True)
sys.stdin.read()
"""


def test_memory_held_shows_in_rss_and_its_peak() -> None:
    """Read of a child that holds a known amount: the test process's own RSS moves with whatever its
    allocator reuses, and the kernel batches a busy process's counters."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        stat = proc_stat(child.pid)
        assert stat.rss_bytes > 128 * 2**20
        assert stat.peak_rss_bytes >= stat.rss_bytes
    finally:
        child.kill()
        child.wait()


def test_cpu_seconds_grow_with_work() -> None:
    start, own = cpu_s(os.getpid()), own_cpu_s()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    assert cpu_s(os.getpid()) - start > 0.2
    assert own_cpu_s() - own > 0.2


def test_a_process_that_has_ended_is_an_error() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(FileNotFoundError):
        rss_bytes(proc.pid)
