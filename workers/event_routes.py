"""The KV event feed over HTTP (docs/design.md §4): /kv/snapshot, the cached set to start from, and
/kv/events, the long-poll of the batches after a sequence number, for gateways that do not subscribe
to a publisher."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import orjson
from aiohttp import web

from protocol.errors import ApiError, error_json
from workers.app_state import RUNTIME, Runtime
from workers.kv_event_log import EventsGone

MAX_EVENTS_TIMEOUT_S = 60.0
DEFAULT_EVENTS_LIMIT = 1024


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


def query_number(
    query: Mapping[str, str],
    name: str,
    parse: Callable[[str], float],
    default: float | None,
    lo: float,
    hi: float,
) -> float:
    """The query parameter `name` as a number in [lo, hi]: `default` when absent (None: it is required),
    and a 400 naming it when it is out of bounds or does not parse (NaN is in no bounds)."""
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
    after = int(query_number(query, "after", int, None, 0, 2**63))
    timeout = query_number(query, "timeout", float, 0.0, 0.0, MAX_EVENTS_TIMEOUT_S)
    limit = int(query_number(query, "limit", int, DEFAULT_EVENTS_LIMIT, 1, 2**31))
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
