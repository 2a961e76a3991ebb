"""Forward one routed request and relay the answer (docs/design.md §2 step 6).

What a client sent goes upstream as it came: the body byte for byte (a bundled worker's chat or
completion body gains only the token ids the gateway computed), the client's end-to-end headers with
it. The answer comes back the same way, status, headers and body, with the gateway's routing headers
added. A server-sent-event stream passes through chunk by chunk as the replica sends it, unparsed:
the gateway only times the chunks, and leaves out the token ids a bundled worker names for it alone
(protocol.stream_ids). Cached tokens come from the bundled worker's response header, or
for a foreign backend from the usage object at the end of its response. A Responses API answer also
names its response id, which is remembered with its replica (gateway.fleet.response_owners).

A replica that cannot be reached, refuses for overload (429, 503), or fails before any output, is
replaced by the next in the policy's order: a stream's first events that carry no output (vLLM sends
its headers and an opening role delta as soon as a request is queued) are held back until one does,
so a replica that dies with requests queued costs their clients nothing (gateway.forward.sse_events). One
that fails once output flows has its stream continued on another replica, the client seeing one
stream, where the backend can continue an answer (gateway.forward.migration says which can); where none can,
the stream ends with an error event. A non-streaming answer that breaks off reached the client not at
all, so it is retried whole like any failure before output. When every choice fails, the client gets
a replica's refusal if there was one (429 or 503, with its Retry-After: the fleet is full, not
broken), else 504 if the last attempt timed out (`limits.request_timeout_s`), else 502. A client that
goes away cancels this handler (aiohttp handler cancellation), which closes the upstream connection,
which makes a bundled worker abort the sequence and free its blocks.

What goes up is gateway.forward.payloads' and gateway.forward.relay_headers'; what the answer teaches
(metrics, prefill rates, the correction of a predicted cache) is gateway.forward.outcome's. A usage event
asked for when the client did not is left out of what the client receives.

A model served by prefill and decode replicas is routed in pairs (policies.pd): each attempt goes to a
decode replica, with the prefill side of the pair handled by gateway.forward.pd_legs; a failed attempt is
retried on the next pair, and the client gets the decode replica's answer, naming the prefill replica
in `x-prefixgate-prefill-replica`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from aiohttp import web

from gateway.fleet.replicas import Replica
from gateway.forward import payloads
from gateway.forward.failures import Failures, failed_mid_stream, stream_error, unavailable
from gateway.forward.internal_fields import client_body
from gateway.forward.migration import Continuation, Sent, StreamTap, continuation_body, sent_tokens
from gateway.forward.outcome import ACCOUNTED, TAIL_BYTES, account, first_token, reported_usage
from gateway.forward.pd_legs import REFUSALS, PrefillFailed, PrefillLeg, prefill_leg
from gateway.forward.prefill_queue import Place
from gateway.forward.relay_headers import response_headers, upstream_headers
from gateway.forward.routed import Routed
from gateway.forward.sse_events import OutputWatch, ResponseIdScan, UsageStrip, response_body_id
from gateway.forward.upstream import UpstreamError, UpstreamResponse, error_kind
from gateway.gateway_state import GatewayState
from protocol.errors import CLIENT_GONE, ApiError
from protocol.openai_responses import SSE_DONE
from protocol.stream_ids import STREAM_IDS_HEADER

_SSE = "text/event-stream"
# How an exchange fails when no connection to the replica was made at all.
_UNREACHED = frozenset({"connect_failed", "bad_url"})
T = TypeVar("T")


@dataclass(slots=True)
class _Attempt:
    """One try of a routed request: the replica that answers, its accounting handle, and the prefill
    side when it is paired with a prefill replica."""

    replica: Replica
    handle: int
    leg: PrefillLeg | None

    @property
    def prefill_id(self) -> str | None:
        return self.leg.prefill.id if self.leg is not None else None

    @property
    def paired(self) -> bool:
        """Whether a prefill replica computed the prompt (its reuse report is not this replica's)."""
        return self.leg is not None


async def forward(state: GatewayState, request: web.Request, routed: Routed) -> web.StreamResponse:
    limits = state.config.limits
    order = [rid for rid in routed.decision.order if rid in state.replicas][: limits.max_attempts]
    if not order:
        raise ApiError(
            503,
            unavailable(state.replicas.serving(routed.model), routed.model),
            code="no_replica_available",
            headers={"Retry-After": "1"},
        )
    failures = Failures()
    for attempt_no, rid in enumerate(order):
        replica = state.replicas.get(rid)
        if replica is None:
            continue
        final = attempt_no == len(order) - 1
        try:
            return await _attempt(state, request, routed, replica, failures, final)
        except _Retry as retry:
            _retrying(state, routed, retry.reason, final)
    raise failures.answer(routed.model, limits)


class _Retry(Exception):
    """The attempt failed before any output reached the client: the next choice can still serve it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def _attempt(
    state: GatewayState,
    request: web.Request,
    routed: Routed,
    replica: Replica,
    failures: Failures,
    final: bool,
) -> web.StreamResponse:
    """One try on `replica` (and its prefill replica, when paired): its answer relayed, or _Retry."""
    decision = routed.decision
    uncached = max(decision.prompt_tokens - decision.view_of(replica.id).cached_tokens, 0)
    first = replica.id == decision.order[0]
    recorded = routed.recorded_tick if first else None
    leg = prefill_leg(state, routed, replica)
    leaving = routed.leaving if first else None
    if leg is not None and leaving is not None:
        leaving()  # a paired attempt waits for its prefill side before this request is written
        leaving = None
    # A paired decode replica receives the prompt's KV rather than computing it; it holds it either way.
    computed = 0 if leg is not None else uncached
    blocks = -(-uncached // replica.block_size)
    handle = state.replicas.dispatched(replica, time.monotonic(), computed, recorded, blocks)
    attempt = _Attempt(replica, handle, leg)
    upstream: UpstreamResponse | None = None
    place: Place | None = None
    try:
        if leg is None and state.config.limits.prefill_depth is not None:
            prefill_s = computed / decision.view_of(replica.id).prefill_rate
            place = await _queued(state, routed, replica, prefill_s)
        fields = (
            await leg.start(upstream_headers(state.config, routed, routed.raw)) if leg is not None else {}
        )
        learns_usage = not replica.precise and state.config.approximate.request_usage
        payload, strip_usage = payloads.payload(routed, replica, learns_usage, fields)
        headers = upstream_headers(state.config, routed, payload, leg.headers if leg is not None else None)
        if payloads.reads_ids(routed, replica):
            headers[STREAM_IDS_HEADER] = "1"
        if leg is not None:
            leg.sending(payload, headers)
        upstream = await _guarded(leg, _send(state, routed, replica, payload, headers, leaving))
        if leg is not None:
            leg.on_head(upstream.headers)
        if upstream.status in REFUSALS and not final:
            failures.refused(state, replica, upstream.status, upstream.headers, routed.model)
            raise _Retry(f"http_{upstream.status}")
        if upstream.status == 200 and upstream.headers.get("Content-Type", "").startswith(_SSE):
            first = await _guarded(leg, _until_output(upstream))
            if place is not None:
                place.free()
            if leg is not None:
                leg.answered()
            return await _relay_stream(state, request, routed, attempt, upstream, first, strip_usage)
        if place is not None:
            # A whole answer shows no first output: its place goes once its prefill should be done.
            asyncio.get_running_loop().call_later(prefill_s, place.free)
        body = await _guarded(leg, upstream.read())
        if leg is not None and upstream.status == 200:
            leg.answered()
        return await _relay_body(state, routed, attempt, upstream.status, upstream.headers, body)
    except PrefillFailed as error:
        assert leg is not None
        if error.client_error:
            # The client's mistake, which the decode replica would refuse alike: the answer.
            return await _relay_body(state, routed, attempt, error.status or 400, error.headers, error.body)
        if error.refused and error.status is not None:
            failures.refused(state, leg.prefill, error.status, error.headers, routed.model)
        else:
            failures.failed(state, leg.prefill, error.kind, str(error))
        raise _Retry(error.kind) from None
    except (TimeoutError, UpstreamError) as error:
        # The replica failed before the client saw any output: the next choice can still serve it.
        if upstream is not None:
            when = "failed before its first output"
        else:
            when = "could not be reached" if error_kind(error) in _UNREACHED else "gave no answer"
        failures.failed(state, replica, error_kind(error), f"replica {replica.id} {when}: {error!r}")
        raise _Retry(error_kind(error)) from None
    except asyncio.CancelledError:
        # The client left while an answer was awaited: counted with the replica it was on (one that
        # leaves before the answer's head is counted unlabelled, by the middleware).
        if upstream is not None and not request.get(ACCOUNTED):
            account(state, routed, attempt.replica, CLIENT_GONE, None, paired=attempt.paired)
            request[ACCOUNTED] = True
        raise
    finally:
        if place is not None:
            place.free()
        if upstream is not None:
            # Back to the pool when read to the end; closed otherwise (the client left, or a refusal
            # went unread), which is what tells a worker to abort.
            upstream.release()
        state.replicas.finished(replica, handle)
        if leg is not None:
            await leg.close()


async def _queued(state: GatewayState, routed: Routed, replica: Replica, prefill_s: float) -> Place:
    """A place among the prompts `replica` computes at once (limits.prefill_depth), waited for up to the
    request timeout: a TimeoutError then, as from a replica that gave no answer."""
    start = time.monotonic()
    pending = state.prefill_queue.enter(replica.id, start, prefill_s)
    place = await asyncio.wait_for(pending, state.config.limits.request_timeout_s)
    waited = time.monotonic() - start
    state.metrics.child(state.metrics.prefill_queue_wait, routed.model, replica.id).observe(waited)
    return place


def _send(
    state: GatewayState,
    routed: Routed,
    replica: Replica,
    payload: bytes,
    headers: Mapping[str, str],
    leaving: Callable[[], None] | None = None,
) -> Awaitable[UpstreamResponse]:
    """The request to `replica` under the gateway's connect and request timeouts; `leaving` called as it
    is written (gateway.forward.upstream_client)."""
    limits = state.config.limits
    return state.upstream.request(
        routed.method,
        replica.url,
        routed.target,
        payload,
        headers,
        connect_s=limits.connect_timeout_s,
        read_s=limits.request_timeout_s,
        leaving=leaving,
    )


async def _guarded(leg: PrefillLeg | None, pending: Awaitable[T]) -> T:
    """A wait for the replica that answers, given up if its prefill side fails first."""
    return await (leg.guard(pending) if leg is not None else pending)


async def _until_output(upstream: UpstreamResponse) -> bytes:
    """A stream's first chunks, up to the first whole event that carries output (or the stream's end):
    what may be held back from the client while the replica can still be replaced (a bounded
    amount: gateway.forward.sse_events.OutputWatch)."""
    watch = OutputWatch()
    held = [await upstream.read_chunk()]
    while not watch.feed(held[-1]) and not upstream.at_end:
        held.append(await upstream.read_chunk())
    return b"".join(held)


def _retrying(state: GatewayState, routed: Routed, reason: str, final: bool) -> None:
    if not final:
        state.metrics.child(state.metrics.retries, routed.model, reason).inc()


async def _relay_body(
    state: GatewayState,
    routed: Routed,
    attempt: _Attempt,
    status: int,
    headers: Mapping[str, str],
    body: bytes,
) -> web.Response:
    if status == 200:
        first_token(state, routed, attempt.replica, attempt.handle)
        if routed.route == "responses":
            response_id = response_body_id(body)
            if response_id is not None:
                await state.response_owners.remember(response_id, attempt.replica.id)
    account(
        state,
        routed,
        attempt.replica,
        status,
        reported_usage(headers, body[-TAIL_BYTES:], attempt.replica),
        paired=attempt.paired,
    )
    return web.Response(
        body=body,
        status=status,
        headers=response_headers(headers, routed.decision, attempt.replica.id, attempt.prefill_id),
    )


class _Stream(web.StreamResponse):
    """A relayed stream whose head goes out with its first chunk, in one write: the stream is prepared
    only once its first output is in hand (_until_output), so nothing is gained by sending the head
    alone, and the client wakes once for both. (aiohttp's switch for this, which its Response sets the
    same way; without it the head goes alone, as before.)"""

    _send_headers_immediately = False


@dataclass(slots=True)
class _Relay:
    """One client stream as it is relayed, from one replica or, continued (gateway.forward.migration), from
    several: the filters each chunk passes, the tail of what came (for usage and [DONE]), and the
    attempt answering now."""

    state: GatewayState
    routed: Routed
    response: web.StreamResponse
    attempt: _Attempt
    strip: UsageStrip | None
    # What the client has received, for a continuation (and a bundled worker's token ids left out).
    tap: StreamTap | None
    # How a replica of the answering kind can continue this stream (None: none can).
    how: Continuation | None
    # A Responses stream names its response in its first event: remembered with its replica, and
    # known everywhere before the client has the whole answer.
    scan: ResponseIdScan | None
    tail: bytes = b""
    continued: bool = False
    remembered: list[asyncio.Future[None]] = field(default_factory=list)

    def watch(self, data: bytes) -> bytes:
        self.tail = (self.tail + data)[-TAIL_BYTES:]
        if self.tap is not None:
            data = self.tap.feed(data)
        found = self.scan.feed(data) if self.scan is not None else None
        if found is not None:
            remember = self.state.response_owners.remember(found, self.attempt.replica.id)
            self.remembered.append(asyncio.ensure_future(remember))
        return self.strip.feed(data) if self.strip is not None else data

    async def pump(self, upstream: UpstreamResponse, chunk: bytes) -> bytes:
        """Relay `upstream` to its end from `chunk` (watched already). Chunks go out as they came, the
        last returned unsent, to go with the end of the stream in the same write (and the headers too,
        for an answer whole in its first chunk): one send, one client wake-up."""
        itl = self.state.metrics.child(self.state.metrics.itl, self.routed.model)
        last = time.monotonic()
        while not upstream.at_end:
            if chunk:
                await self.response.write(chunk)
            chunk = await upstream.read_chunk()
            if chunk:
                now = time.monotonic()
                itl.observe(now - last)
                last = now
                chunk = self.watch(chunk)
        rest = self.tap.flush() if self.tap is not None else b""
        if self.strip is not None:
            rest = self.strip.feed(rest) + self.strip.flush()
        return chunk + rest

    def account(self, status: int, upstream: UpstreamResponse) -> None:
        """Count the stream's end with what the answering replica reported; nothing reported for a
        continued stream, whose replicas reported on prompts other than the one routed (and learned
        from)."""
        replica = self.attempt.replica
        usage = None if self.continued else reported_usage(upstream.headers, self.tail, replica)
        account(self.state, self.routed, replica, status, usage, paired=self.attempt.paired)


async def _relay_stream(
    state: GatewayState,
    request: web.Request,
    routed: Routed,
    attempt: _Attempt,
    upstream: UpstreamResponse,
    first: bytes,
    strip_usage: bool,
) -> web.StreamResponse:
    """Relay from the first output on. If the replica fails once output has reached the client, the
    stream goes on from another replica where one can continue it (gateway.forward.migration), the client
    seeing one stream; where none can, it ends the way OpenAI streams report errors: an error event,
    then [DONE]."""
    replica = attempt.replica
    first_token(state, routed, attempt.replica, attempt.handle)
    response = _Stream(
        status=200,
        headers=response_headers(upstream.headers, routed.decision, replica.id, attempt.prefill_id),
    )
    how = payloads.continuation(state.config, routed, replica)
    tap = None
    if how is not None or payloads.reads_ids(routed, replica):
        tap = StreamTap(Sent(chat=routed.route == "chat"), read_text=replica.kind != "bundled")
    scan = ResponseIdScan() if routed.route == "responses" else None
    relay = _Relay(state, routed, response, attempt, UsageStrip() if strip_usage else None, tap, how, scan)
    status = 200
    try:
        await response.prepare(request)
        try:
            chunk = await relay.pump(upstream, relay.watch(first))
        except (TimeoutError, UpstreamError) as error:
            chunk, status = await _carry_on(state, routed, relay, error, strip_usage)
        for pending in relay.remembered:
            await pending
        await response.write_eof(chunk)
    except (asyncio.CancelledError, ConnectionResetError) as error:
        # The client left: the handler is cancelled, or a write (the last one included) finds the
        # connection closing (aiohttp's ClientConnectionResetError, which is no failure of the replica).
        # One that had [DONE] had its whole answer: the openai client closes on [DONE], often before
        # the replica's end of stream.
        if status == 200 and not relay.tail.endswith(SSE_DONE):
            status = CLIENT_GONE
        relay.account(status, upstream)
        request[ACCOUNTED] = True
        if isinstance(error, asyncio.CancelledError):
            raise
        return response
    relay.account(status, upstream)
    return response


async def _carry_on(
    state: GatewayState, routed: Routed, relay: _Relay, error: TimeoutError | UpstreamError, ask_usage: bool
) -> tuple[bytes, int]:
    """After the answering replica failed mid-stream: the rest of the stream from another replica
    (the next in the routing order, then any of the model's; up to limits.max_attempts tries, each
    that fails replaced in turn), and the status to count; or the error event that ends the stream."""
    failed = relay.attempt.replica
    failed_mid_stream(state, failed, error)
    sent = relay.tap.sent if relay.tap is not None else None
    if sent is not None and sent.finished:
        return SSE_DONE, 200  # every token and the finish had reached the client
    m = state.metrics
    tried = {failed.id}
    outcome = "unsupported"
    for _ in range(state.config.limits.max_attempts):
        if relay.how is None or sent is None or routed.body is None:
            break
        body = continuation_body(
            client_body(routed.body), sent, relay.how, prompt_ids=routed.tokens, ask_usage=ask_usage
        )
        if body is None:
            break
        outcome = "failed"
        replica = _successor(state, routed, tried, failed.kind)
        if replica is None:
            break
        tried.add(replica.id)
        try:
            return await _continue_on(state, routed, relay, replica, body), 200
        except (TimeoutError, UpstreamError) as again:
            failed_mid_stream(state, replica, again)
            failed, error = replica, again
        if sent.finished:
            return SSE_DONE, 200
    m.child(m.stream_migrations, routed.model, outcome).inc()
    return stream_error(failed.id, error, state.config.limits.request_timeout_s)


async def _continue_on(
    state: GatewayState, routed: Routed, relay: _Relay, replica: Replica, body: dict[str, Any]
) -> bytes:
    """The stream carried on by `replica` from what the client has; its last chunk, unsent."""
    assert relay.tap is not None and relay.how is not None
    payload = orjson.dumps(body)
    headers = upstream_headers(state.config, routed, payload)
    if relay.how == "bundled":
        headers[STREAM_IDS_HEADER] = "1"
    handle = state.replicas.dispatched(replica, time.monotonic(), 0)
    upstream: UpstreamResponse | None = None
    try:
        upstream = await _send(state, routed, replica, payload, headers)
        if upstream.status != 200 or not upstream.headers.get("Content-Type", "").startswith(_SSE):
            raise UpstreamError(f"http_{upstream.status}", f"answered {upstream.status} to the continuation")
        sent = relay.tap.sent
        tap = StreamTap(sent, read_text=True, shift=sent_tokens(sent, relay.how))
        first = await _until_output(upstream)
        relay.tap, relay.attempt, relay.continued = tap, _Attempt(replica, handle, None), True
        learn = state.config.learning
        # Started, for the load it adds; its time to first token says nothing of its prefill rate.
        state.replicas.started(
            replica, handle, 0.0, alpha=learn.ewma_alpha, min_tokens=learn.min_prefill_tokens
        )
        state.metrics.child(state.metrics.stream_migrations, routed.model, "continued").inc()
        return await relay.pump(upstream, relay.watch(first))
    finally:
        if upstream is not None:
            upstream.release()
        state.replicas.finished(replica, handle)


def _successor(state: GatewayState, routed: Routed, tried: set[str], kind: str) -> Replica | None:
    """Where to continue a stream: the next replica in the routing order, else any other of the
    model's, of the kind that answered (the same token ids, the same way to continue), routable,
    not tried yet, and answering clients itself (no prefill replica, no foreign decode one)."""
    ordered = [state.replicas.get(rid) for rid in routed.decision.order]
    for replica in [*ordered, *state.replicas.serving(routed.model)]:
        if replica is None or replica.id in tried or not replica.routable or replica.kind != kind:
            continue
        if replica.role == "prefill" or (kind == "openai" and replica.role != "mixed"):
            continue
        return replica
    return None
