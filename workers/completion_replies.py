"""How the engine's deltas for one request become its answer: one OpenAI JSON body, or server-sent
events as they arrive, with usage (cached tokens included) and the worker's name in the headers.

Apart from the route that admits and starts the request (workers.openai_routes): this is the part
that reads the engine's outputs, counts them and writes them to the client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from protocol.errors import ApiError
from protocol.openai_api import GenerationRequest
from protocol.openai_responses import (
    CACHED_TOKENS_HEADER,
    SSE_DONE,
    Choice,
    ResponseShaper,
    TokenLogprob,
    sse,
    usage_json,
)
from protocol.stream_ids import STREAM_IDS_HEADER, ids_comment
from protocol.tokenizer import Tokenizer
from workers.app_state import Runtime
from workers.engine.engine_core import RequestOutput

log = logging.getLogger("prefixgate.worker")

# Every answer names the worker that computed it: behind a router that says nothing of its choice
# (a peer router in the benchmarks), the client can still tell where each request went.
WORKER_HEADER = "x-prefixgate-worker"


def _token_logprobs(out: RequestOutput) -> list[TokenLogprob]:
    return [(t, lp, top) for t, (lp, top) in zip(out.new_token_ids, out.new_logprobs or [], strict=False)]


def token_decoder(tokenizer: Tokenizer | None) -> Callable[[int], str]:
    """One token's text for logprobs; with no tokenizer, its id (the only name it has)."""
    if tokenizer is None:
        return str
    return lambda token_id: tokenizer.decode([token_id])


def engine_failed(error: RuntimeError) -> ApiError:
    """A failed engine step (AsyncLLM fails every request in it): the worker's fault, not the client's."""
    return ApiError(500, f"the engine failed: {error}", code="engine_error")


@dataclass(slots=True)
class Usage:
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


def _observe_finished(rt: Runtime, usage: Usage, arrival: float) -> None:
    rt.metrics.observe_finished(
        time.monotonic() - arrival, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens
    )


async def collect_reply(
    rt: Runtime,
    gen: GenerationRequest,
    shaper: ResponseShaper,
    outs: AsyncIterator[RequestOutput],
    out: RequestOutput,
    arrival: float,
    headers: dict[str, str],
) -> web.Response:
    usage = Usage(gen.n)
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
            raise engine_failed(error) from None
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


async def stream_reply(
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
    usage = Usage(gen.n)
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
                await response.write(sse(engine_failed(error).to_json()))
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
