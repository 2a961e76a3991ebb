"""A worker's part in prefill/decode disaggregation, as the app wires it: the /kv/prefill endpoint a
prefill worker answers, and the decode worker's transfer port and puller, live while the app runs
(the transfers themselves: workers.kv_handoff, workers.kv_transfer)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from protocol.errors import ApiError
from protocol.openai_api import parse_json
from workers.app_state import RUNTIME
from workers.engine.engine_core import PromptTooLong
from workers.engine.scheduler import UnschedulableSequence
from workers.kv_handoff import NO_SECRET, PrefillOrder, Puller, prefill_and_push, unauthorised
from workers.kv_transfer import TransferServer

log = logging.getLogger("prefixgate.worker")


async def kv_prefill(request: web.Request) -> web.Response:
    """The prefill side of disaggregation: compute a prompt and push its KV blocks to the decode
    worker that asked (workers.kv_handoff)."""
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


async def transfer_context(app: web.Application) -> AsyncIterator[None]:
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
