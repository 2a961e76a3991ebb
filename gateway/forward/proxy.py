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

For a replica whose cache is predicted, what it reports reusing corrects the prediction
(Predictions.learn). A stream to a foreign one asks for its usage when the client did not
(`approximate.request_usage`), and that usage event is left out of what the client receives.

A model served by prefill and decode replicas is routed in pairs (policies.pd): each attempt goes to a
decode replica, with the prefill side of the pair handled by gateway.forward.pd_legs; a failed attempt is
retried on the next pair, and the client gets the decode replica's answer, naming the prefill replica
in `x-prefixgate-prefill-replica`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from aiohttp import web
from multidict import CIMultiDict, MultiMapping

from gateway.fleet.replicas import Replica
from gateway.forward.internal_fields import client_body
from gateway.forward.migration import Continuation, Sent, StreamTap, continuation_body, sent_tokens
from gateway.forward.pd_legs import REFUSALS, PrefillFailed, PrefillLeg, prefill_leg
from gateway.forward.request_view import PREFIX_ROUTES
from gateway.forward.routed import Routed
from gateway.forward.sse_events import OutputWatch, ResponseIdScan, UsageStrip, usage_numbers
from gateway.forward.upstream import UpstreamError, UpstreamResponse, error_kind, header_count
from gateway.gateway import Gateway
from policies.prefix_aware import prefill_wait_s
from protocol.errors import CLIENT_GONE, ApiError
from protocol.openai_responses import CACHED_TOKENS_HEADER, SSE_DONE, sse
from protocol.stream_ids import STREAM_IDS_HEADER
from radix.reports import realised_blocks

REPLICA_HEADER = "x-prefixgate-replica"
MATCHED_BLOCKS_HEADER = "x-prefixgate-matched-blocks"
PREDICTED_CACHED_HEADER = "x-prefixgate-predicted-cached-tokens"
# The routing model's wait for the first token on the chosen replica (policies.prefix_aware
# prefill_wait_s), in ms: beside the TTFT a client sees, whether the model holds on this fleet.
PREDICTED_TTFT_HEADER = "x-prefixgate-predicted-ttft-ms"
POLICY_HEADER = "x-prefixgate-policy"
PREFILL_REPLICA_HEADER = "x-prefixgate-prefill-replica"
_TAIL_BYTES = 2048
# A replica's token count above this is no count (a float, which metrics add in, holds no more exactly).
_MAX_COUNT = 2**53
# Set on a request once its outcome is counted, so that the cancellation of a client that left is not
# counted again, unlabelled, by the middleware.
ACCOUNTED = web.RequestKey("accounted", bool)
# Headers that describe one connection, not the content (RFC 9110 §7.6.1), in either direction; with
# those a message's Connection header names (connection_named).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# A replica's answer headers that are not relayed: its connection's, and those the gateway's own server
# writes.
_NOT_RELAYED = HOP_BY_HOP | {"content-length", "date", "server"}


def connection_named(headers: Mapping[str, str]) -> frozenset[str]:
    """The headers a message's Connection headers name (lower case): hop-by-hop too, never forwarded,
    whichever direction the message goes."""
    values = (
        headers.getall("Connection", ())
        if isinstance(headers, MultiMapping)
        else [headers.get("Connection", "")]
    )
    names = (token.strip().lower() for value in values for token in value.split(","))
    return frozenset(name for name in names if name)


# Routes whose bodies a bundled worker reads with the gateway's token ids attached, and whose streams
# a foreign one is asked to end with their usage.
_ID_ROUTES = frozenset({"chat", "completions"})
_SSE = "text/event-stream"
T = TypeVar("T")


@dataclass(slots=True)
class _Attempt:
    """One try of a routed request: the replica that answers, its accounting handle, and the prefill
    side when it is paired with a prefill replica."""

    replica: Replica
    handle: int
    leg: PrefillLeg | None


@dataclass(slots=True)
class _Failures:
    """How the failed attempts so far ended: what the client is told when every choice failed."""

    # The last failure, in words.
    last: str = ""
    # How it ended: "timeout" (no answer in time), "refused" (429/503), or another failure.
    kind: str = ""
    # The last refusal, with its Retry-After: the fleet is full, not broken.
    refusal: ApiError | None = None

    def failed(self, gw: Gateway, replica: Replica, kind: str, message: str) -> None:
        gw.mark_failure(replica)
        gw.metrics.upstream_errors.labels(replica.id, kind).inc()
        self.last, self.kind = message, "timeout" if kind == "timeout" else "error"

    def refused(
        self, gw: Gateway, replica: Replica, status: int, headers: Mapping[str, str], model: str
    ) -> None:
        gw.metrics.upstream_errors.labels(replica.id, f"http_{status}").inc()
        self.last, self.kind = f"replica {replica.id} answered {status}", "refused"
        self.refusal = _refusal(status, headers, model)


def _payload(
    gw: Gateway, routed: Routed, replica: Replica, fields: Mapping[str, Any] | None = None
) -> tuple[bytes, bool]:
    """What goes to `replica`, and whether a usage event the client did not ask for will come back.

    Bundled workers get the ids the gateway tokenized (no second tokenization); a paired decode
    replica gets the prefill side's `fields`; an unpaired stream to a foreign replica whose cache is
    predicted asks for usage (a paired one's is not learned from: see _learn); everything else goes
    as the client sent it. On every route, the gateway's own fields are not the client's to send
    (gateway.forward.internal_fields): a `prefixgate_*` one is refused, a vLLM or SGLang pairing one
    dropped."""
    if routed.body is None:
        return routed.raw, False
    body = client_body(routed.body)
    cleaned = body is not routed.body
    if routed.route not in _ID_ROUTES:
        return (orjson.dumps(body) if cleaned else routed.raw), False
    added = dict(fields or {})
    strip_usage = False
    if replica.kind == "bundled":
        if routed.tokenized and routed.tokens is not None and "prefixgate_token_ids" not in body:
            added["prefixgate_token_ids"] = routed.tokens
    elif not added and _asks_usage(gw, replica, body):
        options = body.get("stream_options")
        added["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        strip_usage = True
    return (orjson.dumps({**body, **added}) if added or cleaned else routed.raw), strip_usage


def _asks_usage(gw: Gateway, replica: Replica, body: dict[str, Any]) -> bool:
    """Whether a stream to a foreign replica must ask for the usage the client did not, to learn from."""
    options = body.get("stream_options")
    wants_usage = isinstance(options, dict) and options.get("include_usage") is True
    streams = body.get("stream") is True
    return streams and not wants_usage and not gw.precise(replica) and gw.config.approximate.request_usage


def _upstream_headers(
    gw: Gateway, routed: Routed, payload: bytes, extra: Mapping[str, str] | None = None
) -> CIMultiDict[str]:
    """The headers of `payload` to a replica: the client's, repeats kept, with `extra` (a prefill
    leg's) and the upstream Authorization replacing any of the same name."""
    headers = routed.headers.copy()
    if payload is not routed.raw:  # re-encoded: JSON, whatever the client called it
        headers["Content-Type"] = "application/json"
    headers.update(extra or {})
    key = gw.config.upstream_key()
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    elif gw.config.auth.forward_client_key and routed.authorization:
        headers["Authorization"] = routed.authorization
    return headers


def _response_headers(upstream: Mapping[str, str], attempt: _Attempt, routed: Routed) -> CIMultiDict[str]:
    """The replica's answer headers, repeats kept (Set-Cookie), less its connection's, plus the
    gateway's routing headers (which replace any the replica sent of those names)."""
    replica = attempt.replica
    view = routed.decision.view_of(replica.id)
    dropped = _NOT_RELAYED | connection_named(upstream)
    headers = CIMultiDict((k, v) for k, v in upstream.items() if k.lower() not in dropped)
    headers[REPLICA_HEADER] = replica.id
    headers[MATCHED_BLOCKS_HEADER] = str(view.matched_blocks)
    headers[PREDICTED_CACHED_HEADER] = str(min(view.cached_tokens, routed.decision.prompt_tokens))
    headers[PREDICTED_TTFT_HEADER] = str(round(1000 * prefill_wait_s(routed.decision.prompt_tokens, view)))
    headers[POLICY_HEADER] = routed.decision.policy
    if attempt.leg is not None:
        headers[PREFILL_REPLICA_HEADER] = attempt.leg.prefill.id
    return headers


def _usage(headers: Mapping[str, str], tail: bytes, replica: Replica) -> tuple[int | None, int | None]:
    """(prompt_tokens, cached_tokens) as the replica reported them: the usage object at the end of its
    answer, which counts both in the replica's own unit; without one, a bundled worker's header, whose
    count is of the gateway's ids (a worker declared foreign tokenizes the text itself, in its own)."""
    prompt, cached = (n if n is not None and n <= _MAX_COUNT else None for n in usage_numbers(tail))
    if cached is None and replica.kind == "bundled" and CACHED_TOKENS_HEADER in headers:
        return None, header_count(headers[CACHED_TOKENS_HEADER])
    return prompt, cached


async def forward(gw: Gateway, request: web.Request, routed: Routed) -> web.StreamResponse:
    limits = gw.config.limits
    order = [rid for rid in routed.decision.order if rid in gw.replicas][: limits.max_attempts]
    if not order:
        raise ApiError(
            503, _unavailable(gw, routed.model), code="no_replica_available", headers={"Retry-After": "1"}
        )
    failures = _Failures()
    for attempt_no, rid in enumerate(order):
        replica = gw.replicas.get(rid)
        if replica is None:
            continue
        final = attempt_no == len(order) - 1
        try:
            return await _attempt(gw, request, routed, replica, failures, final)
        except _Retry as retry:
            _retrying(gw, routed, retry.reason, final)
    if failures.refusal is not None:
        # A replica that is up but full said when to come back: that, not a 5xx, is the answer for a
        # client whose other choices could not be reached either.
        raise failures.refusal
    if failures.kind == "timeout":
        raise ApiError(
            504,
            f"no replica tried for {routed.model!r} answered in time (limits: connect_timeout_s "
            f"{limits.connect_timeout_s:g}, request_timeout_s {limits.request_timeout_s:g}); "
            f"last: {failures.last}",
            code="upstream_timeout",
        )
    raise ApiError(
        502,
        f"every replica tried for {routed.model!r} failed; last: {failures.last}",
        code="upstream_unavailable",
    )


class _Retry(Exception):
    """The attempt failed before any output reached the client: the next choice can still serve it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def _attempt(
    gw: Gateway, request: web.Request, routed: Routed, replica: Replica, failures: _Failures, final: bool
) -> web.StreamResponse:
    """One try on `replica` (and its prefill replica, when paired): its answer relayed, or _Retry."""
    decision = routed.decision
    uncached = max(decision.prompt_tokens - decision.view_of(replica.id).cached_tokens, 0)
    recorded = routed.recorded_tick if replica.id == decision.order[0] else None
    leg = prefill_leg(gw, routed, replica)
    # A paired decode replica receives the prompt's KV rather than computing it; it holds it either way.
    computed = 0 if leg is not None else uncached
    blocks = -(-uncached // replica.block_size)
    handle = gw.replicas.dispatched(replica, time.monotonic(), computed, recorded, blocks)
    attempt = _Attempt(replica, handle, leg)
    upstream: UpstreamResponse | None = None
    try:
        fields = await leg.start(_upstream_headers(gw, routed, routed.raw)) if leg is not None else {}
        payload, strip_usage = _payload(gw, routed, replica, fields)
        headers = _upstream_headers(gw, routed, payload, leg.headers if leg is not None else None)
        if _reads_ids(routed, replica):
            headers[STREAM_IDS_HEADER] = "1"
        if leg is not None:
            leg.sending(payload, headers)
        upstream = await _guarded(leg, _send(gw, routed, replica, payload, headers))
        if leg is not None:
            leg.on_head(upstream.headers)
        if upstream.status in REFUSALS and not final:
            failures.refused(gw, replica, upstream.status, upstream.headers, routed.model)
            raise _Retry(f"http_{upstream.status}")
        if upstream.status == 200 and upstream.headers.get("Content-Type", "").startswith(_SSE):
            first = await _guarded(leg, _until_output(upstream))
            if leg is not None:
                leg.answered()
            return await _relay_stream(gw, request, routed, attempt, upstream, first, strip_usage)
        body = await _guarded(leg, upstream.read())
        if leg is not None and upstream.status == 200:
            leg.answered()
        return await _relay_body(gw, routed, attempt, upstream.status, upstream.headers, body)
    except PrefillFailed as error:
        assert leg is not None
        if error.client_error:
            # The client's mistake, which the decode replica would refuse alike: the answer.
            return await _relay_body(gw, routed, attempt, error.status or 400, error.headers, error.body)
        if error.refused and error.status is not None:
            failures.refused(gw, leg.prefill, error.status, error.headers, routed.model)
        else:
            failures.failed(gw, leg.prefill, error.kind, str(error))
        raise _Retry(error.kind) from None
    except (TimeoutError, UpstreamError) as error:
        # The replica failed before the client saw any output: the next choice can still serve it.
        when = "could not be reached" if upstream is None else "failed before its first output"
        failures.failed(gw, replica, error_kind(error), f"replica {replica.id} {when}: {error!r}")
        raise _Retry(error_kind(error)) from None
    except asyncio.CancelledError:
        # The client left while an answer was awaited: counted with the replica it was on (one that
        # leaves before the answer's head is counted unlabelled, by the middleware).
        if upstream is not None and not request.get(ACCOUNTED):
            _account(gw, routed, attempt, CLIENT_GONE, None)
            request[ACCOUNTED] = True
        raise
    finally:
        if upstream is not None:
            # Back to the pool when read to the end; closed otherwise (the client left, or a refusal
            # went unread), which is what tells a worker to abort.
            upstream.release()
        gw.replicas.finished(replica, handle)
        if leg is not None:
            await leg.close()


def _send(
    gw: Gateway, routed: Routed, replica: Replica, payload: bytes, headers: Mapping[str, str]
) -> Awaitable[UpstreamResponse]:
    """The request to `replica` under the gateway's connect and request timeouts."""
    limits = gw.config.limits
    return gw.upstream.request(
        routed.method,
        replica.url,
        routed.target,
        payload,
        headers,
        connect_s=limits.connect_timeout_s,
        read_s=limits.request_timeout_s,
    )


async def _guarded(leg: PrefillLeg | None, pending: Awaitable[T]) -> T:
    """A wait for the replica that answers, given up if its prefill side fails first."""
    return await (leg.guard(pending) if leg is not None else pending)


def _unavailable(gw: Gateway, model: str) -> str:
    """Why no replica can take a request for `model` now, in words for the client."""
    replicas = gw.replicas.serving(model)
    prefill = [r.id for r in replicas if r.role == "prefill" and r.routable]
    answering = [r for r in replicas if r.role != "prefill" and r.routable]
    if prefill and not answering:
        return (
            f"no decode replica of {model!r} is available right now; its prefill replicas "
            f"({', '.join(prefill)}) compute prompts for decode replicas and answer no client"
        )
    if answering and all(r.role == "decode" and r.pd_protocol == "sglang" for r in answering):
        return f"the SGLang decode replicas of {model!r} need a prefill replica, and none is available"
    return f"no healthy replica serves {model!r} right now"


async def _until_output(upstream: UpstreamResponse) -> bytes:
    """A stream's first chunks, up to the first whole event that carries output (or the stream's end):
    what may be held back from the client while the replica can still be replaced (a bounded
    amount: gateway.forward.sse_events.OutputWatch)."""
    watch = OutputWatch()
    held = [await upstream.read_chunk()]
    while not watch.feed(held[-1]) and not upstream.at_end:
        held.append(await upstream.read_chunk())
    return b"".join(held)


def _retrying(gw: Gateway, routed: Routed, reason: str, final: bool) -> None:
    if not final:
        gw.metrics.child(gw.metrics.retries, routed.model, reason).inc()


def _refusal(status: int, headers: Mapping[str, str], model: str) -> ApiError:
    """A replica's 429/503 as the gateway's own answer, keeping its Retry-After (1 s if it gave none)."""
    retry_after = headers.get("Retry-After", "1")
    if status == 429:
        message, code = f"every replica tried for {model!r} is at its queue limit", "queue_full"
    else:
        message, code = f"the replicas tried for {model!r} are unavailable", "unavailable"
    return ApiError(status, f"{message}; retry shortly", code=code, headers={"Retry-After": retry_after})


def _account(
    gw: Gateway, routed: Routed, attempt: _Attempt, status: int, usage: tuple[int | None, int | None]
) -> None:
    m = gw.metrics
    replica = attempt.replica
    policy = routed.decision.policy
    m.child(m.requests, routed.model, replica.id, policy, str(status), routed.route).inc()
    m.child(m.e2e, routed.model, replica.id).observe(time.monotonic() - routed.arrival)
    if status != 200:
        return
    view = routed.decision.view_of(replica.id)
    prompt = routed.decision.prompt_tokens
    m.child(m.prompt_tokens, routed.model, replica.id).inc(prompt)
    m.child(m.predicted_cached, routed.model, replica.id).inc(min(view.cached_tokens, prompt))
    reported_prompt, cached = usage
    if cached is not None:
        m.child(m.realised_cached, routed.model, replica.id).inc(cached)
        _learn(gw, routed, replica, reported_prompt, cached, paired=attempt.leg is not None)
    hashes = routed.decision.hashes.get(replica.block_size)
    if routed.route in PREFIX_ROUTES and hashes and not gw.precise(replica):
        gw.predictions.released(replica.id, hashes)


def _learn(
    gw: Gateway, routed: Routed, replica: Replica, reported_prompt: int | None, cached: int, paired: bool
) -> None:
    """Correct the predicted cache of `replica` by what it reports it reused of this prompt.

    The report counts the replica's own tokens in its own blocks, which need not be the gateway's:
    radix.reports reads it in the gateway's blocks, a shortfall within its rounding being no evidence.
    A replica that was not the first choice was not predicted to hold the prompt; it has it now. A
    decode replica paired with a prefill replica received the prompt's KV: what it reports reusing
    says nothing of what it held before."""
    hashes = routed.decision.hashes.get(replica.block_size)
    if routed.route not in PREFIX_ROUTES or not hashes or gw.precise(replica):
        return
    first = replica.id == routed.decision.order[0]
    if not paired:
        predicted = (
            routed.predicted if first else gw.index.predicted(replica.id, hashes, replica.pending_horizon())
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
        gw.predictions.learn(replica.id, predicted, realised)
    if not first:
        gw.predictions.record(replica.id, hashes)


def _first_token(gw: Gateway, routed: Routed, attempt: _Attempt) -> None:
    ttft = time.monotonic() - routed.arrival
    replica = attempt.replica
    gw.metrics.child(gw.metrics.ttft, routed.model, replica.id).observe(ttft)
    predicted = prefill_wait_s(routed.decision.prompt_tokens, routed.decision.view_of(replica.id))
    gw.metrics.child(gw.metrics.predicted_ttft, routed.model, replica.id).observe(predicted)
    learn = gw.config.learning
    gw.replicas.started(
        attempt.replica, attempt.handle, ttft, alpha=learn.ewma_alpha, min_tokens=learn.min_prefill_tokens
    )


async def _relay_body(
    gw: Gateway, routed: Routed, attempt: _Attempt, status: int, headers: Mapping[str, str], body: bytes
) -> web.Response:
    if status == 200:
        _first_token(gw, routed, attempt)
        if routed.route == "responses":
            response_id = _response_id(body)
            if response_id is not None:
                await gw.response_owners.remember(response_id, attempt.replica.id)
    _account(gw, routed, attempt, status, _usage(headers, body[-_TAIL_BYTES:], attempt.replica))
    return web.Response(body=body, status=status, headers=_response_headers(headers, attempt, routed))


@dataclass(slots=True)
class _Relay:
    """One client stream as it is relayed, from one replica or, continued (gateway.forward.migration), from
    several: the filters each chunk passes, the tail of what came (for usage and [DONE]), and the
    attempt answering now."""

    gw: Gateway
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
        self.tail = (self.tail + data)[-_TAIL_BYTES:]
        if self.tap is not None:
            data = self.tap.feed(data)
        found = self.scan.feed(data) if self.scan is not None else None
        if found is not None:
            remember = self.gw.response_owners.remember(found, self.attempt.replica.id)
            self.remembered.append(asyncio.ensure_future(remember))
        return self.strip.feed(data) if self.strip is not None else data

    async def pump(self, upstream: UpstreamResponse, chunk: bytes) -> bytes:
        """Relay `upstream` to its end from `chunk` (watched already). Chunks go out as they came, the
        last returned unsent, to go with the end of the stream in the same write (and the headers too,
        for an answer whole in its first chunk): one send, one client wake-up."""
        itl = self.gw.metrics.child(self.gw.metrics.itl, self.routed.model)
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


async def _relay_stream(
    gw: Gateway,
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
    _first_token(gw, routed, attempt)
    response = web.StreamResponse(status=200, headers=_response_headers(upstream.headers, attempt, routed))
    how = _continuation(gw, routed, replica)
    tap = None
    if how is not None or _reads_ids(routed, replica):
        tap = StreamTap(Sent(chat=routed.route == "chat"), read_text=replica.kind != "bundled")
    scan = ResponseIdScan() if routed.route == "responses" else None
    relay = _Relay(gw, routed, response, attempt, UsageStrip() if strip_usage else None, tap, how, scan)
    status = 200
    try:
        await response.prepare(request)
        try:
            chunk = await relay.pump(upstream, relay.watch(first))
        except (TimeoutError, UpstreamError) as error:
            chunk, status = await _carry_on(gw, routed, relay, error, strip_usage)
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
        _account(gw, routed, relay.attempt, status, _relayed_usage(relay, upstream))
        request[ACCOUNTED] = True
        if isinstance(error, asyncio.CancelledError):
            raise
        return response
    _account(gw, routed, relay.attempt, status, _relayed_usage(relay, upstream))
    return response


def _reads_ids(routed: Routed, replica: Replica) -> bool:
    """Whether a bundled worker is asked to name its tokens' ids in its stream (protocol.stream_ids)."""
    body = routed.body
    return (
        replica.kind == "bundled"
        and routed.route in _ID_ROUTES
        and body is not None
        and body.get("stream") is True
    )


def _continuation(gw: Gateway, routed: Routed, replica: Replica) -> Continuation | None:
    """How a stream from `replica` can be continued elsewhere (gateway.forward.migration), or None."""
    body = routed.body
    if body is None or routed.route not in _ID_ROUTES or body.get("n") not in (None, 1):
        return None
    if replica.kind == "bundled":
        return "bundled" if routed.tokens is not None else None
    entry = gw.config.models.get(routed.model)
    how = entry.foreign_continuation if entry is not None else "none"
    return None if how == "none" else how


def _relayed_usage(relay: _Relay, upstream: UpstreamResponse) -> tuple[int | None, int | None]:
    """What the answering replica reported; nothing for a continued stream, whose replicas reported
    on prompts other than the one routed (and learned from)."""
    if relay.continued:
        return None, None
    return _usage(upstream.headers, relay.tail, relay.attempt.replica)


async def _carry_on(
    gw: Gateway, routed: Routed, relay: _Relay, error: TimeoutError | UpstreamError, ask_usage: bool
) -> tuple[bytes, int]:
    """After the answering replica failed mid-stream: the rest of the stream from another replica
    (the next in the routing order, then any of the model's; up to limits.max_attempts tries, each
    that fails replaced in turn), and the status to count; or the error event that ends the stream."""
    failed = relay.attempt.replica
    _failed_mid_stream(gw, failed, error)
    sent = relay.tap.sent if relay.tap is not None else None
    if sent is not None and sent.finished:
        return SSE_DONE, 200  # every token and the finish had reached the client
    m = gw.metrics
    tried = {failed.id}
    outcome = "unsupported"
    for _ in range(gw.config.limits.max_attempts):
        if relay.how is None or sent is None or routed.body is None:
            break
        body = continuation_body(
            client_body(routed.body), sent, relay.how, prompt_ids=routed.tokens, ask_usage=ask_usage
        )
        if body is None:
            break
        outcome = "failed"
        replica = _successor(gw, routed, tried, failed.kind)
        if replica is None:
            break
        tried.add(replica.id)
        try:
            return await _continue_on(gw, routed, relay, replica, body), 200
        except (TimeoutError, UpstreamError) as again:
            _failed_mid_stream(gw, replica, again)
            failed, error = replica, again
        if sent.finished:
            return SSE_DONE, 200
    m.child(m.stream_migrations, routed.model, outcome).inc()
    return _stream_error(gw, failed, error)


async def _continue_on(
    gw: Gateway, routed: Routed, relay: _Relay, replica: Replica, body: dict[str, Any]
) -> bytes:
    """The stream carried on by `replica` from what the client has; its last chunk, unsent."""
    assert relay.tap is not None and relay.how is not None
    payload = orjson.dumps(body)
    headers = _upstream_headers(gw, routed, payload)
    if relay.how == "bundled":
        headers[STREAM_IDS_HEADER] = "1"
    handle = gw.replicas.dispatched(replica, time.monotonic(), 0)
    upstream: UpstreamResponse | None = None
    try:
        upstream = await _send(gw, routed, replica, payload, headers)
        if upstream.status != 200 or not upstream.headers.get("Content-Type", "").startswith(_SSE):
            raise UpstreamError(f"http_{upstream.status}", f"answered {upstream.status} to the continuation")
        sent = relay.tap.sent
        tap = StreamTap(sent, read_text=True, shift=sent_tokens(sent, relay.how))
        first = await _until_output(upstream)
        relay.tap, relay.attempt, relay.continued = tap, _Attempt(replica, handle, None), True
        learn = gw.config.learning
        # Started, for the load it adds; its time to first token says nothing of its prefill rate.
        gw.replicas.started(replica, handle, 0.0, alpha=learn.ewma_alpha, min_tokens=learn.min_prefill_tokens)
        gw.metrics.child(gw.metrics.stream_migrations, routed.model, "continued").inc()
        return await relay.pump(upstream, relay.watch(first))
    finally:
        if upstream is not None:
            upstream.release()
        gw.replicas.finished(replica, handle)


def _successor(gw: Gateway, routed: Routed, tried: set[str], kind: str) -> Replica | None:
    """Where to continue a stream: the next replica in the routing order, else any other of the
    model's, of the kind that answered (the same token ids, the same way to continue), routable,
    not tried yet, and answering clients itself (no prefill replica, no foreign decode one)."""
    ordered = [gw.replicas.get(rid) for rid in routed.decision.order]
    for replica in [*ordered, *gw.replicas.serving(routed.model)]:
        if replica is None or replica.id in tried or not replica.routable or replica.kind != kind:
            continue
        if replica.role == "prefill" or (kind == "openai" and replica.role != "mixed"):
            continue
        return replica
    return None


def _failed_mid_stream(gw: Gateway, replica: Replica, error: TimeoutError | UpstreamError) -> None:
    kind = error_kind(error)
    if not kind.startswith("http_"):  # a refusal is an answer: the replica is up
        gw.mark_failure(replica)
    gw.metrics.upstream_errors.labels(replica.id, kind).inc()


def _stream_error(gw: Gateway, replica: Replica, error: TimeoutError | UpstreamError) -> tuple[bytes, int]:
    """The error event (then [DONE]) that ends a stream no replica could finish, and its status."""
    if isinstance(error, TimeoutError):  # silent for limits.request_timeout_s: stuck, or far too slow
        silent = gw.config.limits.request_timeout_s
        message, code, status = f"sent nothing for {silent:g} s mid-stream", "upstream_timeout", 504
    else:
        message, code, status = f"failed mid-stream: {error!r}", "upstream_failed", 502
    return sse(ApiError(status, f"replica {replica.id} {message}", code=code).to_json()) + SSE_DONE, status


def _response_id(body: bytes) -> str | None:
    """The `id` of a Responses API answer body."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    found = parsed.get("id") if isinstance(parsed, dict) else None
    return found if isinstance(found, str) and found else None
