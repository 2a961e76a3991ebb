"""What a replica is and how loaded it is, asked over HTTP or read from Redis (docs/design.md §4).

A bundled worker's /health names its id, model, block size, pool, incarnation and role; a foreign
OpenAI server only lists its models, so the rest comes from the YAML entry. These functions do the I/O
and return plain values; the gateway decides what they mean for its replica set.

What a replica announces and what Redis holds are validated field by field, with bounds (a block size
of 0 would fail every request hashed for the model; a load key that is not JSON stopped discovery for
every replica): a registry entry or load report that fails is skipped, and counted (gateway.rejections),
while the rest of the registry is read as usual.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Annotated, Any

import aiohttp
import msgspec
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from gateway.fleet.replicas import Kind, LoadReport, default_replica_id
from gateway.gateway_config import ReplicaEntry
from gateway.rejections import Rejections
from policies import Role
from protocol.disaggregation import DEFAULT_ROLE, ROLE_FIELD, ROLES
from protocol.redis_keys import WORKERS, load_key, worker_key

# When a foreign backend does not say its context window.
DEFAULT_MAX_CONTEXT = 4096
# Bounds on what a replica or a registry entry may announce: far above any real one, low enough that
# arithmetic on them stays cheap and exact.
MAX_BLOCK_SIZE = 1 << 16
MAX_NUM_BLOCKS = 1 << 32
MAX_CONTEXT_LEN = 1 << 24
MAX_WAITING = 1 << 20
MAX_LOAD_COUNT = 1 << 40
MAX_NAME_CHARS = 1024
MAX_URL_CHARS = 2048
# Registry members read at most per poll; more is not a fleet but a flood.
MAX_REGISTERED = 10_000

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
BlockSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
NumBlocks = Annotated[int, msgspec.Meta(ge=1, le=MAX_NUM_BLOCKS)]
ContextLen = Annotated[int, msgspec.Meta(ge=1, le=MAX_CONTEXT_LEN)]
LoadCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOAD_COUNT)]
# Unix seconds up to the year 5138: a NaN or an infinity is no time.
UnixTime = Annotated[float, msgspec.Meta(ge=0, le=1e11)]


class _Health(msgspec.Struct):
    """What a bundled worker's /health must announce."""

    model: Name
    incarnation: Name
    block_size: BlockSize
    num_blocks: NumBlocks
    max_context_len: ContextLen
    worker_id: Name | None = None
    max_waiting: Annotated[int, msgspec.Meta(ge=0, le=MAX_WAITING)] = 256


class _Registered(msgspec.Struct):
    """A registry entry (protocol.redis_keys): every value a string, numbers in decimal."""

    id: Name
    url: Annotated[str, msgspec.Meta(pattern="^https?://[^\\s]+$", max_length=MAX_URL_CHARS)]
    model: Name
    block_size: BlockSize
    num_blocks: NumBlocks
    max_context_len: ContextLen
    incarnation: Name | None = None


class _Load(msgspec.Struct):
    """A load report, from /load or a load key."""

    running: LoadCount = 0
    waiting: LoadCount = 0
    queued_prefill_tokens: LoadCount = 0
    kv_blocks_used: LoadCount = 0
    kv_blocks_total: LoadCount = 0
    ts: UnixTime | None = None


_VALIDATION_ERRORS = (msgspec.ValidationError, msgspec.DecodeError, TypeError)


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
            raise ProbeFailed(f"{entry.url}/health announces role {announced!r:.80}, not one of {ROLES}")
        try:
            announced = msgspec.convert(health, _Health)
        except _VALIDATION_ERRORS as error:
            raise ProbeFailed(f"{entry.url}/health announces what no worker is: {error}") from None
        return Probe(
            id=entry.id or announced.worker_id or default_replica_id(entry.url),
            url=entry.url,
            kind="bundled",
            model=announced.model,
            block_size=announced.block_size,
            capacity_blocks=announced.num_blocks,
            max_context_len=announced.max_context_len,
            max_waiting=announced.max_waiting,
            incarnation=announced.incarnation,
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
        max_context_len=_context_len(listed.get("max_model_len")),
        max_waiting=256,
        incarnation=None,
        kv_events=entry.kv_events,
        kv_events_replay=entry.kv_events_replay,
        role=entry.role,
        pd_protocol=entry.pd_protocol,
        bootstrap_port=entry.bootstrap_port if sglang_prefill else None,
    )


def _context_len(announced: Any) -> int:
    """A foreign backend's max_model_len where it is one, else the default."""
    if isinstance(announced, int) and not isinstance(announced, bool) and 0 < announced <= MAX_CONTEXT_LEN:
        return announced
    return DEFAULT_MAX_CONTEXT


async def fetch_load(session: aiohttp.ClientSession, url: str, timeout_s: float) -> LoadReport:
    """A bundled worker's /load, stamped with the gateway time the question left (the report covers
    at least everything dispatched before it)."""
    asked = time.monotonic()
    body = await _get_json(session, f"{url}/load", timeout_s)
    try:
        return _report(msgspec.convert(body, _Load), asked)
    except _VALIDATION_ERRORS as error:
        raise ProbeFailed(f"{url}/load is not a load report: {error}") from None


def _report(load: _Load, at: float) -> LoadReport:
    return LoadReport(
        running=load.running,
        waiting=load.waiting,
        queued_prefill_tokens=load.queued_prefill_tokens,
        kv_blocks_used=load.kv_blocks_used,
        kv_blocks_total=load.kv_blocks_total,
        at=at,
    )


@dataclass(frozen=True, slots=True)
class Registered:
    probe: Probe
    # The worker's latest load report, if it is fresh enough to still exist.
    load: LoadReport | None


async def read_registry(redis: Redis, rejections: Rejections | None = None) -> list[Registered]:
    """Every live worker in the Redis registry with its last load report (docs/design.md §4).

    A set member whose hash expired is a worker that died without deregistering: skipped. An entry
    that fails validation is skipped and counted; a load key that fails leaves its worker without a
    report. Neither stops the others being read.
    """
    rejections = rejections or Rejections()
    try:
        members = await redis.smembers(WORKERS)
    except ResponseError as error:  # the key holds something else than a set
        rejections.reject("registry", WORKERS, error)
        return []
    ids = sorted(m for m in members if 0 < len(m) <= MAX_NAME_CHARS)
    if len(ids) < len(members):
        rejections.reject("registry", f"{len(members) - len(ids)} members of {WORKERS}", "not a worker id")
    if len(ids) > MAX_REGISTERED:
        rejections.reject("registry", f"{len(ids) - MAX_REGISTERED} members of {WORKERS}", "too many")
        ids = ids[:MAX_REGISTERED]
    if not ids:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for wid in ids:
            pipe.hgetall(worker_key(wid))
            pipe.get(load_key(wid))
        # A key of the wrong type answers an error for itself alone.
        replies = await pipe.execute(raise_on_error=False)
    wall, mono = time.time(), time.monotonic()
    found = []
    for wid, fields, raw_load in zip(ids, replies[::2], replies[1::2], strict=True):
        if not fields:
            continue  # expired: a worker that died without deregistering
        probe = _registered(wid, fields, rejections)
        if probe is None:
            continue
        load = None
        if raw_load:
            try:
                body = msgspec.json.decode(raw_load, type=_Load)
            except _VALIDATION_ERRORS as error:
                rejections.reject("load", load_key(wid), error)
            else:
                # The worker's wall clock to the gateway's monotonic one.
                ts = wall if body.ts is None else body.ts
                load = _report(body, mono - max(wall - ts, 0.0))
        found.append(Registered(probe, load))
    return found


def _registered(wid: str, fields: Any, rejections: Rejections) -> Probe | None:
    """The registry entry of worker `wid` as a replica, or None (counted) when it is not one."""
    if not isinstance(fields, dict):
        rejections.reject("registry", worker_key(wid), fields)
        return None
    role = announced_role(fields)
    if role is None:
        rejections.reject(
            "registry", worker_key(wid), f"role {fields.get(ROLE_FIELD)!r:.80} is not one of {ROLES}"
        )
        return None
    try:
        entry = msgspec.convert(fields, _Registered, strict=False)
    except _VALIDATION_ERRORS as error:
        rejections.reject("registry", worker_key(wid), error)
        return None
    if entry.id != wid:
        rejections.reject("registry", worker_key(wid), f"it names another worker, {entry.id!r:.80}")
        return None
    return Probe(
        id=entry.id,
        url=entry.url.rstrip("/"),
        kind="bundled",
        model=entry.model,
        block_size=entry.block_size,
        capacity_blocks=entry.num_blocks,
        max_context_len=entry.max_context_len,
        max_waiting=256,
        incarnation=entry.incarnation,
        role=role,
    )
