"""How long a prompt's KV takes to move from a prefill replica to a decode replica.

A transfer is one message of `bytes` over the sending GPU's network link: a fixed latency (the
handshake that names the blocks, the completion notice) plus the bytes at the link's sustained
bandwidth. Whether links are shared, and by whom, is the simulator's business (bench.pd_fleet queues
the transfers that use one link at once); this is the time of one on an idle link.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KvLink:
    bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be positive, got {self.bytes_per_s}")
        if not self.latency_s >= 0:
            raise ValueError(f"latency_s must be a non-negative number of seconds, got {self.latency_s}")

    def time(self, num_bytes: int) -> float:
        """Seconds to move `num_bytes` on an idle link; nothing to move takes no time at all."""
        if num_bytes < 0:
            raise ValueError(f"num_bytes must not be negative, got {num_bytes}")
        return self.latency_s + num_bytes / self.bytes_per_s if num_bytes else 0.0
