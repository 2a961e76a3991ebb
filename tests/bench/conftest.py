"""Fixtures the replay's tests share (tests/bench/test_replay.py, test_loadgen.py): one simulated
worker with the H100 cost model served over loopback HTTP, so that load goes through a real server."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from tests.support.servers import ServerThread
from workers.bundled_worker import Worker
from workers.kv_event_log import KVEventLog
from workers.sim.profiles import Profile, get_profile
from workers.sim.runner import RealClock
from workers.sim.sim_engine import SimEngine
from workers.worker_app import create_app

# An H100-class cost model (a step of a few ms) with small blocks, so that short system prompts cache.
PROFILE = replace(get_profile("h100-8b"), block_size=16, kv_capacity_tokens=16 * 2048)


@pytest.fixture(scope="module")
def worker_profile() -> Profile:
    """The profile of `worker_url`'s worker, for tests that start workers of their own like it."""
    return PROFILE


@pytest.fixture(scope="module")
def worker_url(worker_profile: Profile) -> Iterator[str]:
    events = KVEventLog()
    sim = SimEngine(worker_profile, clock=RealClock(), **events.callbacks())
    server = ServerThread(create_app(Worker.around(sim, events, worker_id="w", backend="sim")))
    yield server.start()
    server.stop()
