"""Simulated workers publishing their KV events and load to Redis, served in-process for a test."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from tests.support.servers import ServerThread
from workers.kv_event_log import KVEventLog
from workers.sim.sim_engine import SimEngine

BLOCK_SIZE = 4


@dataclass
class PublishedWorker:
    url: str
    worker_id: str
    sim: SimEngine
    events: KVEventLog
    server: ServerThread

    def complete(self, ids: list[int], max_tokens: int, **extra: Any) -> httpx.Response:
        body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        return response

    def snapshot(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/kv/snapshot").json()


StartWorker = Callable[..., PublishedWorker]
