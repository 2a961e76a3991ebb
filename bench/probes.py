"""Asking a running process how it is, over HTTP, and polling until it says what a caller waits for:
the questions every local fleet (bench.local_fleet), chaos scenario and fault test puts to its
children, answered the same way everywhere."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

# How often a condition is polled by default: finer than any recovery time worth reporting.
POLL_S = 0.05


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str, poll_s: float = POLL_S) -> float:
    """Poll `condition` until it is true; the seconds that took, or TimeoutError naming `what`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)
    return time.monotonic() - start


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
