"""What one replay measured: each streamed answer's timings and counts, and the summary a run reports
(latency percentiles, hit rate, the replica spread, moved turns, the gateway's predicted TTFT and
cached tokens against those seen). A module of its own so that the load generator, the fleet
comparison and the benches that read its results (overhead, soak, vllm) share it without importing
one another."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request that streamed to its end."""

    ttft_s: float
    itl_s: tuple[float, ...]
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    replica: str
    # Which session's which turn it was (None: a request of no session, as closed_loop's).
    session: int | None = None
    turn: int = 0
    # The gateway's predicted wait for its first token there (None: not a prefixgate gateway's answer).
    predicted_ttft_s: float | None = None
    # The prompt tokens the gateway's index expected the replica to hold (None: no gateway's answer).
    predicted_cached_tokens: int | None = None


@dataclass(slots=True)
class ReplayResult:
    url: str
    sent: int
    # From the first scheduled send to the last completion: the span throughput is measured over.
    elapsed_s: float
    records: list[RequestRecord] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def completed(self) -> int:
        return len(self.records)

    def summary(self) -> dict[str, Any]:
        records = self.records
        prompt = sum(r.prompt_tokens for r in records)
        span = max(self.elapsed_s, 1e-9)
        return {
            "url": self.url,
            "sent": self.sent,
            "completed": self.completed,
            "errors": dict(sorted(self.errors.items())),
            "ttft_s": latency_stats([r.ttft_s for r in records]),
            "itl_s": latency_stats([x for r in records for x in r.itl_s]),
            "e2e_s": latency_stats([r.e2e_s for r in records]),
            "hit_rate": sum(r.cached_tokens for r in records) / prompt if prompt else 0.0,
            "requests_per_replica": dict(sorted(Counter(r.replica for r in records).items())),
            "moved_turns": moved_turns(records),
            "hit_rate_by_turn": hit_rate_by_turn(records),
            "ttft_predicted": ttft_predicted(records),
            "cached_predicted": cached_predicted(records),
            "throughput_req_s": self.completed / span,
            "output_tok_s": sum(r.output_tokens for r in records) / span,
            "elapsed_s": self.elapsed_s,
        }


def pooled(results: Sequence[ReplayResult]) -> ReplayResult:
    """Replays of one workload read as one: their records together, each replay's sessions numbered
    apart (a turn of one is never read as the next turn of another's), errors and spans added."""
    if not results:
        raise ValueError("pooled: no results")
    span = 1 + max((r.session for res in results for r in res.records if r.session is not None), default=0)
    records = [
        replace(r, session=r.session + k * span) if r.session is not None else r
        for k, res in enumerate(results)
        for r in res.records
    ]
    errors: Counter[str] = Counter()
    for res in results:
        errors.update(res.errors)
    return ReplayResult(
        results[0].url, sum(r.sent for r in results), sum(r.elapsed_s for r in results), records, errors
    )


def moved_turns(records: Sequence[RequestRecord]) -> float | None:
    """Of the sessions' turns whose previous turn was answered too, the share served by another
    replica than that turn: a history recomputed there, and held twice. None when no session had two
    answered turns in a row (sessions of one turn: nothing can move)."""
    served = {(r.session, r.turn): r.replica for r in records if r.session is not None}
    pairs = [(replica, served[s, k - 1]) for (s, k), replica in served.items() if (s, k - 1) in served]
    return sum(now != before for now, before in pairs) / len(pairs) if pairs else None


def hit_rate_by_turn(records: Sequence[RequestRecord]) -> dict[int, float]:
    """Cached over prompt tokens for each turn number of the sessions' requests: where a policy's
    hits are won or lost (a first turn finds only its tenant's prompt; a later one, its history)."""
    totals: dict[int, list[int]] = {}
    for r in records:
        if r.session is not None:
            cached_prompt = totals.setdefault(r.turn, [0, 0])
            cached_prompt[0] += r.cached_tokens
            cached_prompt[1] += r.prompt_tokens
    return {turn: cached / prompt for turn, (cached, prompt) in sorted(totals.items()) if prompt}


def ttft_predicted(records: Sequence[RequestRecord]) -> float | None:
    """The routing model checked against measurement: the mean TTFT the gateway predicted for its
    answers over the mean TTFT the client saw (1: the model holds; below: the fleet is slower than it
    believes; None: no prediction, as from a peer router)."""
    pairs = [(r.predicted_ttft_s, r.ttft_s) for r in records if r.predicted_ttft_s is not None]
    observed = sum(seen for _, seen in pairs)
    return sum(p for p, _ in pairs) / observed if pairs and observed > 0 else None


def cached_predicted(records: Sequence[RequestRecord]) -> dict[str, float | None] | None:
    """The index checked against the replicas: the cached tokens it expected over those the replicas
    reported (ratio), and the shares of requests where it expected fewer (under: the replica held
    what the index had dropped) or more (over: it had evicted what the index still counted). An exact
    index reads 1 / 0 / 0 where it and the replicas count the same tokens; None: no prediction (the
    ratio alone: nothing reported cached)."""
    pairs = [
        (r.predicted_cached_tokens, r.cached_tokens) for r in records if r.predicted_cached_tokens is not None
    ]
    if not pairs:
        return None
    seen = sum(s for _, s in pairs)
    return {
        "ratio": sum(p for p, _ in pairs) / seen if seen else None,
        "under": sum(p < s for p, s in pairs) / len(pairs),
        "over": sum(p > s for p, s in pairs) / len(pairs),
    }


def latency_stats(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and tail percentiles; None when nothing was measured (a zero would read as instant)."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    array = np.asarray(values)
    points = np.percentile(array, PERCENTILES)
    return {
        "mean": float(array.mean()),
        **{f"p{p}": float(v) for p, v in zip(PERCENTILES, points, strict=True)},
    }
