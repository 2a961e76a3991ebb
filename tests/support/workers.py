"""Workers for tests, served in-process on loopback ports: a running worker and the ways to start
one, and what tests ask of one (its load, whether it is idle, slower engine steps)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai
from aiohttp import web

from tests.support.servers import ServerThread
from workers.bundled_worker import Worker
from workers.engine.engine_core import Engine, EngineConfig
from workers.engine.loader import LoadedModel
from workers.kv_event_log import KVEventLog
from workers.worker_app import create_app


@dataclass
class RunningWorker:
    url: str
    engine: Engine
    worker: Worker
    app: web.Application

    def client(self, **kwargs: Any) -> openai.OpenAI:
        """The official client, with no retries (a 429 must surface, not be waited out)."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)

    @property
    def model(self) -> str:
        return self.worker.info.model


StartWorker = Callable[..., RunningWorker]


def start_worker(
    loaded: LoadedModel,
    config: EngineConfig,
    *,
    event_capacity: int = 4096,
    **limits: int,
) -> tuple[RunningWorker, ServerThread]:
    events = KVEventLog(capacity=event_capacity)
    engine = Engine(loaded, config, **events.callbacks())
    worker = Worker.around(
        engine,
        events,
        worker_id="test",
        backend=engine.runner.attention.name,
        backend_reason=engine.runner.attention_reason,
        **limits,
    )
    return serve_worker(worker, engine)


def serve_worker(worker: Worker, engine: Any) -> tuple[RunningWorker, ServerThread]:
    app = create_app(worker)
    server = ServerThread(app)
    url = server.start()
    return RunningWorker(url, engine, worker, app), server


def slow_down(worker: RunningWorker, seconds: float) -> None:
    """Make every engine step take at least `seconds`, so that a request is still running when the
    test acts on it (the tiny model is otherwise done in milliseconds)."""
    engine = worker.engine
    step = engine.step

    def slow_step() -> list:
        time.sleep(seconds)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]


def load(worker: RunningWorker) -> dict:
    return httpx.get(f"{worker.url}/load", timeout=10).json()


def idle(worker: RunningWorker) -> bool:
    """No sequence running or waiting, and every KV block released."""
    now = load(worker)
    return now["running"] == now["waiting"] == now["kv_blocks_used"] == 0


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]
