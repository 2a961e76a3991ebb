"""Latency as a streaming client sees it, and goodput: the requests served within their targets.

Goodput is DistServe's measure: a request counts only if it meets BOTH its time-to-first-token and
its inter-token-latency target, because a fast first token followed by a stuttering stream, or a
smooth stream after a long wait, fails the user all the same. The ITL target applies to a request's
mean gap (its TPOT as DistServe defines it: decode speed, what a reader perceives), while the fleet's
tail of single gaps (p99 over every gap of every request) is reported beside it: that is where one
long prefill batched with running decodes shows, as a stall of every stream at once.

A mean hides such a stall: 500 tokens at 30 ms with one 2 s freeze still average 34 ms. Stall-free
goodput is the second measure, for what disaggregation is for: a request counts if it meets the
TTFT target and its worst single gap stays within a stall target (a freeze a user sees). It is
reported beside goodput, never instead of it.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Slo:
    """Targets per request; the defaults suit an 8B model on an H100 (a chat UI's 2 s to start,
    20 tokens/s of reading speed and more, and no freeze of a quarter second or longer, which a
    reader notices as the text stopping)."""

    ttft_s: float = 2.0
    itl_s: float = 0.05
    stall_s: float = 0.25

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0 and self.stall_s > 0):
            raise ValueError(
                f"SLO targets must be positive, got TTFT {self.ttft_s} s, ITL {self.itl_s} s, "
                f"stall {self.stall_s} s"
            )


@dataclass(frozen=True, slots=True)
class RequestLatency:
    """One completed request."""

    ttft_s: float
    # The mean and the longest gap between its tokens; None for a one-token answer, which has no gap
    # to miss.
    mean_itl_s: float | None
    max_itl_s: float | None
    # From the end of its prefill on a prefill replica to its KV installed on the decode replica,
    # waits for a busy link included (0 when nothing moved), and the bytes that moved.
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    # How long the decode replica waited for room to receive the prompt's KV before it reserved it or
    # gave up and computed the prompt itself (part of the TTFT).
    reserve_wait_s: float = 0.0

    def meets(self, slo: Slo) -> bool:
        """Goodput's test: the TTFT and the mean-ITL (TPOT) targets."""
        return self.ttft_s <= slo.ttft_s and (self.mean_itl_s is None or self.mean_itl_s <= slo.itl_s)

    def stall_free(self, slo: Slo) -> bool:
        """Stall-free goodput's test: the TTFT target and no gap longer than the stall target."""
        return self.ttft_s <= slo.ttft_s and (self.max_itl_s is None or self.max_itl_s <= slo.stall_s)


@dataclass(frozen=True, slots=True)
class LatencySummary:
    requests: int
    completed: int
    ttft_mean_s: float
    ttft_p99_s: float
    # Over every gap between consecutive tokens of every request.
    itl_mean_s: float
    itl_p99_s: float
    # The mean over requests of each one's mean gap (what the ITL target is checked against).
    request_itl_mean_s: float
    # Goodput: the requests within the TTFT and mean-ITL targets, as a share of all and per second.
    goodput_share: float
    goodput_rps: float
    # Stall-free goodput: the requests within the TTFT and stall targets, likewise.
    stall_free_share: float
    stall_free_rps: float
    # Transfer time over TTFT, summed over all requests: the part of waiting for the first token
    # that moving the KV costs.
    transfer_share: float
    transferred_gb: float
    # Likewise the part that decode replicas spent waiting for room to receive KV.
    reserve_wait_share: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def _p99(values: Sequence[float]) -> float:
    return float(np.percentile(values, 99)) if len(values) else 0.0


def summarize(
    latencies: Sequence[RequestLatency], gaps: Sequence[float], requests: int, span_s: float, slo: Slo
) -> LatencySummary:
    """The summary of a run of `requests` requests (those missing from `latencies` were refused and
    count against both goodputs) over `span_s` seconds, from the first arrival to the last token."""
    ttfts = [r.ttft_s for r in latencies]
    per_request = [r.mean_itl_s for r in latencies if r.mean_itl_s is not None]
    good = sum(r.meets(slo) for r in latencies)
    smooth = sum(r.stall_free(slo) for r in latencies)
    ttft_total = sum(ttfts)

    def share_of_ttft(seconds: float) -> float:
        return seconds / ttft_total if ttft_total > 0 else 0.0

    return LatencySummary(
        requests=requests,
        completed=len(latencies),
        ttft_mean_s=_mean(ttfts),
        ttft_p99_s=_p99(ttfts),
        itl_mean_s=_mean(gaps),
        itl_p99_s=_p99(gaps),
        request_itl_mean_s=_mean(per_request),
        goodput_share=good / requests if requests else 0.0,
        goodput_rps=good / span_s if span_s > 0 else 0.0,
        stall_free_share=smooth / requests if requests else 0.0,
        stall_free_rps=smooth / span_s if span_s > 0 else 0.0,
        transfer_share=share_of_ttft(sum(r.transfer_s for r in latencies)),
        transferred_gb=sum(r.transfer_bytes for r in latencies) / 1e9,
        reserve_wait_share=share_of_ttft(sum(r.reserve_wait_s for r in latencies)),
    )
