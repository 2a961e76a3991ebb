"""One request as the endpoint picker sees it: the choice on its way in, the lessons on its way out.

Envoy hands the picker the request's headers and body and relays the request itself; the picker only
names the replicas, first choice first. That choice is the proxy's own (gateway.forward.choice):
tokenize, hash, match, the policy; the first choice is expected to hold the prompt from then on
(gateway.fleet.expectations), and counts the request in its queue until the answer ends. On the way
back Envoy says which replica served (the `upstream.address` attribute: a fallback when the first
choice could not be reached) and passes the answer through the picker, which times its first output
and reads the usage at its end, so that prefill rates, predictions and their correction are learned
as in proxy mode (gateway.forward.outcome).

What proxy mode does and this does not: the body goes on as the client sent it (no token ids attached
for bundled workers), a model served by prefill and decode replicas is not paired (those replicas are
not picked: route such a model through the proxy), and a stream that breaks is not continued
elsewhere (Envoy relays it). Envoy's own retries walk the fallbacks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from multidict import CIMultiDict

from gateway.epp.endpoints import endpoint_of
from gateway.fleet.expectations import NOTHING, Expectation, settle
from gateway.fleet.replicas import Replica
from gateway.forward.choice import choose, expect_first, model_of, record_first
from gateway.forward.outcome import TAIL_BYTES, account, first_token, reported_usage
from gateway.forward.request_view import PREFIX_ROUTES, Route, read_request
from gateway.forward.routed import Routed
from gateway.forward.sse_events import EventTooLarge, OutputWatch, ResponseIdScan, response_body_id
from gateway.gateway_state import GatewayState
from gateway.http.auth import check_api_key
from gateway.http.reading import NAMED_ROUTES
from protocol.errors import CLIENT_GONE, RETRY_AFTER_S, ApiError
from protocol.openai_api import parse_json

_SSE = "text/event-stream"


class Exchange:
    """The picker's state for one request, from its headers to the end of its answer."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.routed: Routed | None = None
        self.expectation: Expectation = NOTHING
        self.replica: Replica | None = None
        self.handle = 0
        self.status = 0
        self.response_headers: dict[str, str] = {}
        self.watch: OutputWatch | None = None
        # A Responses answer names its response, which is remembered with the replica that holds it.
        self.scan: ResponseIdScan | None = None
        self.whole: bytearray | None = None
        self.started = False
        self.tail = b""
        self.accounted = False
        self.admitted = False

    async def pick(
        self, headers: Mapping[str, str], raw: bytes, subset: frozenset[str] | None, arrival: float
    ) -> list[str]:
        """The endpoints to try, first choice first; an ApiError when none may be tried (the client's
        mistake, a model no replica serves, no replica ready, or the gateway or the fleet full)."""
        state = self.state
        state.admit()
        check_api_key(state, headers.get("authorization", ""))
        method, target = headers.get(":method", "GET"), headers.get(":path", "/")
        path = target.partition("?")[0]
        route: Route = NAMED_ROUTES.get(path, "other") if method == "POST" else "other"
        body = _json(route, headers, raw)
        view = read_request(route, body)
        model = model_of(state, view.model, required=route in PREFIX_ROUTES)
        candidates = _candidates(state, model, subset)
        prompt = await state.tokenizers.prompt(view, model, state.config.limits) if model else None
        tokens = prompt.ids if prompt is not None else None
        decision = await choose(state, path, headers, route, view, candidates, tokens)
        order = [r for r in (state.replicas.get(rid) for rid in decision.order) if r is not None]
        order = order[: state.config.limits.max_attempts]
        if not order:
            raise _unavailable(model, subset)
        if decision.view_of(order[0].id).waiting >= order[0].max_waiting:
            # The policy ranks a full replica after every other: the first choice full, all are.
            raise ApiError(
                429,
                "every replica that could serve this request is at its queue limit; retry shortly",
                code="fleet_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.expectation = expect_first(state, route, decision)
        record_first(state, self.expectation)  # Envoy sends the request: nothing to wait for here
        self.routed = Routed(
            route=route,
            model=model or "",
            method=method,
            target=target,
            raw=raw,
            body=body,
            headers=CIMultiDict(),
            tokens=prompt.token_ids if prompt is not None else None,
            tokenized=prompt is not None and prompt.tokenized,
            decision=decision,
            arrival=arrival,
            authorization=None,
            predicted=self.expectation.predicted,
            recorded_tick=self.expectation.recorded_tick,
        )
        state.inflight += 1
        self.admitted = True
        self._dispatch(order[0])
        return [e for e in (endpoint_of(r.url) for r in order) if e is not None]

    async def answered(self, headers: Mapping[str, str], served: str | None) -> None:
        """The answer's head, from the replica at `served` (Envoy's upstream address; None: unknown, the
        first choice then)."""
        if self.routed is None:
            return
        self.response_headers = {k: v for k, v in headers.items() if not k.startswith(":")}
        status = headers.get(":status", "")
        self.status = int(status) if status.isascii() and status.isdigit() else 502
        replica = self._replica_at(served) if served else None
        if replica is not None and replica is not self.replica:
            self._finish_dispatch()
            self._dispatch(replica)
        ok = self.status == 200
        streamed = headers.get("content-type", "").startswith(_SSE)
        self.watch = OutputWatch() if ok and streamed else None
        if ok and self.routed.route == "responses":
            self.scan, self.whole = (ResponseIdScan(), None) if streamed else (None, bytearray())

    async def chunk(self, data: bytes, end: bool) -> None:
        """A piece of the answer's body, on its way to the client."""
        if self.routed is None or self.replica is None:
            return
        if not self.started and self.status == 200 and data and self._output(data):
            self.started = True
            first_token(self.state, self.routed, self.replica, self.handle)
        self.tail = (self.tail + data)[-TAIL_BYTES:]
        await self._response_id(data, end)
        if end:
            await self.ended()

    async def _response_id(self, data: bytes, end: bool) -> None:
        """Remember a Responses answer's id with its replica: from a stream's first events, or from a
        whole answer's body (read whole up to the gateway's body limit)."""
        assert self.replica is not None
        found = None
        if self.scan is not None:
            found = self.scan.feed(data)
        elif self.whole is not None:
            self.whole += data
            if len(self.whole) > self.state.config.limits.max_body_bytes:
                self.whole = None
            elif end:
                found = response_body_id(bytes(self.whole))
        if found is not None:
            await self.state.response_owners.remember(found, self.replica.id)

    def _output(self, data: bytes) -> bool:
        """Whether the answer's output has begun with `data`: any byte of a whole answer; a stream's
        first event that carries output (vLLM opens with an empty role delta as soon as it queues)."""
        if self.watch is None:
            return True
        try:
            return self.watch.feed(data)
        except EventTooLarge:
            return True

    async def ended(self) -> None:
        """The answer is whole (its last body chunk, or its trailers)."""
        if self.routed is None or self.replica is None or self.accounted:
            return
        if self.status == 200 and not self.started:
            self.started = True
            first_token(self.state, self.routed, self.replica, self.handle)
        usage = reported_usage(self.response_headers, self.tail, self.replica) if self.status == 200 else None
        account(self.state, self.routed, self.replica, self.status, usage, paired=False)
        self.accounted = True

    def close(self) -> None:
        """The stream with Envoy ended, whole or not: a request whose answer did not end is counted as
        its client's leaving, and its place in the replica's queue and the index are given back."""
        if self.routed is not None and self.replica is not None and not self.accounted:
            account(self.state, self.routed, self.replica, CLIENT_GONE, None, paired=False)
            self.accounted = True
        self._finish_dispatch()
        settle(self.state.index, self.expectation)
        self.expectation = NOTHING
        if self.admitted:
            self.state.inflight -= 1
            self.admitted = False

    def _dispatch(self, replica: Replica) -> None:
        assert self.routed is not None
        decision = self.routed.decision
        uncached = max(decision.prompt_tokens - decision.view_of(replica.id).cached_tokens, 0)
        recorded = self.routed.recorded_tick if replica.id == decision.order[0] else None
        blocks = -(-uncached // replica.block_size)
        self.handle = self.state.replicas.dispatched(replica, time.monotonic(), uncached, recorded, blocks)
        self.replica = replica

    def _finish_dispatch(self) -> None:
        if self.replica is not None:
            self.state.replicas.finished(self.replica, self.handle)

    def _replica_at(self, served: str) -> Replica | None:
        assert self.routed is not None
        for replica in self.state.replicas.serving(self.routed.model) if self.routed.model else []:
            if endpoint_of(replica.url) == served:
                return replica
        return None


def _json(route: Route, headers: Mapping[str, str], raw: bytes) -> dict[str, Any] | None:
    """The body as a JSON object: the named routes take nothing else (400); any other may carry any
    content, and is then routed by load."""
    if route != "other":
        return parse_json(raw)
    if not raw or not headers.get("content-type", "").partition(";")[0].strip().endswith("json"):
        return None
    try:
        return parse_json(raw)
    except ApiError:
        return None


def _candidates(state: GatewayState, model: str | None, subset: frozenset[str] | None) -> list[Replica]:
    """The replicas Envoy can be sent to: by address, answering clients themselves (prefill and decode
    replicas are paired by the proxy alone), within Envoy's subset hint where it gave one."""
    replicas = state.replicas.serving(model) if model is not None else state.replicas.all()
    found = []
    for replica in replicas:
        endpoint = endpoint_of(replica.url)
        if endpoint is None or replica.role != "mixed":
            continue
        if subset is None or endpoint in subset:
            found.append(replica)
    return found


def _unavailable(model: str | None, subset: frozenset[str] | None) -> ApiError:
    what = f"{model!r}" if model else "this request"
    within = f" among the endpoints Envoy allowed ({', '.join(sorted(subset))})" if subset is not None else ""
    return ApiError(
        503,
        f"no ready replica serves {what}{within}: the picker chooses among healthy replicas named by an "
        "IP address that answer clients themselves",
        code="no_replica_available",
        headers={"Retry-After": "1"},
    )
