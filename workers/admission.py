"""The worker's bounded waiting queue: past it a request is refused with 429 at once rather than
queued behind work it cannot outwait (docs/design.md §4)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from protocol.errors import RETRY_AFTER_S, ApiError


class Admission:
    """The bounded waiting queue: requests accepted but not yet generating (tokenizing, or queued in
    the engine). Counted here on the event loop, so the check is exact and needs no engine call."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_waiting must be at least 1, got {limit}")
        self.limit = limit
        self.waiting = 0

    @contextmanager
    def slot(self) -> Iterator[Callable[[], None]]:
        """Claim a place or refuse with 429; yields `release`, to call once generation starts."""
        if self.waiting >= self.limit:
            raise ApiError(
                429,
                f"the worker's waiting queue is full ({self.limit} requests); retry shortly",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.waiting += 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.waiting -= 1

        try:
            yield release
        finally:
            release()
