"""Asking a running process how it is, over HTTP, and polling until something holds: local fleets
(bench.local_fleet), chaos scenarios and tests all wait the same way, with one argument order (the
condition, what it means, then the timeout and interval) and a failure that names what never
happened."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

T = TypeVar("T")


def wait_for(condition: Callable[[], T], what: str, *, timeout: float = 10.0, interval: float = 0.02) -> T:
    """Call `condition` every `interval` seconds until it returns something true, and return that; or
    TimeoutError naming `what` (the awaited event, "the worker to be idle") after `timeout` seconds.
    A caller that reports how long a wait took measures from its own start (a kill, a restart)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
    return value


async def wait_for_async(
    condition: Callable[[], T], what: str, *, timeout: float = 10.0, interval: float = 0.02
) -> T:
    """`wait_for` inside a coroutine: the event loop runs (its tasks make progress) between calls."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)
    return value


def get_json(url: str, timeout_s: float = 1.0) -> Any:
    """The JSON body of GET `url` whatever its status, or None when nothing answered."""
    try:
        return httpx.get(url, timeout=timeout_s).json()
    except (httpx.HTTPError, ValueError):
        return None


def metric(url: str, name: str) -> float | None:
    """One unlabelled sample of the Prometheus text page at `url`/metrics, or None."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return None
    return sample(text, name)


def sample(text: str, name: str) -> float | None:
    """The value of the unlabelled sample `name` in a Prometheus text page, or None."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None
