"""The cancellation that asyncio.wait_for drops on Python 3.11 (as redis-py's command sends meet it)
still stops a loop that checks for it."""

from __future__ import annotations

import asyncio
import sys

import pytest

from protocol.cancellation import check_cancelled


async def _cancel_as_the_send_completes(checked: bool) -> asyncio.Task[None]:
    """A loop that awaits a `wait_for` per round, like a Redis command, cancelled in the same loop
    iteration as its current round's future completes; the task, 0.1 s later."""
    loop = asyncio.get_running_loop()
    sends: asyncio.Queue[asyncio.Future[None]] = asyncio.Queue()

    async def follower() -> None:
        while True:
            if checked:
                check_cancelled()
            send: asyncio.Future[None] = loop.create_future()
            sends.put_nowait(send)
            await asyncio.wait_for(send, timeout=60)

    task = asyncio.create_task(follower())
    send = await sends.get()
    await asyncio.sleep(0)
    send.set_result(None)
    task.cancel()
    await asyncio.wait({task}, timeout=0.1)
    return task


def test_a_loop_that_checks_stops_though_wait_for_dropped_the_cancel() -> None:
    async def main() -> None:
        task = await _cancel_as_the_send_completes(checked=True)
        assert task.cancelled()

    asyncio.run(main())


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps the cancel from 3.12 on")
def test_without_the_check_the_loop_runs_on() -> None:
    """The CPython behaviour the check exists for (gh-86296): the same loop, unchecked, is still
    running after its cancel."""

    async def main() -> None:
        task = await _cancel_as_the_send_completes(checked=False)
        assert not task.done() and task.cancelling() == 1
        task.cancel()
        await asyncio.wait({task}, timeout=1)
        assert task.cancelled()

    asyncio.run(main())
