"""What a worker says about itself: /v1/models (the model it serves, as OpenAI lists it), /health (what
it is), /load (how busy it is, for routing) and /metrics (Prometheus, vLLM's names where they exist)."""

from __future__ import annotations

import time

from aiohttp import web

from protocol.serving import METRICS_CONTENT_TYPE
from workers.app_state import RUNTIME


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
