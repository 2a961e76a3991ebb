"""The state one worker app shares among its route handlers and the extra start-up contexts (Redis
registry, event publishers): one `Runtime` under `app[RUNTIME]`, so no module needs another's globals."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiohttp import web

from workers.admission import Admission
from workers.bundled_worker import Worker
from workers.event_feed import EventFeed
from workers.kv_handoff import Puller
from workers.worker_metrics import WorkerMetrics


@dataclass(slots=True)
class Runtime:
    """Per-app state: what the handlers and the extra startup contexts share."""

    worker: Worker
    metrics: WorkerMetrics
    feed: EventFeed
    admission: Admission
    started: float = field(default_factory=time.time)
    # One thread: HF tokenizers are not safe to encode from several threads at once.
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
    )
    # The decode side of disaggregation, live while the app runs (None but on a decode worker).
    puller: Puller | None = None


RUNTIME = web.AppKey("runtime", Runtime)
Context = Callable[[web.Application], AsyncIterator[None]]
