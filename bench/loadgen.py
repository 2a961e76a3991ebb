"""The replay's load generator: sessions started open loop at their times, turns within one closed
loop, each a streamed completion timed to its first token and its end over one pooled HTTP client;
and a closed loop of clients for the throughput a server sustains. Failures are counted by kind,
never raised, so that a run under overload still reports."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import aiohttp
import orjson
from tqdm import tqdm

from bench.arrivals import Arrival, Prompt, arrival_sessions
from bench.replay_result import ReplayResult, RequestRecord
from bench.token_text import text_of
from bench.workloads import Session, Turn, total_turns
from gateway.forward.relay_headers import PREDICTED_CACHED_HEADER, PREDICTED_TTFT_HEADER
from gateway.forward.upstream import UpstreamError, header_count
from gateway.forward.upstream_client import UpstreamClient

# The gateway names the replica that served a request here; a worker talked to directly does not
# (our workers name themselves in WORKER_HEADER, read instead behind a router that names nothing).
REPLICA_HEADER = "x-prefixgate-replica"
DIRECT = "direct"
# How much longer than one request's timeout a request may take from when it was due (waiting for a
# slot included): enough that a request sent late meets its own timeout (counted as such) first.
DRAIN_GRACE_S = 1.0

log = logging.getLogger(__name__)


# The load's failure kinds for the HTTP client's.
_UPSTREAM_KINDS = {"connect_failed": "connect", "disconnected": "disconnect", "bad_response": "disconnect"}


class _Failed(Exception):
    """A request that failed in a way the HTTP client does not name: `kind` is how it is counted."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


async def discover_model(session: aiohttp.ClientSession, url: str) -> str | None:
    """The first model `GET /v1/models` lists, or None when the endpoint cannot say."""
    try:
        async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as response:
            if response.status == 200:
                models = (await response.json()).get("data") or []
                if models:
                    return str(models[0]["id"])
            log.warning("GET %s/v1/models answered %s with no model", url, response.status)
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as error:
        log.warning("GET %s/v1/models failed: %s", url, error or type(error).__name__)
    return None


async def _stream_one(
    client: UpstreamClient,
    url: str,
    request: tuple[bytes, int],
    headers: dict[str, str],
    timeout_s: float,
    replica_header: str = REPLICA_HEADER,
) -> RequestRecord:
    """One streamed completion (its body, and its prompt's length), timed from when it is sent to its
    [DONE], its replica read from `replica_header`; raises _Failed with the kind of failure. The
    stream is then read to its end, so that its connection serves the next request instead of a new
    one being opened for each; a failure past [DONE] costs the connection, not the answer."""
    body, prompt_len = request
    start = time.perf_counter()
    chunk_times: list[float] = []
    usage: dict[str, Any] = {}
    end: float | None = None
    async with asyncio.timeout(timeout_s):
        response = await client.request(
            "POST", url, "/v1/completions", body, headers, connect_s=timeout_s, read_s=timeout_s
        )
        try:
            if response.status != 200:
                raise _Failed(f"http_{response.status}")
            replica = response.headers.get(replica_header, DIRECT)
            predicted = header_count(response.headers.get(PREDICTED_TTFT_HEADER))
            predicted_cached = header_count(response.headers.get(PREDICTED_CACHED_HEADER))
            pending = b""
            while end is None and (chunk := await response.read_chunk()):
                now = time.perf_counter()
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        end = now
                        break
                    event = orjson.loads(data)
                    if "error" in event:
                        raise _Failed("stream_error")
                    choices = event.get("choices")
                    if choices and choices[0].get("text"):
                        chunk_times.append(now)
                    if event.get("usage"):
                        usage = event["usage"]
            if end is not None:
                with contextlib.suppress(UpstreamError, TimeoutError):
                    await response.read()
        finally:
            response.release()
    if not chunk_times:
        raise _Failed("no_output")
    details = usage.get("prompt_tokens_details") or {}
    return RequestRecord(
        ttft_s=chunk_times[0] - start,
        itl_s=tuple(b - a for a, b in itertools.pairwise(chunk_times)),
        e2e_s=(end if end is not None else time.perf_counter()) - start,
        prompt_tokens=int(usage.get("prompt_tokens", prompt_len)),
        cached_tokens=int(details.get("cached_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens", len(chunk_times))),
        replica=replica,
        predicted_ttft_s=predicted / 1000 if predicted is not None else None,
        predicted_cached_tokens=predicted_cached,
    )


def completion_body(
    token_ids: Sequence[int], max_tokens: int, model: str | None, user: str = "", text: bool = False
) -> tuple[bytes, int]:
    """A streamed completion of exactly `max_tokens` tokens; `user` names the session, for routers
    with session affinity (an empty one is left out). `text`: the prompt as words (bench.token_text), for
    servers and routers that tokenize it themselves."""
    body: dict[str, Any] = {
        "prompt": text_of(token_ids) if text else list(token_ids),
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "ignore_eos": True,
    }
    if model is not None:
        body["model"] = model
    if user:
        body["user"] = user
    return orjson.dumps(body), len(token_ids)


def _headers(api_key: str) -> dict[str, str]:
    """Every request's headers: the key, and a JSON body."""
    return {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}


def failure_kind(error: BaseException) -> str:
    """The kind a failed request is counted under in `errors`."""
    if isinstance(error, _Failed):
        return error.kind
    if isinstance(error, TimeoutError):
        return "timeout"
    if isinstance(error, UpstreamError):
        return _UPSTREAM_KINDS.get(error.kind, "client_error")
    return "bad_stream"  # ValueError: a data line that is not JSON


async def replay(url: str, arrivals: Sequence[Arrival], **options: Any) -> ReplayResult:
    """Send every arrival at its time (open loop) and measure each streamed answer; `options` are
    replay_sessions'."""
    return await replay_sessions(url, arrival_sessions(arrivals), **options)


async def replay_sessions(
    url: str,
    sessions: Sequence[Session],
    *,
    model: str | None = None,
    api_key: str = "none",
    concurrency_limit: int = 512,
    timeout_s: float = 120.0,
    progress: bool = True,
    label: str | None = None,
    position: int = 0,
    text: bool = False,
    replica_header: str = REPLICA_HEADER,
) -> ReplayResult:
    """Start every session at its time (open loop across sessions), send each later turn its think
    time after the previous answer ended (closed loop within one), and measure each streamed answer.

    `model` None asks `GET /v1/models`; when that fails the requests name no model, which servers of
    one model accept and others answer with an error that is counted. At most `concurrency_limit`
    requests are in flight; later ones wait for a slot and are timed from when they leave. Each
    request gets `timeout_s` once it leaves; one not done about as long after it was due (waiting for
    a slot included) counts as "unfinished", and its session goes on. Failures are counted by kind in
    `errors`, never raised; a failed turn is followed by the session's next one all the same. `text`
    sends each prompt as words (bench.token_text) instead of token ids. Each answer's replica is read from
    `replica_header` (the gateway's; behind a router that names none, WORKER_HEADER, the worker's own).
    """
    url = url.rstrip("/")
    headers = _headers(api_key)
    if model is None:
        async with aiohttp.ClientSession(headers=headers) as session:
            model = await discover_model(session, url)
    client = UpstreamClient()
    try:
        slots = asyncio.Semaphore(concurrency_limit)
        records: list[RequestRecord] = []
        errors: Counter[str] = Counter()
        loop = asyncio.get_running_loop()
        start = loop.time()
        last_end = start
        sent = 0
        bar = tqdm(
            total=total_turns(sessions),
            desc=label or f"replay {url}",
            unit="req",
            disable=not progress,
            position=position,
        )

        async def one(session: int, k: int, turn: Turn, user: str) -> None:
            nonlocal last_end, sent
            sent += 1
            deadline = asyncio.timeout(timeout_s + DRAIN_GRACE_S)
            try:
                async with deadline, slots:
                    body = completion_body(turn.prompt, turn.max_tokens, model, user, text)
                    record = await _stream_one(client, url, body, headers, timeout_s, replica_header)
                    records.append(dataclasses.replace(record, session=session, turn=k))
            except (_Failed, UpstreamError, TimeoutError, ValueError) as error:
                errors["unfinished" if deadline.expired() else failure_kind(error)] += 1
            last_end = max(last_end, loop.time())
            bar.update()
            if errors:
                bar.set_postfix(errors=errors.total(), refresh=False)

        async def run(i: int, session: Session) -> None:
            await asyncio.sleep(max(start + session.start_s - loop.time(), 0.0))
            for k, turn in enumerate(session.turns):
                if k:
                    await asyncio.sleep(turn.think_s)
                await one(i, k, turn, session.key)

        await asyncio.gather(*(run(i, s) for i, s in enumerate(sessions)))
        bar.close()
    finally:
        client.close()
    return ReplayResult(url, sent, last_end - start, records, errors)


async def closed_loop(
    url: str,
    prompts: Sequence[Prompt],
    *,
    concurrency: int,
    duration_s: float,
    model: str | None = None,
    api_key: str = "none",
    timeout_s: float = 30.0,
) -> ReplayResult:
    """`concurrency` clients, each sending its next prompt (round the list) as soon as its previous
    answer ends, until `duration_s` has passed: the throughput a server sustains, which an open loop
    can only bracket. Latency under it is queueing by construction; `replay` is the one for latency."""
    if concurrency < 1 or duration_s <= 0 or not prompts:
        raise ValueError("closed_loop needs concurrency >= 1, duration_s > 0 and at least one prompt")
    url = url.rstrip("/")
    headers = _headers(api_key)
    records: list[RequestRecord] = []
    errors: Counter[str] = Counter()
    bodies = itertools.cycle([completion_body(p.token_ids, p.max_tokens, model) for p in prompts])
    sent = 0
    client = UpstreamClient()
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        end = start + duration_s

        async def one_client() -> None:
            nonlocal sent
            while loop.time() < end:
                sent += 1
                try:
                    records.append(await _stream_one(client, url, next(bodies), headers, timeout_s))
                except (_Failed, UpstreamError, TimeoutError, ValueError) as error:
                    errors[failure_kind(error)] += 1

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        elapsed = loop.time() - start
    finally:
        client.close()
    return ReplayResult(url, sent, elapsed, records, errors)
