"""A caller that leaves before the engine thread ran its command (a client gone, a /load that timed
out) must not take the engine thread down with it, nor leave its request running."""

from __future__ import annotations

import asyncio
import threading
import time

from tests.support.sims import SMALL
from workers.engine.llm import AsyncLLM
from workers.engine.sampling_params import SamplingParams
from workers.sim.runner import VirtualClock
from workers.sim.sim_engine import SimEngine


def test_a_cancelled_command_is_skipped_and_the_engine_thread_lives() -> None:
    llm = AsyncLLM(SimEngine(SMALL, clock=VirtualClock()))  # type: ignore[arg-type]
    try:
        release = threading.Event()
        llm._commands.put(release.wait)  # the engine thread is busy
        left = llm._call(lambda: 42)
        assert left.cancel()
        release.set()
        # Answered in time: the engine thread outlived the cancelled command.
        assert asyncio.run(asyncio.wait_for(llm.stats(), 5)).running == 0
        assert left.cancelled() and llm._thread.is_alive()
    finally:
        llm.shutdown()


def test_a_request_cancelled_while_being_added_is_aborted() -> None:
    llm = AsyncLLM(SimEngine(SMALL, clock=VirtualClock()))  # type: ignore[arg-type]

    async def leave_during_add() -> None:
        release = threading.Event()
        llm._commands.put(lambda: release.wait(5))
        stream = llm.generate(list(range(40)), SamplingParams(max_tokens=10_000, ignore_eos=True))
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        task.cancel()
        release.set()
        await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(leave_during_add())
        deadline = time.monotonic() + 5
        while (stats := asyncio.run(asyncio.wait_for(llm.stats(), 5))).running or stats.waiting:
            assert time.monotonic() < deadline, "the request of a caller gone kept running"
            time.sleep(0.01)
        assert llm._thread.is_alive()
    finally:
        llm.shutdown()
