"""`prefixgate bench profile`: where a request's gateway CPU goes, stage by stage, per prompt shape.

Each stage is the gateway's own code called as a request calls it, in order, on state built as the
gateway builds it: four foreign replicas in approximate mode (their caches predicted and learned),
the default model's tokenizer with its prefix cache, the hash-chain cache, the default policy. The
stages: parse (the body's JSON), view (what routing reads of it), tokenize (the chat template and the
encoder, on the tokenizer thread, the hop included; "of which render" is the template alone), hash
(block hashes), match (the index), policy (the rest of the decision: views, rates, the choice),
record (the prediction made before forwarding), headers (the client's headers as they go upstream,
and the answer's as they come back, the routing headers added), accounting (the request placed on
its replica, its first token, its end: the metrics, the prefill rate and the correction learned from
the reported usage) and, of the end, release (the blocks touched again, and unpinned). What is not
here is HTTP itself: reading the request, writing it upstream and relaying the answer (aiohttp, the
sockets), which `bench conversation` and `bench throughput` measure with the stages, in the gateway's
CPU per request.

Shapes: distinct chats of 50, 200 and 600 words (nothing shared, nothing cached: a new user's first
turn), a distinct 2,000-token-id completion (no tokenizing), and rounds 31-60 of growing conversations
(a 1,500-word system prompt, 40-word turns: 6k-9k tokens), with the caches and without; and the
200-word chat again with 256 requests in flight on each replica (a replica's load is read at every
decision). Each timing is the median over `--requests` requests of that shape.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from multidict import CIMultiDict

from bench.conversation import conversation, sentence
from bench.report import format_table, write_json
from gateway.collector import YOUNG_THRESHOLD, space_young_collections
from gateway.fleet.expectations import expect, record, settle
from gateway.fleet.predictions import Predictions
from gateway.fleet.replicas import LoadReport, Replica, ReplicaSet
from gateway.forward.outcome import account, first_token, reported_usage
from gateway.forward.relay_headers import response_headers, upstream_headers
from gateway.forward.request_view import read_request
from gateway.forward.routed import Routed
from gateway.forward.router import decide
from gateway.forward.tokenizers import Tokenizers
from gateway.gateway_config import TEXT_SPEC, Limits, parse_config
from gateway.gateway_state import GatewayState
from gateway.http.reading import forwarded_headers
from policies import build_policy
from policies.routing_config import RoutingConfig
from protocol.models import load_tokenizer_spec
from protocol.openai_api import parse_json
from radix import RadixIndex
from radix.chain_cache import ChainCache

MODEL = "profiled"
BLOCK_SIZE = 16
REPLICAS = 4
STAGES = (
    "parse",
    "view",
    "tokenize",
    "of which render",
    "hash",
    "match",
    "policy",
    "record",
    "headers",
    "accounting",
    "release",
)
# What an OpenAI client sends (the official Python client's headers) and what a replica answers with.
CLIENT_HEADERS = CIMultiDict(
    {
        "Host": "127.0.0.1:8000",
        "Accept-Encoding": "gzip, deflate",
        "Connection": "keep-alive",
        "Accept": "application/json",
        "Content-Type": "application/json",
        "User-Agent": "OpenAI/Python 1.99.0",
        "X-Stainless-Lang": "python",
        "X-Stainless-Package-Version": "1.99.0",
        "X-Stainless-OS": "Linux",
        "X-Stainless-Arch": "x64",
        "X-Stainless-Runtime": "CPython",
        "X-Stainless-Runtime-Version": "3.11.7",
        "Authorization": "Bearer sk-none",
        "X-Stainless-Async": "false",
        "x-stainless-retry-count": "0",
        "x-stainless-read-timeout": "600",
        "Content-Length": "1400",
    }
)
REPLY_HEADERS = CIMultiDict(
    {
        "Date": "Sun, 06 Dec 2026 23:00:00 GMT",
        "Server": "uvicorn",
        "Content-Length": "420",
        "Content-Type": "application/json",
    }
)
US = 1e6
CACHE_BYTES = 64 * 2**20


# A growing conversation as bench conversation sends it; the turns past the first CONVERSATION_WARM
# of each are timed (6k-9k tokens each), the ones before warm the caches.
CONVERSATION_ROUNDS, CONVERSATION_WARM = 60, 30

# Bodies of a shape: `count` timed ones, each with whether it is timed (False: it warms the caches).
Bodies = Callable[[random.Random, int], Iterator[tuple[dict[str, Any], bool]]]


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    route: str  # "chat" or "completions"
    caches: bool
    bodies: Bodies
    # The tokenizer, when not --tokenizer's: "text" routes on the prompt's text (gateway.forward.text_ids).
    tokenizer: str | None = None
    # Requests in flight on each replica while it is timed (half of them past their first token): what
    # a replica's load is read from at every decision.
    inflight: int = 0


def _chats(words: int) -> Bodies:
    def bodies(rng: random.Random, count: int) -> Iterator[tuple[dict[str, Any], bool]]:
        for _ in range(count):
            yield {"model": MODEL, "messages": [{"role": "user", "content": sentence(rng, words)}]}, True

    return bodies


def _ids(tokens: int) -> Bodies:
    def bodies(rng: random.Random, count: int) -> Iterator[tuple[dict[str, Any], bool]]:
        for _ in range(count):
            prompt = [rng.randrange(49152) for _ in range(tokens)]
            yield {"model": MODEL, "prompt": prompt, "max_tokens": 4}, True

    return bodies


def _turns(rng: random.Random, count: int) -> Iterator[tuple[dict[str, Any], bool]]:
    timed = 0
    while timed < count:
        for n, messages in enumerate(conversation(rng, 1500, 40, CONVERSATION_ROUNDS)):
            if n >= CONVERSATION_WARM and timed == count:
                return
            timed += n >= CONVERSATION_WARM
            yield {"model": MODEL, "messages": messages}, n >= CONVERSATION_WARM


def shapes() -> list[Shape]:
    return [
        Shape("chat, 50 words, new", "chat", True, _chats(50)),
        Shape("chat, 200 words, new", "chat", True, _chats(200)),
        Shape("chat, 200 words, new, 256 in flight a replica", "chat", True, _chats(200), inflight=256),
        Shape("chat, 600 words, new", "chat", True, _chats(600)),
        Shape("completion, 2k ids, new", "completions", True, _ids(2000)),
        Shape("conversation turn, caches", "chat", True, _turns),
        Shape("conversation turn, no caches", "chat", False, _turns),
        Shape("chat, 200 words, new, routed on text", "chat", True, _chats(200), TEXT_SPEC),
        Shape("conversation turn, routed on text", "chat", True, _turns, TEXT_SPEC),
    ]


class _Timed:
    """`target` with one method timed into `into` at every call; everything else passed through."""

    def __init__(self, target: Any, method: str, into: list[float]) -> None:
        self._target, self._method, self._into = target, method, into

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name != self._method:
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self._into.append(time.perf_counter() - start)

        return timed


async def profile_shape(shape: Shape, requests: int, seed: int, spec: str = "default") -> dict[str, float]:
    """Median seconds of each stage over `requests` timed requests of `shape`, tokenized with the
    tokenizer `spec` names."""
    cache_bytes = CACHE_BYTES if shape.caches else 0
    spec = shape.tokenizer or spec
    tokenizers = Tokenizers({MODEL: spec}, cache_bytes=cache_bytes)
    await tokenizers.load([MODEL])
    # What renders the chat template, timed apart ("of which render"); none for a text-routed model.
    tokenizer = load_tokenizer_spec(spec) if spec != TEXT_SPEC else None
    limits = Limits()
    index = RadixIndex()
    replicas = [
        Replica(f"r{i}", f"http://r{i}", "openai", MODEL, BLOCK_SIZE, None, 8192, "config", 10_000.0)
        for i in range(REPLICAS)
    ]
    load = ReplicaSet()
    for r in replicas:
        index.add_replica(r.id, learn=True)
        load.add(r)
        r.report = LoadReport(running=1, at=0.0)
        for n in range(shape.inflight):
            handle = load.dispatched(r, 1.0 + n, prefill_tokens=200, kv_blocks=13)
            if n % 2:
                load.started(r, handle, ttft_s=0.1, alpha=0.2, min_tokens=1)
    predictions = Predictions(index, ttl_s=300.0)
    policy = build_policy(RoutingConfig())
    chains = ChainCache(cache_bytes)
    times: dict[str, list[float]] = {stage: [] for stage in STAGES}
    hashed: list[float] = []
    matched: list[float] = []
    released: list[float] = []
    timed_chains, timed_index = _Timed(chains, "block_hashes", hashed), _Timed(index, "match", matched)
    # What the forward path reads and writes (metrics, learning): the gateway's state, on this index.
    state = GatewayState(parse_config({"models": {MODEL: {"tokenizer": "none"}}}), "profile")
    state.index, state.replicas = index, load
    state.predictions = _Timed(predictions, "released", released)  # type: ignore[assignment]
    target = "/v1/chat/completions" if shape.route == "chat" else "/v1/completions"
    try:
        for body, measured in shape.bodies(random.Random(seed), requests):
            raw = orjson.dumps(body)
            clock = time.perf_counter()
            parsed = parse_json(raw)
            stamps = [clock, time.perf_counter()]
            view = read_request(shape.route, parsed)
            stamps.append(time.perf_counter())
            prompt = await tokenizers.prompt(view, MODEL, limits)
            stamps.append(time.perf_counter())
            assert prompt is not None
            if view.messages is not None and measured and tokenizer is not None:
                start = time.perf_counter()
                tokenizer.render_chat(view.messages)
                times["of which render"].append(time.perf_counter() - start)
            hashed.clear()
            matched.clear()
            start = time.perf_counter()
            decision = decide(policy, timed_index, replicas, prompt.ids, chains=timed_chains)  # type: ignore[arg-type]
            routed_s = time.perf_counter() - start
            chosen = next(r for r in replicas if r.id == decision.order[0])
            hashes = decision.hashes[BLOCK_SIZE]
            start = time.perf_counter()
            expectation = expect(index, chosen, hashes, precise=False)
            record(index, predictions, expectation, now=time.time())
            recorded = time.perf_counter()
            routed = Routed(
                route=shape.route,  # type: ignore[arg-type]
                model=MODEL,
                method="POST",
                target=target,
                raw=raw,
                body=parsed,
                headers=forwarded_headers(CLIENT_HEADERS, "127.0.0.1", "http"),
                tokens=prompt.token_ids,
                tokenized=prompt.tokenized,
                decision=decision,
                arrival=time.monotonic(),
                authorization=CLIENT_HEADERS.get("Authorization"),
                predicted=expectation.predicted,
                recorded_tick=expectation.recorded_tick,
            )
            upstream_headers(state.config, routed, raw)
            response_headers(REPLY_HEADERS, decision, chosen.id)
            headed = time.perf_counter()
            released.clear()
            _answered(state, routed, chosen, expectation.recorded_tick)
            accounted = time.perf_counter()
            settle(index, expectation)
            settled = time.perf_counter() - accounted
            if not measured:
                continue
            for stage, (a, b) in zip(("parse", "view", "tokenize"), itertools.pairwise(stamps), strict=True):
                times[stage].append(b - a)
            times["hash"].append(sum(hashed))
            times["match"].append(sum(matched))
            times["policy"].append(routed_s - sum(hashed) - sum(matched))
            times["record"].append(recorded - start)
            times["headers"].append(headed - recorded)
            times["accounting"].append(accounted - headed - sum(released))
            times["release"].append(sum(released) + settled)
    finally:
        tokenizers.close()
        state.tokenizers.close()
    return {stage: statistics.median(values) if values else 0.0 for stage, values in times.items()}


def _answered(state: GatewayState, routed: Routed, replica: Replica, recorded_tick: int | None) -> None:
    """The request's life on `replica` as the forward path accounts for it (gateway.forward.proxy):
    placed there, its first token, its end with the usage the replica reports (what was predicted
    cached, so that nothing is corrected), its place freed."""
    decision = routed.decision
    cached = min(decision.view_of(replica.id).cached_tokens, decision.prompt_tokens)
    uncached = decision.prompt_tokens - cached
    handle = state.replicas.dispatched(
        replica, time.monotonic(), uncached, recorded_tick, -(-uncached // replica.block_size)
    )
    first_token(state, routed, replica, handle)
    usage = {"prompt_tokens": decision.prompt_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
    tail = orjson.dumps({"object": "chat.completion", "usage": usage})
    account(state, routed, replica, 200, reported_usage(REPLY_HEADERS, tail, replica), paired=False)
    state.replicas.finished(replica, handle)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=60, help="timed requests per shape")
    parser.add_argument("--tokenizer", default="default", help="default, a .gguf file or an HF folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here, and a PNG next to it")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.requests < 1:
        raise SystemExit("prefixgate bench profile: --requests must be at least 1")
    # Young collections as far apart as the gateway has them (gateway.collector): at Python's default
    # one lands in most of a large prompt's requests, in whichever stage it happens to be.
    thresholds = gc.get_threshold()
    space_young_collections(YOUNG_THRESHOLD)
    try:
        results = {
            shape.name: asyncio.run(profile_shape(shape, args.requests, args.seed, args.tokenizer))
            for shape in shapes()
        }
    finally:
        gc.set_threshold(*thresholds)
    rows = [
        [
            name,
            *(stages[s] * US for s in STAGES),
            sum(v for s, v in stages.items() if s != "of which render") * US,
        ]
        for name, stages in results.items()
    ]
    title = f"gateway CPU per request by stage, µs (median of {args.requests} a shape; HTTP not included)"
    print(format_table(title, ["shape", *STAGES, "total"], rows))
    payload = {"requests": args.requests, "replicas": REPLICAS, "block_size": BLOCK_SIZE, "stages_s": results}
    if args.json:
        write_json(args.json, payload)
        _plot(Path(args.json).with_suffix(".png"), title, results)
    return payload


def _plot(path: Path, title: str, results: dict[str, dict[str, float]]) -> None:
    """One stacked bar per shape, a segment per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    names = list(results)
    left = [0.0] * len(names)
    for stage in STAGES:
        if stage == "of which render":
            continue
        widths = [results[n][stage] * US for n in names]
        ax.barh(names, widths, left=left, label=stage)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("µs per request")
    ax.invert_yaxis()
    ax.legend(fontsize=8, ncol=4)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
