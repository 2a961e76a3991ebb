"""Entries that Redis or a replica's event socket handed the gateway and that failed validation.

Whatever reaches the gateway that way is input like a client's: one bad value must cost one entry,
never discovery, a follower or the metrics. Each reader skips what fails and reports it here, where it
is counted by source (the metric prefixgate_gateway_rejected_entries_total) and logged at most once
per source every LOG_EVERY_S, so a bad value read at every poll does not flood the log.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Literal

log = logging.getLogger("prefixgate.gateway.rejected")

# registry: a worker's registry entry; load: its load key; kv_stream: an entry of its KV stream in
# Redis; kv_events: a batch or snapshot its /kv/events or /kv/snapshot answered; predictions: an entry of
# the shared predictions stream; zmq: a KV event message over ZMQ; kubernetes: a pod, EndpointSlice or
# InferencePool read from the cluster.
Source = Literal["registry", "load", "kv_stream", "kv_events", "predictions", "zmq", "kubernetes"]
LOG_EVERY_S = 60.0


class Rejections:
    """Counts and logs rejected entries; `on_reject` (the gateway's metric) sees each one."""

    def __init__(self, on_reject: Callable[[Source], None] | None = None) -> None:
        self.on_reject = on_reject
        self.counts: Counter[str] = Counter()
        self._logged: dict[str, float] = {}

    def reject(self, source: Source, what: str, error: object) -> None:
        self.counts[source] += 1
        if self.on_reject is not None:
            self.on_reject(source)
        now = time.monotonic()
        last = self._logged.get(source)
        if last is None or now - last >= LOG_EVERY_S:
            self._logged[source] = now
            log.warning(
                "rejected %s (%s): %s; skipped (%d %s entries rejected so far, logged at most every %.0f s)",
                what,
                source,
                error,
                self.counts[source],
                source,
                LOG_EVERY_S,
            )
