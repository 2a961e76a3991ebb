"""How a background task that talks to something that may be down (a replica's event feed, Redis)
retries: bounded exponential delays, reset by a success, the same in the gateway and the workers. It
logs nothing itself: `failing` lets each caller write one line when an outage starts and one when it
ends, in its own words, rather than one per attempt."""

from __future__ import annotations

from dataclasses import dataclass, field

# The gateway's followers: a first retry soon enough to hide a blip, and a bound that keeps a replica
# (or Redis) that comes back from waiting long to be followed again.
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 2.0


@dataclass(slots=True)
class Backoff:
    """Bounded exponential retry delays, reset by a success."""

    first_s: float = RETRY_FIRST_S
    most_s: float = RETRY_MAX_S
    delay: float = field(default=0.0, init=False)

    @property
    def failing(self) -> bool:
        """Whether the last attempt failed. Read before `failed` or `succeeded`: False at the first
        failure of an outage, True at the success that ends one."""
        return self.delay > 0.0

    def failed(self) -> float:
        """The delay before the next attempt: `first_s`, then twice the last, at most `most_s`."""
        self.delay = min(self.most_s, max(self.first_s, 2 * self.delay))
        return self.delay

    def succeeded(self) -> None:
        self.delay = 0.0
