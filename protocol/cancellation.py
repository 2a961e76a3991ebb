"""Cancellation that redis-py can drop, and the check that restores it.

redis-py sends every command under `asyncio.wait_for`. On Python 3.11 wait_for returns the result
and drops the CancelledError when the cancel lands in the same loop iteration as the send completes
(CPython gh-86296, fixed in 3.12 by rebuilding wait_for on asyncio.timeout). A background loop
cancelled at that moment would run on for ever, and whoever awaits it on shutdown would hang with it.
The task still counts the request (`Task.cancelling()`), so loops that talk to Redis call
`check_cancelled` after their Redis calls and stop as asked.
"""

from __future__ import annotations

import asyncio


def check_cancelled() -> None:
    """Raise CancelledError if this task was asked to stop and the request went missing."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
