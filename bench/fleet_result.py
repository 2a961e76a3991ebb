"""What one fleet simulation measured (bench.fleet), in a module of its own: the fleet simulator and
the expert-parallel layouts it reports (bench.fleet_ep) both read it, and neither imports the other
for it."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FleetResult:
    hit_rate: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_tok_s: float
    imbalance: float
    completed: int
    rejected: int
    # Of the sessions' later turns, the share served elsewhere than the turn before (a history moved).
    moved_turns: float = 0.0

    @classmethod
    def mean(cls, results: Sequence[FleetResult]) -> FleetResult:
        """Runs of one (policy, mode) over several seeds: each measure's mean, the counts' sums."""
        return cls(
            hit_rate=statistics.fmean(r.hit_rate for r in results),
            ttft_mean_s=statistics.fmean(r.ttft_mean_s for r in results),
            ttft_p50_s=statistics.fmean(r.ttft_p50_s for r in results),
            ttft_p99_s=statistics.fmean(r.ttft_p99_s for r in results),
            throughput_tok_s=statistics.fmean(r.throughput_tok_s for r in results),
            imbalance=statistics.fmean(r.imbalance for r in results),
            completed=sum(r.completed for r in results),
            rejected=sum(r.rejected for r in results),
            moved_turns=statistics.fmean(r.moved_turns for r in results),
        )

    def summary(self) -> dict[str, float]:
        return {
            "hit_rate": self.hit_rate,
            "ttft_mean_s": self.ttft_mean_s,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p99_s": self.ttft_p99_s,
            "throughput_tok_s": self.throughput_tok_s,
            "imbalance": self.imbalance,
            "moved_turns": self.moved_turns,
        }
