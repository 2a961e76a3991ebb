"""What a replica is and how loaded it is, asked over HTTP or read from Redis (DESIGN §4).

A bundled worker's /health names its id, model, block size, pool, incarnation and role; a foreign
OpenAI server only lists its models, so the rest comes from the YAML entry. These functions do the I/O
and return plain values; the gateway decides what they mean for its replica set.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from redis.asyncio import Redis

from gateway.config import ReplicaEntry
from gateway.replicas import Kind, LoadReport, default_replica_id
from policies import Role
from protocol.disaggregation import DEFAULT_ROLE, ROLE_FIELD, ROLES
from protocol.redis_keys import WORKERS, load_key, worker_key

# When a foreign backend does not say its context window.
DEFAULT_MAX_CONTEXT = 4096


class ProbeFailed(Exception):
    """The replica did not answer as a replica should; the message says how."""


@dataclass(frozen=True, slots=True)
class Probe:
    id: str
    url: str
    kind: Kind
    model: str
    block_size: int
    # KV blocks: a bundled worker's pool; for a foreign backend the configured prior (None: learned).
    capacity_blocks: int | None
    max_context_len: int
    max_waiting: int
    incarnation: str | None
    # Its KV events in vLLM's wire format, when configured (ReplicaEntry.kv_events): followed over ZMQ.
    kv_events: str | None = None
    kv_events_replay: str | None = None
    # Its part in a prefill/decode fleet: announced by a bundled worker, configured for a foreign one.
    role: Role = "mixed"
    pd_protocol: str | None = None
    bootstrap_port: int | None = None


def announced_role(fields: dict[str, Any]) -> Role | None:
    """The role a bundled worker announces (its /health or registry entry; absent: a worker from before
    roles, which is mixed), or None when it names one the gateway does not know."""
    role = fields.get(ROLE_FIELD, DEFAULT_ROLE)
    return role if role in ROLES else None


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> Any:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                raise ProbeFailed(f"GET {url} answered {response.status}")
            text = await response.text()
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as error:
        # ValueError: a URL aiohttp cannot send (credentials it cannot encode, say) is one that fails.
        raise ProbeFailed(f"GET {url} failed: {error!r}") from None
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return None


def _is_bundled(health: Any) -> bool:
    return isinstance(health, dict) and "block_size" in health and "incarnation" in health


async def probe(session: aiohttp.ClientSession, entry: ReplicaEntry, timeout_s: float) -> Probe:
    """Ask `entry.url` what it is; raises ProbeFailed when it is down or not an OpenAI server."""
    health = await _get_json(session, f"{entry.url}/health", timeout_s)
    if entry.kind == "bundled" or (entry.kind == "auto" and _is_bundled(health)):
        if not _is_bundled(health):
            raise ProbeFailed(f"{entry.url}/health is not a prefixgate worker's")
        role = announced_role(health)
        if role is None:
            announced = health.get(ROLE_FIELD)
            raise ProbeFailed(f"{entry.url}/health announces role {announced!r}, not one of {ROLES}")
        return Probe(
            id=entry.id or str(health.get("worker_id") or default_replica_id(entry.url)),
            url=entry.url,
            kind="bundled",
            model=str(health["model"]),
            block_size=int(health["block_size"]),
            capacity_blocks=int(health["num_blocks"]),
            max_context_len=int(health["max_context_len"]),
            max_waiting=int(health.get("max_waiting", 256)),
            incarnation=str(health["incarnation"]),
            kv_events=entry.kv_events,
            kv_events_replay=entry.kv_events_replay,
            role=role,
        )
    if entry.role != "mixed" and entry.pd_protocol is None:
        raise ProbeFailed(
            f"{entry.url} is not a prefixgate worker: a foreign {entry.role} replica needs pd_protocol "
            "(vllm or sglang)"
        )
    models = await _get_json(session, f"{entry.url}/v1/models", timeout_s)
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list) or not data:
        raise ProbeFailed(f"{entry.url}/v1/models lists no models")
    ids = [m.get("id") for m in data if isinstance(m, dict)]
    model = entry.model or ids[0]
    if model not in ids:
        raise ProbeFailed(f"{entry.url} does not serve {model!r} (it lists {ids})")
    listed = next(m for m in data if isinstance(m, dict) and m.get("id") == model)
    sglang_prefill = entry.pd_protocol == "sglang" and entry.role == "prefill"
    return Probe(
        id=entry.id or default_replica_id(entry.url),
        url=entry.url,
        kind="openai",
        model=model,
        block_size=entry.block_size,
        capacity_blocks=entry.capacity_blocks,
        max_context_len=int(listed.get("max_model_len") or DEFAULT_MAX_CONTEXT),
        max_waiting=256,
        incarnation=None,
        kv_events=entry.kv_events,
        kv_events_replay=entry.kv_events_replay,
        role=entry.role,
        pd_protocol=entry.pd_protocol,
        bootstrap_port=entry.bootstrap_port if sglang_prefill else None,
    )


async def fetch_load(session: aiohttp.ClientSession, url: str, timeout_s: float) -> LoadReport:
    """A bundled worker's /load, stamped with the gateway time the question left (the report covers
    at least everything dispatched before it)."""
    asked = time.monotonic()
    body = await _get_json(session, f"{url}/load", timeout_s)
    if not isinstance(body, dict):
        raise ProbeFailed(f"{url}/load is not a load report")
    return _report(body, asked)


def _report(body: dict[str, Any], at: float) -> LoadReport:
    return LoadReport(
        running=int(body.get("running", 0)),
        waiting=int(body.get("waiting", 0)),
        queued_prefill_tokens=int(body.get("queued_prefill_tokens", 0)),
        kv_blocks_used=int(body.get("kv_blocks_used", 0)),
        kv_blocks_total=int(body.get("kv_blocks_total", 0)),
        at=at,
    )


@dataclass(frozen=True, slots=True)
class Registered:
    probe: Probe
    # The worker's latest load report, if it is fresh enough to still exist.
    load: LoadReport | None


async def read_registry(redis: Redis) -> list[Registered]:
    """Every live worker in the Redis registry with its last load report (DESIGN §4).

    A set member whose hash expired is a worker that died without deregistering: skipped.
    """
    ids = sorted(await redis.smembers(WORKERS))
    if not ids:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for wid in ids:
            pipe.hgetall(worker_key(wid))
            pipe.get(load_key(wid))
        replies = await pipe.execute()
    wall, mono = time.time(), time.monotonic()
    found = []
    for fields, raw_load in zip(replies[::2], replies[1::2], strict=True):
        role = announced_role(fields) if fields else None
        if role is None:
            continue  # expired, or a role this gateway does not know: not ours to route to
        try:
            probe = Probe(
                id=fields["id"],
                url=fields["url"].rstrip("/"),
                kind="bundled",
                model=fields["model"],
                block_size=int(fields["block_size"]),
                capacity_blocks=int(fields["num_blocks"]),
                max_context_len=int(fields["max_context_len"]),
                max_waiting=256,
                incarnation=fields.get("incarnation"),
                role=role,
            )
        except (KeyError, ValueError):
            continue  # a half-written or foreign entry: not ours to route to
        load = None
        if raw_load:
            body = json.loads(raw_load)
            # The worker's wall clock to the gateway's monotonic one.
            load = _report(body, mono - max(wall - float(body.get("ts", wall)), 0.0))
        found.append(Registered(probe, load))
    return found
