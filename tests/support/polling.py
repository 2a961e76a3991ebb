"""Polling until something holds, for tests that wait on another thread, process or server: one
argument order everywhere (the condition, what it means, then the timeout and interval), and a failure
that names what never happened."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], what: str, *, timeout: float = 10.0, interval: float = 0.02) -> T:
    """Call `condition` every `interval` seconds until it returns something true, and return that; fail
    the test, naming `what` (the awaited event, "the worker to be idle"), after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
    return value


async def wait_for_async(
    condition: Callable[[], T], what: str, *, timeout: float = 10.0, interval: float = 0.02
) -> T:
    """`wait_for` inside a coroutine: the event loop runs (its tasks make progress) between calls."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)
    return value
