"""The worker's HTTP server (docs/design.md §4): OpenAI endpoints over an engine front, plus health, load,
Prometheus metrics and the KV event feed.

The app is built from a `Worker` (an engine front, its tokenizer, what it announces, its KV event
log) and owns its lifecycle: it starts the event feed on its loop and shuts the engine down when it
stops. Other transports (Redis registry, heartbeats, event stream) plug in as extra aiohttp
cleanup contexts that find everything under `app[RUNTIME]`.

The app must run with `handler_cancellation=True` (protocol.serving.serve): a client that goes away then
cancels its handler, which closes its generation stream, which aborts the request (all of its n
choices) and frees its KV blocks at once instead of generating for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from protocol.disaggregation import PREFILL_FIELD, Role
from protocol.errors import CLIENT_GONE, RETRY_AFTER_S, ApiError, error_json
from protocol.kv_events import EventBatch
from protocol.openai_api import GenerationRequest, ServedModel, parse_chat, parse_completion, parse_json
from protocol.openai_responses import (
    CACHED_TOKENS_HEADER,
    SSE_DONE,
    Choice,
    ResponseShaper,
    TokenLogprob,
    sse,
    usage_json,
)
from protocol.prompts import prompt_token_ids
from protocol.serving import METRICS_CONTENT_TYPE
from protocol.stream_ids import STREAM_IDS_HEADER, ids_comment
from protocol.tokenizer import Tokenizer
from workers.disaggregation import (
    DEFAULT_ROOM_WAIT_S,
    DEFAULT_TRANSFER_TIMEOUT_S,
    NO_SECRET,
    PrefillOrder,
    Pulled,
    Puller,
    prefill_and_push,
    unauthorised,
)
from workers.engine.engine import Engine, PromptTooLong, RequestOutput
from workers.engine.llm import AsyncLLM
from workers.engine.scheduler import UnschedulableSequence
from workers.kv_events import EventsGone, KVEventLog
from workers.kv_transfer import KVStore, NoKV, TransferServer
from workers.metrics import WorkerMetrics
from workers.openai_sampling import sampling_params

if TYPE_CHECKING:
    from workers.sim.engine import SimEngine
    from workers.sim.words import WordTokenizer

log = logging.getLogger("prefixgate.worker")

DEFAULT_MAX_WAITING = 256
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
MAX_EVENTS_TIMEOUT_S = 60.0
DEFAULT_EVENTS_LIMIT = 1024
# Every answer names the worker that computed it: behind a router that says nothing of its choice
# (a peer router in the benchmarks), the client can still tell where each request went.
WORKER_HEADER = "x-prefixgate-worker"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What the worker announces (/health, and the registry entry another transport publishes)."""

    worker_id: str
    model: str
    block_size: int
    num_blocks: int
    max_context_len: int
    vocab_size: int
    backend: str
    # Why that backend (the log and /health say it: "auto chose torch_sdpa: flash_attn cannot run ...").
    backend_reason: str = ""
    role: Role = "mixed"

    @property
    def served_model(self) -> ServedModel:
        return ServedModel(
            self.model, self.vocab_size, self.max_context_len, self.block_size * self.num_blocks
        )


@dataclass(slots=True)
class Worker:
    # The engine loop in its thread (the model's, or the simulated engine's).
    front: AsyncLLM
    # None for an engine without one (the simulated engine): prompts must then come as token ids. A
    # simulated engine may be given one that counts words (workers.sim.words).
    tokenizer: Tokenizer | WordTokenizer | None
    info: WorkerInfo
    events: KVEventLog
    # Where the engine's KV blocks are read and written as bytes, to move them between workers.
    store: KVStore = field(default_factory=NoKV)
    # Requests accepted but not yet generating; one more is refused with 429.
    max_waiting: int = DEFAULT_MAX_WAITING
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # The decode side of disaggregation: the TCP port prefill workers push KV to (0: any free one),
    # the host they reach it at, and how long a pull may take before the prompt is computed here.
    transfer_port: int = 0
    transfer_host: str = "127.0.0.1"
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    # How long a pull waits for KV room before the prompt is computed here after all.
    room_wait_s: float = DEFAULT_ROOM_WAIT_S
    # The fleet's KV transfer secret (protocol.transfer_auth); None: no part in disaggregation.
    transfer_secret: bytes | None = None

    @classmethod
    def around(
        cls,
        engine: Engine | SimEngine,
        events: KVEventLog,
        *,
        worker_id: str,
        backend: str,
        backend_reason: str = "",
        role: Role = "mixed",
        tokenizer: WordTokenizer | None = None,
        **options: Any,
    ) -> Worker:
        """A worker over an engine built with `events.callbacks()`, run by an AsyncLLM thread, that
        tokenizes text prompts with the engine's tokenizer or, for a simulated engine (which has
        none), with `tokenizer` if given."""
        bm = engine.block_manager
        # The simulated engine has no model config, only the vocabulary size its tokens are drawn from.
        vocab_size = getattr(engine, "vocab_size", None) or engine.model_config.vocab_size
        info = WorkerInfo(
            worker_id=worker_id,
            model=engine.model_name,
            block_size=bm.block_size,
            num_blocks=bm.num_blocks,
            max_context_len=engine.max_context_len,
            vocab_size=vocab_size,
            backend=backend,
            backend_reason=backend_reason,
            role=role,
        )
        # The simulated engine has no KV tensors: its transfers move hashes only.
        store = engine.runner if isinstance(engine.runner, KVStore) else NoKV()
        prompts = tokenizer if tokenizer is not None else engine.tokenizer
        return cls(AsyncLLM(engine), prompts, info, events, store, **options)


class EventFeed:
    """Seals the log's pending events on the event loop and wakes the readers waiting for them.

    The log calls `_kick` on the engine thread when a burst of events begins; the seal then runs on
    the loop, so readers and sealing never race with each other, only (under the log's lock) with
    the engine appending.
    """

    def __init__(self, events: KVEventLog) -> None:
        self.events = events
        self._loop: asyncio.AbstractEventLoop | None = None
        self._new: asyncio.Event | None = None
        self._closed = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._new = asyncio.Event()
        self.events.on_pending = self._kick
        self.flush()

    def close(self) -> None:
        """Stop sealing and release every waiting reader (the worker is going away)."""
        self.events.on_pending = None
        self._closed = True
        if self._new is not None:
            self._new.set()

    def _kick(self) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self.flush)
        except RuntimeError:  # the loop closed under us: nobody is left to read
            self.events.on_pending = None

    def flush(self) -> EventBatch | None:
        batch = self.events.seal()
        if batch is not None and self._new is not None:
            self._new.set()
            self._new = asyncio.Event()
        return batch

    async def wait_after(self, seq: int, timeout: float, limit: int | None = None) -> list[EventBatch]:
        """The batches after `seq`, waiting up to `timeout` seconds for one when there are none yet."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self.flush()
            batches = self.events.after(seq, limit)
            remaining = deadline - loop.time()
            if batches or remaining <= 0 or self._closed or self._new is None:
                return batches
            try:
                async with asyncio.timeout(remaining):
                    await self._new.wait()
            except TimeoutError:
                return []


class Admission:
    """The bounded waiting queue: requests accepted but not yet generating (tokenizing, or queued in
    the engine). Counted here on the event loop, so the check is exact and needs no engine call."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_waiting must be at least 1, got {limit}")
        self.limit = limit
        self.waiting = 0

    @contextmanager
    def slot(self) -> Iterator[Callable[[], None]]:
        """Claim a place or refuse with 429; yields `release`, to call once generation starts."""
        if self.waiting >= self.limit:
            raise ApiError(
                429,
                f"the worker's waiting queue is full ({self.limit} requests); retry shortly",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.waiting += 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.waiting -= 1

        try:
            yield release
        finally:
            release()


@dataclass(slots=True)
class Runtime:
    """Per-app state: what the handlers and the extra startup contexts share."""

    worker: Worker
    metrics: WorkerMetrics
    feed: EventFeed
    admission: Admission
    started: float = field(default_factory=time.time)
    # One thread: HF tokenizers are not safe to encode from several threads at once.
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
    )
    # The decode side of disaggregation, live while the app runs (None but on a decode worker).
    puller: Puller | None = None


RUNTIME = web.AppKey("runtime", Runtime)
Context = Callable[[web.Application], AsyncIterator[None]]


# -- generation ---------------------------------------------------------------------------------


def _token_logprobs(out: RequestOutput) -> list[TokenLogprob]:
    return [(t, lp, top) for t, (lp, top) in zip(out.new_token_ids, out.new_logprobs or [], strict=False)]


def _token_decoder(tokenizer: Tokenizer | None) -> Callable[[int], str]:
    """One token's text for logprobs; with no tokenizer, its id (the only name it has)."""
    if tokenizer is None:
        return str
    return lambda token_id: tokenizer.decode([token_id])


def _engine_failed(error: RuntimeError) -> ApiError:
    """A failed engine step (AsyncLLM fails every request in it): the worker's fault, not the client's."""
    return ApiError(500, f"the engine failed: {error}", code="engine_error")


async def _first_output(outs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The first delta, which is also where the engine refuses a request it can never run."""
    try:
        return await anext(outs)
    except PromptTooLong as error:
        raise ApiError(400, str(error), param="max_tokens", code="context_length_exceeded") from None
    except UnschedulableSequence as error:
        raise ApiError(400, str(error), param="max_tokens", code="request_too_large") from None
    except RuntimeError as error:
        raise _engine_failed(error) from None


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    rt = request.app[RUNTIME]
    worker = rt.worker
    arrival = time.monotonic()
    body = parse_json(await request.read())
    served = worker.info.served_model
    gen = (parse_chat if chat else parse_completion)(body, served)
    shaper = ResponseShaper(
        chat=chat,
        model=served.name,
        created=int(time.time()),
        decode_token=_token_decoder(worker.tokenizer),
        include_usage=gen.include_usage,
    )
    grant = _granted(rt, body) if gen.prefill_url is not None else None
    with rt.admission.slot() as release:
        if gen.token_ids is not None:  # the gateway's ids (or the client's): nothing to tokenize
            ids = list(gen.token_ids)
        else:
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(rt.tokenize_pool, prompt_token_ids, gen, worker.tokenizer)
        sampling = sampling_params(gen, len(ids), served, worker.info.block_size)
        pulled = await _pull(rt, ids, grant)
        prelude = pulled.prelude() if pulled is not None else None
        headers = pulled.headers() if pulled is not None else {}
        try:
            async with aclosing(worker.front.generate(ids, sampling, gen.n, prelude)) as outs:
                first = await _first_output(outs)
                release()
                rt.metrics.observe_ttft(time.monotonic() - arrival)
                if gen.stream:
                    return await _stream(request, rt, gen, shaper, outs, first, arrival, headers)
                return await _collect(rt, gen, shaper, outs, first, arrival, headers)
        finally:
            # A request that never joined the batch (its client left first) never installed what
            # it pulled: let it go. After the install this changes nothing.
            if pulled is not None and pulled.reservation is not None:
                reservation = pulled.reservation
                worker.front.post(lambda engine: engine.block_manager.release(reservation))


def _granted(rt: Runtime, body: dict[str, Any]) -> tuple[str, str]:
    """The prefill worker and transfer id the gateway's signed grant names (Puller.authorise); checked
    before the request queues, so a refused one costs nothing."""
    if rt.puller is None:
        if rt.worker.info.role == "decode":
            raise unauthorised(NO_SECRET)
        raise ApiError(
            400,
            f"this is a {rt.worker.info.role} worker: only a decode worker pulls KV (prefixgate_prefill)",
            param="prefixgate_prefill",
        )
    return rt.puller.authorise(body.get(PREFILL_FIELD))


async def _pull(rt: Runtime, ids: list[int], grant: tuple[str, str] | None) -> Pulled | None:
    """The prompt's KV from the prefill worker the gateway's grant names, if it gave one."""
    if grant is None:
        return None
    assert rt.puller is not None
    pulled = await rt.puller.pull(ids, *grant)
    rt.metrics.observe_pull(pulled.tokens, pulled.bytes, pulled.seconds, failed=pulled.error is not None)
    if pulled.error is not None:
        log.warning("computing the prompt here: %s", pulled.error)
    return pulled


@dataclass(slots=True)
class _Usage:
    """A request's usage as its choices' deltas arrive: the prompt counts once, completions add up."""

    unfinished: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        if out.finished:
            self.unfinished -= 1
            self.completion_tokens += out.completion_tokens

    def json(self) -> dict[str, Any]:
        return usage_json(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


def _observe_finished(rt: Runtime, usage: _Usage, arrival: float) -> None:
    rt.metrics.observe_finished(
        time.monotonic() - arrival, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens
    )


async def _collect(
    rt: Runtime,
    gen: GenerationRequest,
    shaper: ResponseShaper,
    outs: AsyncIterator[RequestOutput],
    out: RequestOutput,
    arrival: float,
    headers: dict[str, str],
) -> web.Response:
    usage = _Usage(gen.n)
    texts: list[list[str]] = [[] for _ in range(gen.n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(gen.n)]
    reasons: list[str | None] = [None] * gen.n
    while True:
        usage.add(out)
        texts[out.index].append(out.new_text)
        logprobs[out.index] += _token_logprobs(out)
        reasons[out.index] = out.finish_reason
        if not usage.unfinished:
            break
        try:
            out = await anext(outs)
        except RuntimeError as error:
            raise _engine_failed(error) from None
    _observe_finished(rt, usage, arrival)
    choices = [
        Choice("".join(text), reason, lps if gen.logprobs is not None else None)
        for text, reason, lps in zip(texts, reasons, logprobs, strict=True)
    ]
    return web.json_response(
        shaper.response(choices, usage.json()),
        headers={
            **headers,
            CACHED_TOKENS_HEADER: str(usage.cached_tokens),
            WORKER_HEADER: rt.worker.info.worker_id,
        },
    )


async def _stream(
    request: web.Request,
    rt: Runtime,
    gen: GenerationRequest,
    shaper: ResponseShaper,
    outs: AsyncIterator[RequestOutput],
    out: RequestOutput,
    arrival: float,
    headers: dict[str, str],
) -> web.StreamResponse:
    """Server-sent events, headers sent once the first token exists (so refusals are still 4xx).
    Each choice's deltas carry its index; the usage chunk and [DONE] come once, after the last."""
    response = web.StreamResponse(
        headers={
            **headers,
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            CACHED_TOKENS_HEADER: str(out.cached_tokens),
            WORKER_HEADER: rt.worker.info.worker_id,
        }
    )
    await response.prepare(request)
    usage = _Usage(gen.n)
    # The gateway's ask: each event names its tokens' ids (protocol.stream_ids), for it to continue from.
    ids: list[list[int]] | None = [[] for _ in range(gen.n)] if STREAM_IDS_HEADER in request.headers else None
    try:
        if gen.chat:
            for index in range(gen.n):
                await response.write(sse(shaper.chunk("", None, role=True, index=index)))
        while True:
            usage.add(out)
            logprobs = _token_logprobs(out) if gen.logprobs is not None else None
            if ids is not None:
                ids[out.index] += out.new_token_ids
            if out.new_text or out.finished or logprobs:
                reason = out.finish_reason if out.finished else None
                note = b""
                if ids is not None:
                    note, ids[out.index] = ids_comment(ids[out.index]), []
                chunk = shaper.chunk(out.new_text, reason, logprobs, index=out.index)
                await response.write(note + sse(chunk))
            if not usage.unfinished:
                break
            try:
                out = await anext(outs)
            except RuntimeError as error:
                await response.write(sse(_engine_failed(error).to_json()))
                break
        if not usage.unfinished:
            _observe_finished(rt, usage, arrival)
            if gen.include_usage:
                await response.write(sse(shaper.usage_chunk(usage.json())))
        await response.write(SSE_DONE)
        await response.write_eof()
    except ConnectionError:
        log.debug("client left mid-stream; the request is aborted")
    return response


# -- other endpoints ----------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    info = rt.worker.info
    entry = {
        "id": info.model,
        "object": "model",
        "created": int(rt.started),
        "owned_by": "prefixgate",
        "max_model_len": info.max_context_len,
    }
    return web.json_response({"object": "list", "data": [entry]})


async def health(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    info = rt.worker.info
    return web.json_response(
        {
            "status": "ok",
            "worker_id": info.worker_id,
            "model": info.model,
            "incarnation": rt.worker.events.incarnation,
            "block_size": info.block_size,
            "num_blocks": info.num_blocks,
            "max_context_len": info.max_context_len,
            "backend": info.backend,
            "backend_reason": info.backend_reason,
            "role": info.role,
            "max_waiting": rt.admission.limit,
            "uptime_s": round(time.time() - rt.started, 3),
        }
    )


async def load(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    stats = await rt.worker.front.stats()
    return web.json_response(
        {
            "running": stats.running,
            "waiting": stats.waiting,
            "queued_prefill_tokens": stats.queued_prefill_tokens,
            "kv_blocks_used": stats.kv_blocks_used,
            "kv_blocks_total": stats.kv_blocks_total,
            "block_size": rt.worker.info.block_size,
        }
    )


async def metrics(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    rt.feed.flush()
    rt.metrics.set_load(await rt.worker.front.stats(), rt.worker.events.num_cached)
    moe = rt.worker.front.engine.moe_routing
    if moe is not None:
        rt.metrics.moe.set(rt.metrics.model, *moe)
    return web.Response(body=rt.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})


async def kv_snapshot(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    rt.feed.flush()
    snap = rt.worker.events.snapshot()
    return web.json_response(
        {
            "incarnation": snap.incarnation,
            "seq": snap.seq,
            "block_size": rt.worker.info.block_size,
            "model": rt.worker.info.model,
            "hashes": list(snap.hashes),
        }
    )


def _query(
    query: Mapping[str, str],
    name: str,
    parse: Callable[[str], float],
    default: float | None,
    lo: float,
    hi: float,
) -> float:
    raw = query.get(name)
    if raw is None:
        if default is None:
            raise ApiError(400, f"the query parameter {name} is required", param=name, code="invalid_value")
        return default
    try:
        value = parse(raw)
    except ValueError:
        value = float("nan")
    if not lo <= value <= hi:
        kind = "an integer" if parse is int else "a number"
        raise ApiError(
            400, f"{name} must be {kind} in [{lo:g}, {hi:g}], got {raw!r}", param=name, code="invalid_value"
        )
    return value


def _gone(rt: Runtime, message: str) -> web.Response:
    body = error_json(message, "invalid_request_error", "after", "events_gone")
    body |= {"incarnation": rt.worker.events.incarnation, "seq": rt.worker.events.seq}
    return web.json_response(body, status=410)


async def kv_events(request: web.Request) -> web.Response:
    """Long-poll: `after=SEQ` (required), `timeout=S` (default 0), `limit=N`, `incarnation=ID`.

    410 when the batches after SEQ are gone (or SEQ, or the given incarnation, is not this one's):
    the body carries the current incarnation and seq, and the reader resyncs from /kv/snapshot.
    """
    rt = request.app[RUNTIME]
    query = request.query
    after = int(_query(query, "after", int, None, 0, 2**63))
    timeout = _query(query, "timeout", float, 0.0, 0.0, MAX_EVENTS_TIMEOUT_S)
    limit = int(_query(query, "limit", int, DEFAULT_EVENTS_LIMIT, 1, 2**31))
    events = rt.worker.events
    incarnation = query.get("incarnation")
    if incarnation is not None and incarnation != events.incarnation:
        return _gone(rt, f"incarnation {incarnation} has ended; this worker now runs {events.incarnation}")
    try:
        batches = await rt.feed.wait_after(after, timeout, limit)
    except EventsGone as gone:
        return _gone(rt, str(gone))
    # Read by every gateway after every engine step under load: orjson, several times the stdlib's speed.
    body = {"incarnation": events.incarnation, "seq": events.seq, "batches": [b.to_json() for b in batches]}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


# -- the app ------------------------------------------------------------------------------------


def _endpoint(request: web.Request) -> str:
    """The route's template as the metrics label; never the raw path, whose values are unbounded."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _error_response(error: ApiError) -> web.Response:
    return web.json_response(error.to_json(), status=error.status, headers=error.headers)


@web.middleware
async def _errors_and_metrics(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every failure as OpenAI's error JSON (aiohttp's own 404/405/413 included), every request counted."""
    metrics = request.app[RUNTIME].metrics
    try:
        response = await handler(request)
    except ApiError as error:
        response = _error_response(error)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        code = error.reason.lower().replace(" ", "_")
        response = _error_response(ApiError(error.status, error.text or error.reason, code=code))
    except asyncio.CancelledError:
        metrics.observe_request(_endpoint(request), CLIENT_GONE)
        raise
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        response = _error_response(ApiError(500, "internal error in the worker", code="internal_error"))
    metrics.observe_request(_endpoint(request), response.status)
    return response


async def kv_prefill(request: web.Request) -> web.Response:
    """The prefill side of disaggregation: compute a prompt and push its KV blocks to the decode
    worker that asked (workers.disaggregation)."""
    rt = request.app[RUNTIME]
    worker = rt.worker
    secret = worker.transfer_secret
    if secret is None:
        raise unauthorised(NO_SECRET, param=None)
    order = PrefillOrder.parse(parse_json(await request.read()), worker.info.vocab_size, secret)
    with rt.admission.slot():
        try:
            report = await prefill_and_push(worker.front, worker.store, worker.info.block_size, order, secret)
        except (PromptTooLong, UnschedulableSequence) as error:
            raise ApiError(400, str(error), param="token_ids", code="request_too_large") from None
    rt.metrics.observe_push(report["bytes"])
    return web.json_response(report)


async def _transfers(app: web.Application) -> AsyncIterator[None]:
    """A decode worker's transfer port and its HTTP client to prefill workers. Only a decode worker's
    with the fleet's secret: the gateway pairs no other, nobody else could push to it, and a listening
    port nobody uses is one more to collide with."""
    rt = app[RUNTIME]
    worker = rt.worker
    secret = worker.transfer_secret
    if worker.info.role != "decode" or secret is None:
        if worker.info.role == "decode":
            log.warning("%s: no KV transfer port; every prompt is computed here", NO_SECRET)
        yield
        return
    server = TransferServer(worker.store, secret, worker.transfer_host, worker.transfer_port)
    await server.start()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        rt.puller = Puller(
            worker.front,
            server,
            session,
            secret,
            worker.info.block_size,
            worker.info.num_blocks,
            worker.transfer_host,
            worker.transfer_timeout_s,
            worker.room_wait_s,
        )
        log.info("receiving KV transfers on %s:%d", worker.transfer_host, server.port)
        try:
            yield
        finally:
            rt.puller = None
            await server.close()


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    rt = app[RUNTIME]
    rt.feed.start()
    info = rt.worker.info
    log.info(
        "worker %s serving %s as %s (block size %d, %d blocks, %s: %s), incarnation %s",
        info.worker_id,
        info.model,
        info.role,
        info.block_size,
        info.num_blocks,
        info.backend,
        info.backend_reason,
        rt.worker.events.incarnation,
    )
    yield
    rt.feed.close()
    rt.tokenize_pool.shutdown(wait=False)
    await asyncio.get_running_loop().run_in_executor(None, rt.worker.front.shutdown)


async def _release_pollers(app: web.Application) -> None:
    app[RUNTIME].feed.close()


def create_app(worker: Worker, *, contexts: Sequence[Context] = ()) -> web.Application:
    """The worker app. `contexts` are aiohttp cleanup contexts run after the worker's own start-up
    (the feed is live) and torn down before the engine stops: where a Redis registry or event
    publisher hooks in, reading `app[RUNTIME]`."""
    app = web.Application(client_max_size=worker.max_body_bytes, middlewares=[_errors_and_metrics])
    app[RUNTIME] = Runtime(
        worker=worker,
        metrics=WorkerMetrics(worker.info.model),
        feed=EventFeed(worker.events),
        admission=Admission(worker.max_waiting),
    )
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/kv/snapshot", kv_snapshot)
    app.router.add_get("/kv/events", kv_events)
    app.router.add_post("/kv/prefill", kv_prefill)
    app.cleanup_ctx.append(_lifecycle)
    app.cleanup_ctx.append(_transfers)
    app.cleanup_ctx.extend(contexts)
    app.on_shutdown.append(_release_pollers)
    return app
