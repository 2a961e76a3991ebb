"""The follower tasks of an index sync: one task per followed replica, with the state it keeps live.

Both transports of KV events (gateway.sync.bundled_events over HTTP or Redis, gateway.sync.zmq_events
over ZMQ) follow replicas the same way: the replica set starts a follower after `index.add_replica` and
stops it before `index.drop_replica`. Stopping cancels the task at once; a cancelled task runs nothing
past its current await, so the follower touches the index no more once `stop` returns, and `close`
waits for every cancelled task to finish.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from gateway.sync.state import SyncState


class Followers:
    def __init__(self) -> None:
        self._states: dict[str, SyncState] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    def get(self, replica_id: str) -> SyncState | None:
        return self._states.get(replica_id)

    @property
    def states(self) -> dict[str, SyncState]:
        """The followed replicas' states by id (a copy; the states themselves are live)."""
        return dict(self._states)

    def start(
        self, replica_id: str, state: SyncState, follow: Coroutine[Any, Any, None], name: str
    ) -> SyncState:
        self._states[replica_id] = state
        self._tasks[replica_id] = asyncio.create_task(follow, name=f"{name}:{replica_id}")
        return state

    def stop(self, replica_id: str) -> None:
        self._states.pop(replica_id, None)
        task = self._tasks.pop(replica_id, None)
        if task is not None:
            task.cancel()
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    async def close(self) -> None:
        for replica_id in list(self._tasks):
            self.stop(replica_id)
        await asyncio.gather(*self._stopping, return_exceptions=True)
