"""The OpenAI generation endpoints a bundled worker serves: /v1/completions and /v1/chat/completions.

A generation request is parsed, admitted to the bounded queue, tokenized off the loop, given the
prompt's KV when the gateway paired this worker with a prefill worker, and started on the engine;
its first output decides between a refusal (4xx) and an answer (workers.completion_replies).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from protocol.disaggregation import PREFILL_FIELD
from protocol.errors import ApiError
from protocol.openai_api import parse_chat, parse_completion, parse_json
from protocol.openai_responses import ResponseShaper
from protocol.prompts import prompt_token_ids
from workers.app_state import RUNTIME, Runtime
from workers.completion_replies import collect_reply, engine_failed, stream_reply, token_decoder
from workers.engine.engine_core import PromptTooLong, RequestOutput
from workers.engine.scheduler import UnschedulableSequence
from workers.kv_handoff import NO_SECRET, Pulled, unauthorised
from workers.openai_sampling import sampling_params

log = logging.getLogger("prefixgate.worker")


async def first_output(outs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The first delta, which is also where the engine refuses a request it can never run."""
    try:
        return await anext(outs)
    except PromptTooLong as error:
        raise ApiError(400, str(error), param="max_tokens", code="context_length_exceeded") from None
    except UnschedulableSequence as error:
        raise ApiError(400, str(error), param="max_tokens", code="request_too_large") from None
    except RuntimeError as error:
        raise engine_failed(error) from None


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
        decode_token=token_decoder(worker.tokenizer),
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
                first = await first_output(outs)
                release()
                rt.metrics.observe_ttft(time.monotonic() - arrival)
                if gen.stream:
                    return await stream_reply(request, rt, gen, shaper, outs, first, arrival, headers)
                return await collect_reply(rt, gen, shaper, outs, first, arrival, headers)
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


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)
