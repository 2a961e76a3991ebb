"""`prefixgate bench replay`: load against any OpenAI-compatible endpoint (the gateway, one of our
workers, vLLM, SGLang), with TTFT, inter-token latency, cache hit rate and the replica spread.

Open loop across sessions: each session starts at its scheduled time whether or not earlier ones
have finished. A closed loop over all users slows down with the server and so hides the queueing
that latency under load is about. Within a session (bench.workloads: an agent's turns) the loop is
closed, as an agent's is: a turn leaves its think time after the previous answer ended. A trace or
a shared-prefix load is sessions of one request. Prompts are token ids, which both the gateway and
the simulated workers accept, so no tokenizer runs on either side of the measurement; with `--text`
they are sent as words (bench.words), for servers and routers that tokenize what they are sent.

With `--sim-fleet N` it brings its own servers: per row, N fresh simulated workers (empty caches)
and a gateway with the row's policy, each its own process (bench.local_fleet), and one workload
replayed through each gateway, `--parallel` rows at a time (a simulated fleet needs little CPU, and
rows run together share the machine's noise). The policies that read the index get a row per mode: the
workers declared as bundled (precise: the gateway follows their KV events) or as foreign OpenAI
servers (approximate: the gateway predicts their caches from its own routing) with the capacity the
gateway is told set to a multiple of their true pool, or left for it to learn.

`--sim-unit` makes the workers count in another unit than the gateway, as a foreign backend does:
`words` (they read the text as one token per word, `prefixgate worker --sim-tokenizer words`, while
the gateway reads it with SmolLM2's tokenizer, about 2.8 tokens a word) or `blocks64` (the gateway's
tokens, cached in blocks of 64). Such workers are declared foreign (`kind: openai`) in every row, since
the gateway can follow no events in another unit. `--peers` adds rows where a peer router
(bench.peers: sglang-router, vllm-router) stands in for the gateway over fresh workers of the same
kind. Each row's hit rate is what its workers report (usage.prompt_tokens_details.cached_tokens in
their own unit), and its moved turns the share of sessions' turns served by another replica than the
turn before: the gateway names its replica in a header, a peer router names none, so there the
workers' own header is read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import yaml
from tqdm import tqdm

from bench.fleet import INDEX_POLICIES, WORKLOADS, generated_sessions, prefix_aware_knob
from bench.local_fleet import (
    LocalFleet,
    SimWorkers,
    cli,
    free_port,
    gateway_config,
    spawn,
    stop,
    wait_ready,
    worker_command,
)
from bench.peers import PEER_ROWS, peer_router
from bench.report import bar_panels, format_table, write_json
from bench.trace import TraceRequest, load_trace, prompt_tokens
from bench.words import text_of
from bench.workloads import (
    AGENT_WORKLOADS,
    TOKEN_HIGH,
    TOKEN_LOW,
    AgentParams,
    GroupedParams,
    Session,
    Turn,
    total_turns,
)
from gateway.forward.relay_headers import PREDICTED_TTFT_HEADER
from gateway.forward.upstream import UpstreamClient, UpstreamError, header_count
from policies import POLICY_NAMES
from workers.server import WORKER_HEADER
from workers.sim.profiles import get_profile

# The gateway names the replica that served a request here; a worker talked to directly does not
# (our workers name themselves in WORKER_HEADER, read instead behind a router that names nothing).
REPLICA_HEADER = "x-prefixgate-replica"
DIRECT = "direct"
PERCENTILES = (50, 90, 99)
# How much longer than one request's timeout a request may take from when it was due (waiting for a
# slot included): enough that a request sent late meets its own timeout (counted as such) first.
DRAIN_GRACE_S = 1.0
# Fleet mode (--sim-fleet) defaults: the policies compared, and workers whose cache holds only a
# fraction of the workload's system prompts, the regime in which the replica chosen decides the hit:
# 768 blocks of 16 tokens are 12k tokens, six of the sixteen 2k-token system prompts. At 40 req/s,
# at round robin's hit rate, each replica's modelled prefill is about half busy, so hits show in
# TTFT. Twelve rows (the index policies in five modes each) of 20 s, about 800 requests a row, four
# at a time, take about two minutes on two cores with their start-ups; the agent workload about four.
FLEET_POLICIES = ("prefix_aware", "cache_threshold", "least_load", "round_robin")
FLEET_PROFILE = "h100-8b"
FLEET_BLOCK_SIZE = 16
FLEET_NUM_BLOCKS = 768
FLEET_WORKLOAD = (16, 32, 2048, 128, 32)
FLEET_RATE = 40.0
FLEET_DURATION_S = 20.0
FLEET_PARALLEL = 4
# --sim-unit: the workers' own unit, and the KV block of `blocks64`.
SIM_UNITS = ("words", "blocks64")
BLOCKS64 = 64

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float  # seconds after the replay starts
    prompt: Prompt


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request that streamed to its end."""

    ttft_s: float
    itl_s: tuple[float, ...]
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    replica: str
    # Which session's which turn it was (None: a request of no session, as closed_loop's).
    session: int | None = None
    turn: int = 0
    # The gateway's predicted wait for its first token there (None: not a prefixgate gateway's answer).
    predicted_ttft_s: float | None = None


@dataclass(slots=True)
class ReplayResult:
    url: str
    sent: int
    # From the first scheduled send to the last completion: the span throughput is measured over.
    elapsed_s: float
    records: list[RequestRecord] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def completed(self) -> int:
        return len(self.records)

    def summary(self) -> dict[str, Any]:
        records = self.records
        prompt = sum(r.prompt_tokens for r in records)
        span = max(self.elapsed_s, 1e-9)
        return {
            "url": self.url,
            "sent": self.sent,
            "completed": self.completed,
            "errors": dict(sorted(self.errors.items())),
            "ttft_s": latency_stats([r.ttft_s for r in records]),
            "itl_s": latency_stats([x for r in records for x in r.itl_s]),
            "e2e_s": latency_stats([r.e2e_s for r in records]),
            "hit_rate": sum(r.cached_tokens for r in records) / prompt if prompt else 0.0,
            "requests_per_replica": dict(sorted(Counter(r.replica for r in records).items())),
            "moved_turns": moved_turns(records),
            "ttft_predicted": ttft_predicted(records),
            "throughput_req_s": self.completed / span,
            "output_tok_s": sum(r.output_tokens for r in records) / span,
            "elapsed_s": self.elapsed_s,
        }


def moved_turns(records: Sequence[RequestRecord]) -> float | None:
    """Of the sessions' turns whose previous turn was answered too, the share served by another
    replica than that turn: a history recomputed there, and held twice. None when no session had two
    answered turns in a row (sessions of one turn: nothing can move)."""
    served = {(r.session, r.turn): r.replica for r in records if r.session is not None}
    pairs = [(replica, served[s, k - 1]) for (s, k), replica in served.items() if (s, k - 1) in served]
    return sum(now != before for now, before in pairs) / len(pairs) if pairs else None


def ttft_predicted(records: Sequence[RequestRecord]) -> float | None:
    """The routing model checked against measurement: the mean TTFT the gateway predicted for its
    answers over the mean TTFT the client saw (1: the model holds; below: the fleet is slower than it
    believes; None: no prediction, as from a peer router)."""
    pairs = [(r.predicted_ttft_s, r.ttft_s) for r in records if r.predicted_ttft_s is not None]
    observed = sum(seen for _, seen in pairs)
    return sum(p for p, _ in pairs) / observed if pairs and observed > 0 else None


def latency_stats(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and tail percentiles; None when nothing was measured (a zero would read as instant)."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    array = np.asarray(values)
    points = np.percentile(array, PERCENTILES)
    return {
        "mean": float(array.mean()),
        **{f"p{p}": float(v) for p, v in zip(PERCENTILES, points, strict=True)},
    }


# -- workloads ---------------------------------------------------------------------------------------


def shared_prefix_workload(
    groups: int, prompts: int, system_len: int, question_len: int, output_len: int, seed: int = 0
) -> list[Prompt]:
    """`groups` x `prompts` distinct prompts, group by group: each group's system prompt followed by
    one of its questions. A group's tokens depend only on (seed, group), so adding groups keeps the
    existing ones and two runs with one seed send byte-identical prompts."""
    if min(groups, prompts, output_len) < 1 or min(system_len, question_len) < 0:
        raise ValueError("groups, prompts and output_len must be >= 1, system_len and question_len >= 0")
    if system_len + question_len < 1:
        raise ValueError("a prompt needs at least one token: system_len + question_len must be >= 1")
    workload = []
    for group in range(groups):
        rng = np.random.default_rng([seed, group])
        system = rng.integers(TOKEN_LOW, TOKEN_HIGH, system_len).tolist()
        for _ in range(prompts):
            question = rng.integers(TOKEN_LOW, TOKEN_HIGH, question_len).tolist()
            workload.append(Prompt(tuple(system + question), output_len))
    return workload


def poisson_times(rate: float, duration_s: float, rng: np.random.Generator) -> list[float]:
    """Send times of a Poisson process at `rate` per second, within [0, duration_s)."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    times = []
    t = rng.exponential(1 / rate)
    while t < duration_s:
        times.append(float(t))
        t += rng.exponential(1 / rate)
    return times


def shared_prefix_arrivals(
    prompts: Sequence[Prompt], rate: float, duration_s: float, seed: int = 0
) -> list[Arrival]:
    """Poisson arrivals, each asking a (group, question) pair drawn uniformly at random."""
    rng = np.random.default_rng(seed)
    times = poisson_times(rate, duration_s, rng)
    picks = rng.integers(len(prompts), size=len(times))
    return [Arrival(t, prompts[i]) for t, i in zip(times, picks, strict=True)]


def trace_prompt(request: TraceRequest, vocab_size: int, max_prompt_tokens: int) -> Prompt:
    """The request's expanded tokens, cut so that a small (CPU, simulated) worker can hold them."""
    return Prompt(
        tuple(prompt_tokens(request, vocab_size)[:max_prompt_tokens]), max(request.output_length, 1)
    )


def trace_arrivals(
    trace: Sequence[TraceRequest],
    duration_s: float,
    *,
    rate: float | None = None,
    seed: int = 0,
    vocab_size: int = 32000,
    max_prompt_tokens: int = 4000,
) -> list[Arrival]:
    """The trace's requests in order, at their own times relative to the first (load_trace has applied
    the speed) or, given a rate, at Poisson times; only those due within `duration_s` are expanded."""
    if not trace:
        return []
    if rate is None:
        times = [r.arrival_s - trace[0].arrival_s for r in trace]
    else:
        times = poisson_times(rate, duration_s, np.random.default_rng(seed))
    return [
        Arrival(t, trace_prompt(r, vocab_size, max_prompt_tokens))
        for t, r in zip(times, trace, strict=False)
        if t < duration_s
    ]


# -- the load generator ------------------------------------------------------------------------------


# The load's failure kinds for the HTTP client's.
_UPSTREAM_KINDS = {"connect_failed": "connect", "disconnected": "disconnect", "bad_response": "disconnect"}


class _Failed(Exception):
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
    )


def _body(
    token_ids: Sequence[int], max_tokens: int, model: str | None, user: str = "", text: bool = False
) -> tuple[bytes, int]:
    """A streamed completion of exactly `max_tokens` tokens; `user` names the session, for routers
    with session affinity (an empty one is left out). `text`: the prompt as words (bench.words), for
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
    return {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}


def _failure_kind(error: BaseException) -> str:
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
    sends each prompt as words (bench.words) instead of token ids. Each answer's replica is read from
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
                    body = _body(turn.prompt, turn.max_tokens, model, user, text)
                    record = await _stream_one(client, url, body, headers, timeout_s, replica_header)
                    records.append(dataclasses.replace(record, session=session, turn=k))
            except (_Failed, UpstreamError, TimeoutError, ValueError) as error:
                errors["unfinished" if deadline.expired() else _failure_kind(error)] += 1
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
    bodies = itertools.cycle([_body(p.token_ids, p.max_tokens, model) for p in prompts])
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
                    errors[_failure_kind(error)] += 1

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        elapsed = loop.time() - start
    finally:
        client.close()
    return ReplayResult(url, sent, elapsed, records, errors)


# -- fleet mode: how the gateway is told about the workers ------------------------------------------


@dataclass(frozen=True, slots=True)
class Mode:
    """How the gateway knows the simulated workers' caches. Precise: declared bundled, it follows
    their KV events. Approximate: declared foreign (`kind: openai`), it predicts their caches from its
    own routing, told a capacity of `capacity_factor` times their true pool (None: told none, so the
    gateway's own default, or what it learns, applies)."""

    precise: bool
    capacity_factor: float | None = None

    @property
    def name(self) -> str:
        if self.precise:
            return "precise"
        return (
            "approx cap absent" if self.capacity_factor is None else f"approx cap x{self.capacity_factor:g}"
        )

    def capacity_blocks(self, num_blocks: int) -> int | None:
        """The capacity the gateway is told for workers of `num_blocks` blocks (None: none)."""
        if self.precise or self.capacity_factor is None:
            return None
        return max(1, round(self.capacity_factor * num_blocks))


PRECISE = Mode(precise=True)
APPROX = Mode(precise=False)
FLEET_MODES = (Mode(False, 0.25), Mode(False, 1.0), Mode(False, 16.0), APPROX, PRECISE)


@dataclass(frozen=True, slots=True)
class Row:
    """One row of the comparison: a policy, and how its gateway is told about the workers."""

    policy: str
    mode: Mode

    @property
    def name(self) -> str:
        return f"{self.policy} {self.mode.name}" if self.policy in INDEX_POLICIES else self.policy


@dataclass(frozen=True, slots=True)
class PeerRow:
    """A row with a peer router (bench.peers.PEER_ROWS) in place of the gateway."""

    router: str

    @property
    def name(self) -> str:
        return self.router


def fleet_rows(policies: Sequence[str], modes: Sequence[Mode], plain: Mode = PRECISE) -> list[Row]:
    """A row per mode for the policies that read the index, one for the others in the `plain` mode
    (precise: bundled workers, whose load reports they read; APPROX where the workers count in
    another unit and must be declared foreign). Rows of one mode come together, so that the index
    policies run side by side (--parallel) under the same conditions and read next to each other."""
    index = [p for p in policies if p in INDEX_POLICIES]
    return [Row(p, m) for m in modes for p in index] + [
        Row(p, plain) for p in policies if p not in INDEX_POLICIES
    ]


def row_gateway_config(
    model: str,
    worker_urls: Sequence[str],
    policy: str,
    mode: Mode,
    pool: tuple[int, int],
    port: int,
    text: bool = False,
    prefix_aware: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """local_fleet's gateway config, with the workers declared as the mode says; `pool` is their
    (block size, blocks) as the gateway is told them, in its own tokens. Ids are the workers' own (w0,
    w1, ...) either way, so rows compare. `text`: the prompts come as text, which the gateway reads
    with the default tokenizer (SmolLM2's) whatever the model, as a gateway before a backend with a
    tokenizer of its own would. `prefix_aware`: knobs of that policy's config (--prefix-aware)."""
    config = gateway_config(model, worker_urls, policy, port)
    if prefix_aware:
        config["routing"]["prefix_aware"] = dict(prefix_aware)
    if text:
        config["models"] = {model: {"tokenizer": "default"}}
    if mode.precise:
        config["replicas"] = [{"url": url, "kind": "bundled"} for url in worker_urls]
        return config
    block_size, num_blocks = pool
    capacity = mode.capacity_blocks(num_blocks)
    told = {} if capacity is None else {"capacity_blocks": capacity}
    config["replicas"] = [
        {"url": url, "id": f"w{i}", "kind": "openai", "model": model, "block_size": block_size, **told}
        for i, url in enumerate(worker_urls)
    ]
    return config


@dataclass(frozen=True, slots=True)
class FleetWorkers:
    """The simulated workers of every row: how many, with which profile and pool, and the flags that
    make them count in their own unit (none: the gateway's)."""

    spec: SimWorkers
    flags: tuple[str, ...] = ()

    @property
    def block_size(self) -> int:
        return self.spec.block_size or get_profile(self.spec.profile).block_size


def fleet_workers(count: int, profile: str, pool: tuple[int, int], unit: str | None) -> FleetWorkers:
    """`count` workers of `profile` with `pool` (block size, blocks), counting in `unit` (SIM_UNITS;
    None: the gateway's tokens). blocks64 keeps the pool's tokens, in blocks of 64."""
    block_size, num_blocks = pool
    if unit is None:
        return FleetWorkers(SimWorkers(count, profile, block_size, num_blocks))
    if unit == "words":
        return FleetWorkers(SimWorkers(count, profile, block_size, num_blocks), ("--sim-tokenizer", "words"))
    if unit == "blocks64":
        return FleetWorkers(SimWorkers(count, profile, BLOCKS64, max(1, num_blocks * block_size // BLOCKS64)))
    raise ValueError(f"unit must be one of {SIM_UNITS}, got {unit!r}")


@contextlib.contextmanager
def row_workers(
    workdir: Path, workers: FleetWorkers, kv_events: bool = False
) -> Iterator[tuple[LocalFleet, list[str]]]:
    """Fresh workers (empty caches), all ready, and (with `kv_events`) the endpoints where each
    publishes its KV events in vLLM's wire format, for a router that follows them. Stopped on the
    way out, with whatever else was added to the fleet."""
    workdir.mkdir(parents=True, exist_ok=True)
    fleet, endpoints = LocalFleet([], None), []
    try:
        for i in range(workers.spec.count):
            port = free_port()
            command = [*worker_command(workers.spec, f"w{i}", port), *workers.flags]
            if kv_events:
                endpoints.append(f"tcp://127.0.0.1:{free_port()}")
                command += [
                    "--kv-events-zmq",
                    endpoints[-1],
                    "--kv-events-replay",
                    f"tcp://127.0.0.1:{free_port()}",
                ]
            fleet.workers.append(spawn(f"worker-w{i}", command, f"http://127.0.0.1:{port}", workdir))
        wait_ready(fleet)
        yield fleet, endpoints
    finally:
        stop(fleet.children)


@contextlib.contextmanager
def row_fleet(
    workdir: Path,
    workers: FleetWorkers,
    policy: str,
    mode: Mode,
    pool: tuple[int, int],
    text: bool = False,
    prefix_aware: Mapping[str, float] | None = None,
) -> Iterator[str]:
    """Fresh workers (empty caches) and a gateway over them with the row's policy and mode, all ready;
    yields the gateway's URL and stops everything on the way out."""
    with row_workers(workdir, workers) as (fleet, _):
        port = free_port()
        config = workdir / "gateway.yaml"
        urls = [w.url for w in fleet.workers]
        model = workers.spec.model
        gateway = row_gateway_config(model, urls, policy, mode, pool, port, text, prefix_aware)
        config.write_text(yaml.safe_dump(gateway))
        command = cli("serve", "--config", str(config), "--log-level", "WARNING")
        fleet.gateway = spawn("gateway", command, f"http://127.0.0.1:{port}", workdir)
        try:
            wait_ready(fleet)
            yield fleet.gateway.url
        finally:
            stop([fleet.gateway])


@contextlib.contextmanager
def peer_fleet(workdir: Path, workers: FleetWorkers, router: str) -> Iterator[str]:
    """Fresh workers and the peer router over them, all ready; yields the router's URL. Workers
    publish KV events for the router that follows them (kv_aware)."""
    kv_aware = router.endswith("kv_aware")
    with row_workers(workdir, workers, kv_events=kv_aware) as (fleet, endpoints):
        urls = [w.url for w in fleet.workers]
        events = endpoints if kv_aware else None
        model = workers.spec.model
        with peer_router(
            router, urls, workdir, kv_events=events, block_size=workers.block_size, model=model
        ) as url:
            yield url


# -- command line ------------------------------------------------------------------------------------


def _shape(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 5:
        raise argparse.ArgumentTypeError(
            f"expected groups,prompts,system_len,question_len,output_len (five integers), got {text!r}"
        )
    return values


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in POLICY_NAMES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(POLICY_NAMES)}; got {text!r}"
        )
    return names


def _mode(item: str) -> Mode:
    kind, _, factor = item.partition(":")
    if kind == "precise" and not factor:
        return PRECISE
    if kind == "approx":
        capacity_factor = float(factor) if factor else None
        if capacity_factor is None or capacity_factor > 0:
            return Mode(False, capacity_factor)
    raise ValueError(item)


def _peers(text: str) -> tuple[str, ...]:
    """Peer rows, comma-separated: a row's full name (bench.peers.PEER_ROWS) or a router's, for all of
    its rows (sglang, vllm-router)."""
    rows: list[str] = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        named = [r for r in PEER_ROWS if r == item or r.startswith(f"{item} ")]
        if not named:
            raise argparse.ArgumentTypeError(
                f"expected rows of {', '.join(PEER_ROWS)} or a router's name; got {item!r}"
            )
        rows += [r for r in named if r not in rows]
    return tuple(rows)


def _modes(text: str) -> tuple[Mode, ...]:
    """precise, approx (no capacity told) and approx:F (F > 0 times the true pool), comma-separated."""
    try:
        modes = tuple(_mode(item.strip()) for item in text.split(",") if item.strip())
    except ValueError:
        modes = ()
    if not modes:
        raise argparse.ArgumentTypeError(
            f"expected precise, approx or approx:FACTOR (FACTOR > 0), comma-separated; got {text!r}"
        )
    return modes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", default=None, help="base URL of an OpenAI-compatible server")
    target.add_argument(
        "--sim-fleet",
        type=int,
        default=None,
        metavar="N",
        help="start N simulated workers and, per row (policy and mode), a gateway over them",
    )
    workload = parser.add_mutually_exclusive_group()
    workload.add_argument("--trace", default=None, help="Mooncake-format JSONL trace")
    workload.add_argument(
        "--shared-prefix",
        type=_shape,
        default=None,
        metavar="G,P,S,Q,O",
        help="G groups of P questions: S system tokens, Q question tokens, O output tokens "
        f"(--sim-fleet default: {','.join(map(str, FLEET_WORKLOAD))})",
    )
    workload.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=None,
        help="generated (bench.workloads): multi-tenant agent sessions (agent; agent-zipf: Zipf tenants; "
        "agent-tools: long tool results; agent-think: long think times), grouped shared prefixes, or long "
        "prompts with long answers (longmix)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="requests/s, Poisson (with --trace: instead of its times; "
        f"--sim-fleet default: {FLEET_RATE:g}; grouped default: {GroupedParams().rate:g})",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help=f"seconds of sending (--sim-fleet default: {FLEET_DURATION_S:g}); agent workloads: the "
        "window sessions start in, each then running to its end (default: the workload's, agent "
        f"{AgentParams().start_window_s:g}); grouped: all prompts when absent",
    )
    parser.add_argument(
        "--sessions",
        type=int,
        default=None,
        help=f"agent workloads' sessions (the workload's: agent {AgentParams().sessions})",
    )
    parser.add_argument("--json", default=None, help="write the summary here, and a PNG next to it")
    parser.add_argument(
        "--text",
        action="store_true",
        help="send prompts as text, one made-up word per token id (bench.words), for servers that "
        "tokenize; --sim-fleet: with --sim-unit words, and a gateway tokenizing with SmolLM2's tokenizer",
    )
    parser.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    parser.add_argument("--api-key", default=None, help="default: $PREFIXGATE_API_KEY or 'none'")
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="time compression of a trace or generated workload (2 = twice as fast)",
    )
    parser.add_argument("--limit", type=int, default=None, help="send at most N requests (sessions)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency-limit", type=int, default=512, help="most requests in flight")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request, and to drain")
    parser.add_argument("--vocab-size", type=int, default=32000, help="trace token ids are drawn below this")
    parser.add_argument("--max-prompt-tokens", type=int, default=4000, help="cut trace prompts to this")
    fleet = parser.add_argument_group("--sim-fleet: simulated workers started for the run")
    fleet.add_argument(
        "--policies", type=_policies, default=FLEET_POLICIES, help="comma-separated, one gateway each"
    )
    fleet.add_argument(
        "--modes",
        type=_modes,
        default=None,
        help="for the policies that read the index, a row each: precise, approx (no capacity told), "
        "approx:F (F x the workers' pool); default: approx:0.25,approx:1,approx:16,approx,precise "
        "(with --sim-unit, all but precise)",
    )
    fleet.add_argument(
        "--sim-unit",
        choices=SIM_UNITS,
        default=None,
        help="workers counting in their own unit, declared to the gateway as foreign (kind: openai) in "
        "every row: words (one token per word of the --text prompts, which the gateway reads with "
        f"SmolLM2's tokenizer) or blocks64 (the gateway's tokens, in KV blocks of {BLOCKS64})",
    )
    fleet.add_argument(
        "--peers",
        type=_peers,
        default=(),
        help="peer routers, a row each over fresh workers (bench.peers, installed from PyPI on first use): "
        f"{', '.join(PEER_ROWS)}, or a router's name for all its rows (sglang, vllm-router); "
        "comma-separated; sglang reads text prompts only (--text --sim-unit words)",
    )
    fleet.add_argument(
        "--parallel",
        type=int,
        default=FLEET_PARALLEL,
        help="rows run at once, each on its own workers and gateway (the CPU they need is small)",
    )
    fleet.add_argument("--sim-profile", default=FLEET_PROFILE, help="the workers' profile")
    fleet.add_argument(
        "--prefix-aware",
        type=prefix_aware_knob,
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a prefix_aware knob for every gateway row (e.g. recompute_penalty=2), repeatable",
    )
    fleet.add_argument("--block-size", type=int, default=FLEET_BLOCK_SIZE, help="the workers' KV block size")
    fleet.add_argument(
        "--num-blocks",
        type=int,
        default=FLEET_NUM_BLOCKS,
        help="KV blocks per worker (the cache that matters)",
    )


def arrival_sessions(arrivals: Sequence[Arrival]) -> list[Session]:
    """Open-loop arrivals as sessions of one turn each."""
    return [Session(a.at_s, (Turn(a.prompt.token_ids, a.prompt.max_tokens),)) for a in arrivals]


def _sessions(args: argparse.Namespace) -> tuple[str, list[Session], dict[str, Any]]:
    """The workload's name, its sessions and its parameters, a pure function of the flags and seed."""
    if args.shared_prefix is not None:
        if args.rate is None:
            raise SystemExit("prefixgate bench replay: --shared-prefix needs --rate")
        prompts = shared_prefix_workload(*args.shared_prefix, seed=args.seed)
        arrivals = shared_prefix_arrivals(prompts, args.rate, args.duration, args.seed)
        name = "shared-prefix " + ",".join(map(str, args.shared_prefix))
        return name, arrival_sessions(arrivals[: args.limit]), {}
    if args.workload is not None:
        sessions, params = generated_sessions(args)
        return args.workload, sessions, params
    trace = load_trace(args.trace, speed=args.speed, limit=args.limit)
    arrivals = trace_arrivals(
        trace,
        args.duration,
        rate=args.rate,
        seed=args.seed,
        vocab_size=args.vocab_size,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    return f"trace {Path(args.trace).name}", arrival_sessions(arrivals[: args.limit]), {}


def fill_fleet_defaults(args: argparse.Namespace) -> None:
    """--sim-fleet alone runs the comparison the defaults were chosen for; a URL needs its workload."""
    chosen = args.trace is not None or args.shared_prefix is not None or args.workload is not None
    if args.sim_fleet is not None and not chosen:
        args.shared_prefix = FLEET_WORKLOAD
        args.rate = FLEET_RATE if args.rate is None else args.rate
    if args.sim_fleet is not None and args.duration is None and args.workload is None:
        args.duration = FLEET_DURATION_S
    if args.modes is None:
        args.modes = FLEET_MODES if args.sim_unit is None else tuple(m for m in FLEET_MODES if not m.precise)
    if not (chosen or args.shared_prefix is not None):
        raise SystemExit("prefixgate bench replay: give a workload, --trace, --shared-prefix or --workload")
    if args.duration is None and args.workload is None:
        raise SystemExit("prefixgate bench replay: --duration must be given with --trace or --shared-prefix")
    if args.duration is not None and args.duration <= 0:
        raise SystemExit("prefixgate bench replay: --duration must be positive")


def _pace(args: argparse.Namespace, name: str, params: dict[str, Any], sessions: Sequence[Session]) -> str:
    """How the workload is paced, for the titles."""
    speed = f" at speed {args.speed:g}" if args.speed != 1 else ""
    if name in AGENT_WORKLOADS:
        return f"{len(sessions)} sessions starting within {params['start_window_s']:g} s{speed}"
    if name in ("grouped", "longmix"):
        return f"{len(sessions)} prompts at {params['rate']:g} req/s{speed}"
    rate = f"{args.rate:g} req/s" if args.rate else f"its own times at speed {args.speed:g}"
    return f"{rate} for {args.duration:g} s"


def run(args: argparse.Namespace) -> dict[str, Any]:
    fill_fleet_defaults(args)
    name, sessions, params = _sessions(args)
    if args.sim_fleet is not None:
        return _run_fleet(args, name, params, sessions)
    result = asyncio.run(
        replay_sessions(
            args.url,
            sessions,
            model=args.model,
            api_key=args.api_key or os.environ.get("PREFIXGATE_API_KEY", "none"),
            concurrency_limit=args.concurrency_limit,
            timeout_s=args.timeout,
            text=args.text,
        )
    )
    payload = {
        "workload": name,
        "workload_params": params,
        "rate": args.rate,
        "duration_s": args.duration,
        **result.summary(),
    }
    title = f"replay: {name}, {_pace(args, name, params, sessions)} against {result.url}"
    print(_tables(title, payload))
    if args.json:
        write_json(args.json, payload)
        bar_panels(Path(args.json).with_suffix(".png"), title, _panels(payload))
    return payload


# -- fleet mode: one workload through a gateway per row ----------------------------------------------


def imbalance(requests_per_replica: dict[str, int], replicas: int) -> float:
    """max/mean of requests per replica, replicas that got none counted in the mean."""
    total = sum(requests_per_replica.values())
    return max(requests_per_replica.values(), default=0) * replicas / total if total else 0.0


def _check_fleet_flags(args: argparse.Namespace) -> None:
    """What --sim-fleet's workers can serve: text only where they count words, KV events in the
    gateway's unit only, and sglang-router only with text prompts."""
    if args.sim_fleet < 1 or args.parallel < 1:
        raise SystemExit("prefixgate bench replay: --sim-fleet and --parallel need at least 1")
    if args.text != (args.sim_unit == "words"):
        raise SystemExit(
            "prefixgate bench replay: --text and --sim-unit words go together with --sim-fleet: only "
            "simulated workers that count words read text"
        )
    if args.sim_unit is not None and any(m.precise for m in args.modes):
        raise SystemExit(
            "prefixgate bench replay: --sim-unit: the gateway follows no KV events in another unit; "
            "give approx modes only"
        )
    if not args.text and any(r.startswith("sglang") for r in args.peers):
        raise SystemExit(
            "prefixgate bench replay: sglang-router routes text prompts only: --text --sim-unit words"
        )


def _run_fleet(
    args: argparse.Namespace, name: str, params: dict[str, Any], sessions: list[Session]
) -> dict[str, Any]:
    """Per row: fresh workers (empty caches), a gateway with the row's policy and mode (or a peer
    router), the same sessions; `--parallel` rows at a time, each wave's fleets stopped before the
    next starts."""
    _check_fleet_flags(args)
    pool = (args.block_size, args.num_blocks)
    workers = fleet_workers(args.sim_fleet, args.sim_profile, pool, args.sim_unit)
    spec = workers.spec
    plain = PRECISE if args.sim_unit is None else APPROX
    plan: list[Row | PeerRow] = [*fleet_rows(args.policies, args.modes, plain), *map(PeerRow, args.peers)]

    def serve(fleets: contextlib.ExitStack, workdir: Path, row: Row | PeerRow) -> str:
        if isinstance(row, PeerRow):
            return fleets.enter_context(peer_fleet(workdir, workers, row.router))
        knobs = dict(args.prefix_aware or ())
        return fleets.enter_context(row_fleet(workdir, workers, row.policy, row.mode, pool, args.text, knobs))

    async def wave_replays(urls: list[str], first: int) -> list[ReplayResult]:
        return await asyncio.gather(
            *(
                replay_sessions(
                    url,
                    sessions,
                    model=spec.model,
                    concurrency_limit=args.concurrency_limit,
                    timeout_s=args.timeout,
                    label=f"{first + j + 1}/{len(plan)} {plan[first + j].name}",
                    position=j,
                    text=args.text,
                    replica_header=WORKER_HEADER if isinstance(plan[first + j], PeerRow) else REPLICA_HEADER,
                )
                for j, url in enumerate(urls)
            )
        )

    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="prefixgate-replay-") as tmp:
        for first in range(0, len(plan), args.parallel):
            wave = plan[first : first + args.parallel]
            with contextlib.ExitStack() as fleets:
                urls = [serve(fleets, Path(tmp) / f"row{first + j}", row) for j, row in enumerate(wave)]
                results = asyncio.run(wave_replays(urls, first))
            for row, result in zip(wave, results, strict=True):
                summary = result.summary()
                how = (
                    {"policy": row.router, "mode": "peer", "capacity_blocks": None}
                    if isinstance(row, PeerRow)
                    else {
                        "policy": row.policy,
                        "mode": row.mode.name,
                        "capacity_blocks": row.mode.capacity_blocks(args.num_blocks),
                    }
                )
                rows[row.name] = {
                    **summary,
                    **how,
                    "imbalance": imbalance(summary["requests_per_replica"], spec.count),
                }
    unit = args.sim_unit or "tokens"
    payload = {
        "workload": name,
        "workload_params": params,
        "requests": total_turns(sessions),
        "rate": args.rate,
        "duration_s": args.duration,
        "speed": args.speed,
        "text": args.text,
        "sim_fleet": {**dataclasses.asdict(spec), "model": spec.model, "unit": unit},
        "prefix_aware": dict(args.prefix_aware or ()),
        "policies": rows,
    }
    counted = {"tokens": "", "words": " words", "blocks64": " tokens"}[unit]
    title = (
        f"replay: {name}, {_pace(args, name, params, sessions)} through the gateway over {spec.count} "
        f"{spec.profile} workers ({spec.num_blocks} blocks of {spec.block_size}{counted})"
    )
    if args.text:
        title += ", text prompts"
    if args.prefix_aware:
        title += ", prefix_aware " + " ".join(f"{k}={v:g}" for k, v in args.prefix_aware)
    print(_fleet_tables(title, payload))
    if args.json:
        write_json(args.json, payload)
        bar_panels(Path(args.json).with_suffix(".png"), title, _fleet_panels(payload))
    return payload


_FLEET_COLUMNS = (
    ("TTFT mean s", "ttft_s", "mean"),
    ("TTFT p50 s", "ttft_s", "p50"),
    ("TTFT p99 s", "ttft_s", "p99"),
    ("E2E p50 s", "e2e_s", "p50"),
    ("E2E p99 s", "e2e_s", "p99"),
)


def _fleet_tables(title: str, p: dict[str, Any]) -> str:
    replicas = [f"w{i}" for i in range(p["sim_fleet"]["count"])]
    rows, spread = [], []
    for policy, r in p["policies"].items():
        latency = ["-" if r[key][s] is None else r[key][s] for _, key, s in _FLEET_COLUMNS]
        errors = ", ".join(f"{k}={v}" for k, v in r["errors"].items()) or "0"
        moved = "-" if r["moved_turns"] is None else r["moved_turns"]
        predicted = "-" if r["ttft_predicted"] is None else r["ttft_predicted"]
        rows.append(
            [policy, *latency, r["hit_rate"], r["imbalance"], moved, predicted, r["completed"], errors]
        )
        spread.append([policy, *(r["requests_per_replica"].get(w, 0) for w in replicas)])
    header = [
        "policy",
        *(c[0] for c in _FLEET_COLUMNS),
        "hit rate",
        "imbalance",
        "moved turns",
        "predicted/seen TTFT",
        "completed",
        "errors",
    ]
    return "\n\n".join(
        [
            format_table(title, header, rows),
            format_table("requests per replica", ["policy", *replicas], spread),
        ]
    )


def _plot_label(row: str) -> str:
    """A row's name short enough for a bar's label: "prefix_aware approx cap x16" is "prefix_aware ~x16"."""
    return row.replace(" approx cap absent", " ~none").replace(" approx cap ", " ~")


def _fleet_panels(p: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    rows = {_plot_label(name): r for name, r in p["policies"].items()}
    panels = [
        (name, {policy: r[key][s] for policy, r in rows.items() if r[key][s] is not None})
        for name, key, s in _FLEET_COLUMNS
    ]
    moved = {policy: r["moved_turns"] for policy, r in rows.items() if r["moved_turns"] is not None}
    return [
        *panels,
        ("hit rate", {policy: r["hit_rate"] for policy, r in rows.items()}),
        ("imbalance (max/mean)", {policy: r["imbalance"] for policy, r in rows.items()}),
        *([("moved turns", moved)] if moved else []),
    ]


_LATENCIES = (("TTFT s", "ttft_s"), ("ITL s", "itl_s"), ("E2E s", "e2e_s"))


def _tables(title: str, p: dict[str, Any]) -> str:
    stats = ["mean", *(f"p{q}" for q in PERCENTILES)]
    latency = [[name, *("-" if p[key][s] is None else p[key][s] for s in stats)] for name, key in _LATENCIES]
    errors = ", ".join(f"{k}={v}" for k, v in p["errors"].items()) or "0"
    moved = "-" if p["moved_turns"] is None else p["moved_turns"]
    totals = [
        [p["sent"], p["completed"], errors, p["hit_rate"], moved, p["throughput_req_s"], p["output_tok_s"]]
    ]
    replicas = [[r, n] for r, n in p["requests_per_replica"].items()]
    tables = [
        format_table(title, ["latency", *stats], latency),
        format_table(
            "totals", ["sent", "completed", "errors", "hit rate", "moved turns", "req/s", "out tok/s"], totals
        ),
    ]
    if replicas:
        tables.append(format_table("requests per replica", ["replica", "requests"], replicas))
    return "\n\n".join(tables)


def _panels(p: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    panels = [(name, {s: v for s, v in p[key].items() if v is not None}) for name, key in _LATENCIES]
    return [*panels, ("requests per replica", {r: float(n) for r, n in p["requests_per_replica"].items()})]
