"""What the gateway learns from one answered request: its metrics, the replica's measured prefill, and
for a replica whose cache is predicted, the correction of that prediction by what the replica reports
reusing (Predictions.learn).

Reported counts come from the usage object at the end of an answer, in the replica's own tokens, or
without one from a bundled worker's cached-tokens header, in the gateway's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from aiohttp import web

from gateway.fleet.replicas import Replica
from gateway.forward.request_view import PREFIX_ROUTES
from gateway.forward.routed import Routed
from gateway.forward.sse_events import usage_numbers
from gateway.forward.upstream import header_count
from gateway.gateway_state import GatewayState
from policies.prefix_aware import prefill_wait_s
from protocol.openai_responses import CACHED_TOKENS_HEADER
from radix.reports import realised_blocks

# How much of an answer's end is kept to read its usage from.
TAIL_BYTES = 2048
# A replica's token count above this is no count (a float, which metrics add in, holds no more exactly).
_MAX_COUNT = 2**53
# Set on a request once its outcome is counted, so that the cancellation of a client that left is not
# counted again, unlabelled, by the middleware.
ACCOUNTED = web.RequestKey("accounted", bool)
Usage = tuple[int | None, int | None]


def reported_usage(headers: Mapping[str, str], tail: bytes, replica: Replica) -> Usage:
    """(prompt_tokens, cached_tokens) as the replica reported them: the usage object at the end of its
    answer, which counts both in the replica's own unit; without one, a bundled worker's header, whose
    count is of the gateway's ids (a worker declared foreign tokenizes the text itself, in its own)."""
    prompt, cached = (n if n is not None and n <= _MAX_COUNT else None for n in usage_numbers(tail))
    if cached is None and replica.kind == "bundled" and CACHED_TOKENS_HEADER in headers:
        return None, header_count(headers[CACHED_TOKENS_HEADER])
    return prompt, cached


def account(
    state: GatewayState, routed: Routed, replica: Replica, status: int, usage: Usage | None, *, paired: bool
) -> None:
    """Count the request's end on `replica` and, for a success, learn from what the replica reported."""
    m = state.metrics
    m.child(m.requests, routed.model, replica.id, routed.decision.policy, str(status), routed.route).inc()
    m.child(m.e2e, routed.model, replica.id).observe(time.monotonic() - routed.arrival)
    if status != 200:
        return
    view = routed.decision.view_of(replica.id)
    prompt = routed.decision.prompt_tokens
    m.child(m.prompt_tokens, routed.model, replica.id).inc(prompt)
    m.child(m.predicted_cached, routed.model, replica.id).inc(min(view.cached_tokens, prompt))
    reported_prompt, cached = usage or (None, None)
    if cached is not None:
        m.child(m.realised_cached, routed.model, replica.id).inc(cached)
        _learn(state, routed, replica, reported_prompt, cached, paired)
    hashes = routed.decision.hashes.get(replica.block_size)
    if routed.route in PREFIX_ROUTES and hashes and not replica.precise:
        state.predictions.released(replica.id, hashes)


def _learn(
    state: GatewayState,
    routed: Routed,
    replica: Replica,
    reported_prompt: int | None,
    cached: int,
    paired: bool,
) -> None:
    """Correct the predicted cache of `replica` by what it reports it reused of this prompt.

    The report counts the replica's own tokens in its own blocks, which need not be the gateway's:
    radix.reports reads it in the gateway's blocks, a shortfall within its rounding being no evidence.
    A replica that was not the first choice was not predicted to hold the prompt; it has it now. A
    decode replica paired with a prefill replica received the prompt's KV: what it reports reusing
    says nothing of what it held before."""
    hashes = routed.decision.hashes.get(replica.block_size)
    if routed.route not in PREFIX_ROUTES or not hashes or replica.precise:
        return
    first = replica.id == routed.decision.order[0]
    if not paired:
        predicted = (
            routed.predicted
            if first
            else state.index.predicted(replica.id, hashes, replica.pending_horizon())
        )
        if predicted is None:
            return
        replica.reported.observe(cached)
        realised = realised_blocks(
            predicted.blocks,
            cached,
            reported_prompt,
            routed.decision.prompt_tokens,
            replica.block_size,
            replica.reported.block(replica.block_size),
            len(hashes),
        )
        state.predictions.learn(replica.id, predicted, realised)
    if not first:
        state.predictions.record(replica.id, hashes)


def first_token(state: GatewayState, routed: Routed, replica: Replica, handle: int) -> None:
    """The first output on `replica`: its TTFT beside the routing model's, and its prefill rate learned."""
    ttft = time.monotonic() - routed.arrival
    state.metrics.child(state.metrics.ttft, routed.model, replica.id).observe(ttft)
    predicted = prefill_wait_s(routed.decision.prompt_tokens, routed.decision.view_of(replica.id))
    state.metrics.child(state.metrics.predicted_ttft, routed.model, replica.id).observe(predicted)
    learn = state.config.learning
    state.replicas.started(replica, handle, ttft, alpha=learn.ewma_alpha, min_tokens=learn.min_prefill_tokens)
