"""The prefill side of a paired attempt (docs/design.md §4): what each protocol sends the prefill replica
and adds to the decode replica's request, and the prefill replica's share of the gateway's accounting.

One client request, one answer: the decode replica's, relayed by gateway.forward.proxy like any other. The
prefill replica's work is in flight from the attempt's start to the decode replica's first output (or
its own answer, for vLLM's), so queued-prefill estimates see it, and how long it took teaches its
prefill rate.

How a prefill failure ends:
- prefixgate's own: the decode worker computes the prompt itself and says why in a response header:
  the request goes on; the prefill replica is marked failed and the fallback counted.
- vLLM: the prefill request comes first; a failure fails the attempt (retried on the next pair). An
  answer without `kv_transfer_params` is a fallback: the decode instance computes the prompt itself.
- SGLang: both requests go at once, and the decode server waits for the KV: a prefill failure before
  the decode server's first output fails the attempt (the wait for it is given up). The prefill answer
  is read to its end, never cut short: closing it early would abort the transfer.
A foreign prefill replica's refusal (429, 503) is retried elsewhere like a decode replica's; its other
4xx answers are the client's error (the decode replica would have refused the same body), and answer
the client as they are.

What pairs two replicas is the gateway's alone: a client's own pairing fields never reach either leg
(gateway.forward.internal_fields), vLLM's two requests carry an X-Request-Id the gateway made (never the
client's, which could name another request's transfer), and bundled workers are paired only with the
fleet's transfer secret (`auth.transfer_secret_env`), which signs each grant: without it they are not
paired at all, and each decode worker computes its prompts itself.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Mapping, MutableMapping
from typing import Any, TypeVar

import orjson
from multidict import CIMultiDict

from gateway.fleet.replicas import Replica
from gateway.forward.internal_fields import client_body
from gateway.forward.pd_bodies import bundled_fields, sglang_fields, vllm_prefill_body, vllm_transfer_params
from gateway.forward.request_view import Route
from gateway.forward.routed import Routed
from gateway.forward.upstream import UpstreamError, UpstreamResponse, error_kind, header_count
from gateway.gateway_state import GatewayState
from protocol.disaggregation import PREFILL_ERROR_HEADER, TRANSFERRED_TOKENS_HEADER
from protocol.transfer_auth import parse_secret

log = logging.getLogger("prefixgate.gateway.pd")

# Routes whose bodies can name a prefill replica (a bundled worker reads the field; vLLM's and SGLang's
# proxies pair only these). Other prefix routes go to a decode replica that computes the prompt itself.
PAIRED_ROUTES: frozenset[Route] = frozenset({"chat", "completions"})
# Answers that say "full, come back later": another pair may serve the request.
REFUSALS = (429, 503)
_REQUEST_ID = "X-Request-Id"
_JSON = {"Content-Type": "application/json"}
# Why bundled workers go unpaired, each said once in the log (not once a request).
_SAID: set[str] = set()
# Bootstrap rooms must not collide between requests, nor between gateways.
_ROOMS = random.SystemRandom()
T = TypeVar("T")


class PrefillFailed(Exception):
    """The prefill side failed before the decode replica's first output, and the attempt with it.
    `kind` labels metrics; `status`, `headers` and `body` are the prefill replica's answer, if it gave
    one."""

    def __init__(
        self,
        kind: str,
        message: str,
        status: int | None = None,
        headers: Mapping[str, str] | None = None,
        body: bytes = b"",
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.headers: Mapping[str, str] = headers or {}
        self.body = body

    @property
    def refused(self) -> bool:
        return self.status in REFUSALS

    @property
    def client_error(self) -> bool:
        """The client's mistake, which every replica would refuse alike: it answers the client."""
        return self.status is not None and 400 <= self.status < 500 and not self.refused


class PrefillLeg:
    """One attempt's prefill replica. `start` before the decode replica's request is made, `sending`
    as it goes, `guard` around each wait for the decode replica's first output, `on_head` when its
    answer's head is in, `answered` once its first output is, `close` always."""

    def __init__(self, state: GatewayState, routed: Routed, prefill: Replica, decode: Replica) -> None:
        self.state, self.routed, self.prefill, self.decode = state, routed, prefill, decode
        # Headers the decode replica's request gains.
        self.headers: dict[str, str] = {}
        decision = routed.decision
        uncached = max(decision.prompt_tokens - decision.view_of(prefill.id).cached_tokens, 0)
        hashes = decision.hashes.get(prefill.block_size)
        tick = None
        if hashes and not prefill.precise:
            # It will hold the prompt too: predicted, as for the replica a request goes to.
            tick = state.index.tick_now(prefill.id)
            state.predictions.record(prefill.id, hashes)
        blocks = -(-uncached // prefill.block_size)
        self._handle: int | None = state.replicas.dispatched(
            prefill, time.monotonic(), uncached, tick, blocks
        )
        state.metrics.child(state.metrics.pd_requests, routed.model, prefill.id, decode.id).inc()

    async def start(self, headers: dict[str, str]) -> dict[str, Any]:
        """What the decode replica's body gains (`headers`: the upstream headers of the request)."""
        raise NotImplementedError  # each protocol's

    def sending(self, payload: bytes, headers: dict[str, str]) -> None:
        """The decode replica's request, as it goes."""

    async def guard(self, pending: Awaitable[T]) -> T:
        """A wait for the decode replica, given up if the prefill side fails first."""
        return await pending

    def on_head(self, headers: Mapping[str, str]) -> None:
        """The decode replica's answer head."""

    def answered(self) -> None:
        """The decode replica's first output is in: the prefill replica's part is over."""
        self._done(learn=True)

    async def close(self) -> None:
        self._done(learn=False)

    def _done(self, learn: bool) -> None:
        """The prefill work leaves the replica's queue; `learn`: its time since arrival teaches the
        replica's prefill rate."""
        if self._handle is None:
            return
        state = self.state
        if learn:
            learning = state.config.learning
            ttft = time.monotonic() - self.routed.arrival
            alpha, min_tokens = learning.ewma_alpha, learning.min_prefill_tokens
            state.replicas.started(self.prefill, self._handle, ttft, alpha=alpha, min_tokens=min_tokens)
        state.replicas.finished(self.prefill, self._handle)
        self._handle = None

    def _fallback(self, reason: str) -> None:
        """The decode replica computes the prompt itself."""
        log.warning(
            "prefill replica %s failed; decode replica %s computes the prompt itself: %s",
            self.prefill.id,
            self.decode.id,
            reason,
        )
        self.state.metrics.child(self.state.metrics.pd_fallbacks, self.routed.model, self.prefill.id).inc()
        self._done(learn=False)

    async def _request(self, payload: bytes, headers: dict[str, str]) -> UpstreamResponse:
        """The prefill request sent, its answer's head in; a failure to get it is PrefillFailed."""
        limits = self.state.config.limits
        try:
            return await self.state.upstream.request(
                "POST",
                self.prefill.url,
                self.routed.target,
                payload,
                _json_headers(headers),
                connect_s=limits.connect_timeout_s,
                read_s=limits.request_timeout_s,
            )
        except (TimeoutError, UpstreamError) as error:
            raise PrefillFailed(
                error_kind(error), f"prefill replica {self.prefill.id} could not be reached: {error!r}"
            ) from None

    async def _read(self, upstream: UpstreamResponse) -> bytes:
        """The prefill answer's body, to its end; one that is not a 200 is PrefillFailed."""
        try:
            body = await upstream.read()
        except (TimeoutError, UpstreamError) as error:
            raise PrefillFailed(
                error_kind(error), f"prefill replica {self.prefill.id} failed mid-answer: {error!r}"
            ) from None
        if upstream.status != 200:
            message = f"prefill replica {self.prefill.id} answered {upstream.status}"
            raise PrefillFailed(f"http_{upstream.status}", message, upstream.status, upstream.headers, body)
        return body


class BundledLeg(PrefillLeg):
    """prefixgate's own: the decode worker pulls the prompt's KV from the prefill worker its body's
    signed grant names, and computes the prompt itself, saying why, when that fails."""

    def __init__(
        self, state: GatewayState, routed: Routed, prefill: Replica, decode: Replica, secret: bytes
    ) -> None:
        super().__init__(state, routed, prefill, decode)
        self.secret = secret

    async def start(self, headers: dict[str, str]) -> dict[str, Any]:
        return bundled_fields(self.prefill.url, self.secret)

    def on_head(self, headers: Mapping[str, str]) -> None:
        m = self.state.metrics
        transferred = header_count(headers.get(TRANSFERRED_TOKENS_HEADER))
        if transferred is not None:
            m.child(m.pd_transferred_tokens, self.routed.model, self.prefill.id, self.decode.id).inc(
                transferred
            )
        reason = headers.get(PREFILL_ERROR_HEADER)
        if reason is not None:
            self.state.mark_failure(self.prefill)
            self._fallback(reason)


class VllmLeg(PrefillLeg):
    """vLLM's: the prefill instance first, cut to one token; its `kv_transfer_params` then go to the
    decode instance with the client's body. Both requests carry one X-Request-Id, made up here as
    vLLM's proxy does: the connector matches the two sides up by it, so a client's own (which could be
    another request's) is replaced on both."""

    async def start(self, headers: dict[str, str]) -> dict[str, Any]:
        self.headers[_REQUEST_ID] = str(uuid.uuid4())
        assert self.routed.body is not None  # only JSON bodies are paired
        payload = orjson.dumps(vllm_prefill_body(client_body(self.routed.body)))
        prefill_headers = type(headers)(headers)
        _own_request_id(prefill_headers, self.headers[_REQUEST_ID])
        upstream = await self._request(payload, prefill_headers)
        try:
            answer = await self._read(upstream)
        finally:
            upstream.release()
        params = vllm_transfer_params(answer)
        if params is None:
            self._fallback("its answer has no kv_transfer_params")
            return {}
        self._done(learn=True)  # its one token came after the prompt: how long that took
        return {"kv_transfer_params": params}

    def sending(self, payload: bytes, headers: dict[str, str]) -> None:
        """The decode request's headers lose the client's X-Request-Id, however it spelled the name."""
        _own_request_id(headers, self.headers[_REQUEST_ID])


class SglangLeg(PrefillLeg):
    """SGLang's: the prefill server gets the decode server's request, bootstrap fields included, at the
    same time; the decode server waits for the KV from it."""

    _task: asyncio.Task[None] | None = None

    async def start(self, headers: dict[str, str]) -> dict[str, Any]:
        assert self.routed.body is not None and self.prefill.bootstrap_port is not None
        body = client_body(self.routed.body)
        return sglang_fields(body, self.prefill.url, self.prefill.bootstrap_port, _ROOMS)

    def sending(self, payload: bytes, headers: dict[str, str]) -> None:
        self._task = asyncio.ensure_future(self._prefill(payload, headers))

    async def _prefill(self, payload: bytes, headers: dict[str, str]) -> None:
        upstream = await self._request(payload, headers)
        try:
            await self._read(upstream)
        finally:
            upstream.release()

    async def guard(self, pending: Awaitable[T]) -> T:
        task = self._task
        assert task is not None
        waiting = asyncio.ensure_future(pending)
        try:
            done, _ = await asyncio.wait({waiting, task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            _drop(waiting)
            raise
        failure = task.exception() if task in done and not task.cancelled() else None
        if waiting not in done and failure is not None:
            _drop(waiting)
            raise failure
        return await waiting

    async def close(self) -> None:
        task = self._task
        if task is not None:
            if not task.done():
                # The attempt is over (the decode server answered, failed, or the client left).
                task.cancel()
                await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved: a failure after the decode server's output changes nothing
        await super().close()


def _drop(waiting: asyncio.Future[Any]) -> None:
    """Give up a wait for the decode server; an answer that came in all the same is closed."""
    waiting.cancel()

    def close(done: asyncio.Future[Any]) -> None:
        if not done.cancelled() and done.exception() is None and isinstance(done.result(), UpstreamResponse):
            done.result().release()

    waiting.add_done_callback(close)


def _json_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """A prefill request's headers: the decode request's, each repeat kept (Cookie), sent as JSON."""
    sent = CIMultiDict((k, v) for k, v in headers.items() if k.lower() != "content-type")
    sent.update(_JSON)
    return sent


def _own_request_id(headers: MutableMapping[str, str], request_id: str) -> None:
    """Every X-Request-Id in `headers` (a dict, or a multidict with repeats) replaced by the pair's."""
    for name in {name for name in headers if name.lower() == _REQUEST_ID.lower()}:
        while name in headers:
            headers.pop(name)
    headers[_REQUEST_ID] = request_id


_LEGS: dict[str, type[PrefillLeg]] = {"vllm": VllmLeg, "sglang": SglangLeg}


def prefill_leg(state: GatewayState, routed: Routed, decode: Replica) -> PrefillLeg | None:
    """The prefill side of an attempt on `decode`; None when the decision paired it with none (or
    the prefill replica has left since), or it is a bundled pair and the gateway has no secret to
    sign its grant with."""
    prefill = state.replicas.get(routed.decision.prefill.get(decode.id, ""))
    if prefill is None or routed.body is None or routed.route not in PAIRED_ROUTES:
        return None
    if prefill.pd_protocol is not None:
        return _LEGS[prefill.pd_protocol](state, routed, prefill, decode)
    secret = _secret(state)
    return BundledLeg(state, routed, prefill, decode, secret) if secret is not None else None


def _secret(state: GatewayState) -> bytes | None:
    """The fleet's transfer secret; None (said once in the log) when it is unset or too short."""
    env = state.config.auth.transfer_secret_env
    try:
        secret = parse_secret(state.config.transfer_secret())
    except ValueError as error:
        _say_once(f"the transfer secret in ${env} is unusable ({error}): bundled workers are not paired")
        return None
    if secret is None:
        _say_once(
            f"no transfer secret (auth.transfer_secret_env: {env} is unset): bundled prefill and decode "
            "workers are not paired, each decode worker computes its prompts itself"
        )
    return secret


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        log.warning("%s", message)
