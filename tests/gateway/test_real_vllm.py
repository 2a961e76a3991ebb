"""The gateway in front of a real vLLM server (vLLM's CPU build, SmolLM2-135M, bench.vllm_fleet):
precise mode's index against what vLLM reports it reused, the index across a vLLM restart, the
OpenAI API passed through untouched, and a gateway routing on the prompts' text reading vLLM's reports.

One server for the module, with a prefix cache of 48 blocks of 32 tokens, so that a few prompts of
~500 tokens evict one another; one `prefixgate serve` process in front of it, following its KV
events over ZMQ. The vLLM venv is made on first use (bench.vllm_env, ~2 minutes once); the module
then takes about two minutes, two vLLM start-ups (~35 s each) included.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.probes import wait_for
from bench.token_text import text_of
from bench.vllm_fleet import (
    BLOCK_SIZE,
    PROBE_REPEATS,
    VllmServer,
    VllmSpec,
    gateway,
    prefill_timing,
    read_counters,
    reset_prefix_caches,
    restart,
    vllm_fleet,
)
from gateway.forward.relay_headers import PREDICTED_CACHED_HEADER

SPEC = VllmSpec(count=1, num_blocks=48, max_model_len=1024, tools=True)
# Seconds the gateway's index may take to reflect what vLLM published: events travel over loopback
# in milliseconds; a restarted server is noticed when the follower reconnects.
INDEX_TIMEOUT_S = 30.0
SETTLED_S = 0.1


@dataclass
class GatewayOverVllm:
    """The module's vLLM server and the gateway process in front of it: a record; bench.vllm_fleet
    starts, restarts and stops them."""

    server: VllmServer
    gateway: str
    workdir: Path

    def replica(self) -> dict[str, Any]:
        return replica_of(self.gateway)


def replica_of(gateway_url: str) -> dict[str, Any]:
    """A gateway's view of its one replica (/admin/replicas: open on loopback)."""
    response = httpx.get(f"{gateway_url}/admin/replicas", timeout=5.0)
    response.raise_for_status()
    (replica,) = response.json()["replicas"]
    return replica


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayOverVllm]:
    workdir = tmp_path_factory.mktemp("vllm")
    with (
        vllm_fleet(SPEC, workdir) as servers,
        gateway(servers, SPEC, workdir, "prefix_aware", precise=True) as url,
    ):
        yield GatewayOverVllm(servers[0], url, workdir)


def settle(fleet: GatewayOverVllm) -> None:
    """Until the follower has applied no new batch for SETTLED_S: what vLLM published for the answer
    just received is in the index (it publishes after every engine step, before the answer ends)."""
    applied = fleet.replica()["kv_sync"]["batches_applied"]
    while True:
        time.sleep(SETTLED_S)
        now = fleet.replica()["kv_sync"]["batches_applied"]
        if now == applied:
            return
        applied = now


@pytest.fixture
def empty(fleet: GatewayOverVllm) -> GatewayOverVllm:
    """The server's prefix cache emptied, and the gateway's index with it (AllBlocksCleared)."""
    reset_prefix_caches([fleet.server], SPEC.model)
    wait_for(
        lambda: fleet.replica()["index_blocks"] == 0,
        "the index emptying",
        timeout=INDEX_TIMEOUT_S,
        interval=0.05,
    )
    settle(fleet)
    return fleet


def tokens(fleet: GatewayOverVllm, prompt: str) -> int:
    body = {"model": SPEC.model, "prompt": prompt}
    return int(httpx.post(f"{fleet.server.url}/tokenize", json=body, timeout=10.0).json()["count"])


def off_boundary(fleet: GatewayOverVllm, words: list[int]) -> str:
    """The words as a prompt whose token count is not a multiple of the block size (one more word
    until it is not): vLLM never reuses a prompt's last token, so a prompt that ends on a block
    boundary is reported one block short of what it holds (test_block_boundary_prompt)."""
    while tokens(fleet, text_of(words)) % BLOCK_SIZE == 0:
        words = [*words, words[-1]]
    return text_of(words)


@dataclass(frozen=True)
class Reuse:
    predicted: int  # the gateway's x-prefixgate-predicted-cached-tokens
    cached: int  # vLLM's usage.prompt_tokens_details.cached_tokens
    prompt_tokens: int


def complete(fleet: GatewayOverVllm, prompt: str) -> Reuse:
    """One completion through the gateway, and what it says of the cache, once the index settled."""
    body = {"model": SPEC.model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    response = httpx.post(f"{fleet.gateway}/v1/completions", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    settle(fleet)
    return Reuse(
        int(response.headers[PREDICTED_CACHED_HEADER]),
        int(usage["prompt_tokens_details"]["cached_tokens"]),
        int(usage["prompt_tokens"]),
    )


def documents(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(count)]


def test_precise_index_matches_what_vllm_reuses(empty: GatewayOverVllm) -> None:
    """24 sequential requests over 4 documents of ~480 tokens (each ~15 blocks, four of them ~60,
    against a cache of 47 usable blocks), each with a question of its own: prefixes shared, and
    evicted in part or whole as the others come. The prediction equals vLLM's reuse every time."""
    docs = documents(4, 170)
    rng = random.Random(1)
    order = "AABABCACBDABCDAABCDDBACB"
    best: dict[str, int] = {}
    reuses: list[tuple[str, Reuse]] = []
    for letter in order:
        question = [rng.randrange(1000, 30000) for _ in range(rng.randrange(8, 20))]
        reuse = complete(empty, off_boundary(empty, docs[ord(letter) - ord("A")] + question))
        reuses.append((letter, reuse))
    assert [r.predicted for _, r in reuses] == [r.cached for _, r in reuses], reuses
    hits = [r for _, r in reuses if r.cached]
    assert len(hits) >= 10, reuses
    evicted = 0
    for letter, reuse in reuses:
        if reuse.cached < best.get(letter, 0):
            evicted += 1  # the document was held longer before: the cache let part of it go
        best[letter] = max(best.get(letter, 0), reuse.cached)
    assert evicted >= 2, reuses


def test_block_boundary_prompt(empty: GatewayOverVllm) -> None:
    """A prompt of a whole number of blocks, sent twice: vLLM holds them all but reuses all but the
    last, since it must compute at least the prompt's last token, and the gateway predicts as much."""
    doc = documents(1, 200, seed=2)[0]
    # The first prefix of the document of 20 words or more that ends on a block boundary (a word is
    # 1-4 tokens, so one comes within a few blocks' worth of words).
    prompt = next(
        text for k in range(20, len(doc)) if tokens(empty, text := text_of(doc[:k])) % BLOCK_SIZE == 0
    )
    complete(empty, prompt)
    reuse = complete(empty, prompt)
    assert reuse.prompt_tokens % BLOCK_SIZE == 0 and reuse.cached == reuse.prompt_tokens - BLOCK_SIZE
    assert reuse.predicted == reuse.cached


def test_prefill_timing_is_read_on_prompts_vllm_computes_whole(empty: GatewayOverVllm) -> None:
    """bench vllm sets its workloads' speed from this rate: its probes must be computed, not reused,
    and the same probes again (found in the cache) are refused rather than read as a faster server."""
    before = read_counters(empty.server)
    timing = prefill_timing(empty.server, SPEC.model, long_words=200)
    done = read_counters(empty.server) - before
    assert timing.tokens_s > 0 and timing.fixed_s >= 0
    assert done.requests == 2 * PROBE_REPEATS and done.prefix_hits == 0
    with pytest.raises(RuntimeError, match="reused"):
        prefill_timing(empty.server, SPEC.model, long_words=200)


def test_index_follows_a_vllm_restart(empty: GatewayOverVllm) -> None:
    """Held before the restart; after it (the publisher's numbering starts over, its replay buffer
    no longer holds what the gateway applied) the replica's entries are cleared: the gateway predicts
    nothing for the prefix it held, and matches vLLM again once the prefix is computed anew."""
    doc = documents(1, 170, seed=3)[0]
    prompts = [off_boundary(empty, [*doc, 2000 + i, 3000 + i, 4000 + i]) for i in range(3)]
    complete(empty, prompts[0])
    held = complete(empty, prompts[1])
    assert held.predicted == held.cached > 0
    resyncs = empty.replica()["kv_sync"]["resyncs"]

    restart(empty.server, SPEC, empty.workdir)
    wait_for(
        lambda: (r := empty.replica())["kv_sync"]["resyncs"] > resyncs and r["healthy"],
        "the gateway clearing the restarted replica's entries",
        timeout=INDEX_TIMEOUT_S,
        interval=0.05,
    )
    after = complete(empty, prompts[2])
    assert after.predicted == after.cached == 0
    again = complete(empty, prompts[0])
    assert again.predicted == again.cached > 0


# -- the OpenAI API through the gateway ---------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOL_HISTORY: list[Any] = [
    {"role": "system", "content": "You are a weather assistant. Use the tools when you need data."},
    {"role": "user", "content": "What is the weather in Lyon?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "clear"}'},
    {"role": "user", "content": "Should I take an umbrella?"},
]
CITY_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "city",
        "schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"],
        },
    },
}


def client(url: str) -> openai.OpenAI:
    """The official client, to a gateway or to vLLM."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60.0)


def clients(fleet: GatewayOverVllm) -> tuple[openai.OpenAI, openai.OpenAI]:
    """The official client through the gateway, and straight to vLLM."""
    return client(fleet.gateway), client(fleet.server.url)


def answers(response: Any) -> dict[str, Any]:
    """What must be identical: the choices and the token counts (ids, timestamps and the cached
    count, which depends on what ran before, are not)."""
    usage = response.usage
    return {
        "choices": [c.model_dump() for c in response.choices],
        "tokens": (usage.prompt_tokens, usage.completion_tokens),
    }


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "tools": (
        "chat",
        {"messages": TOOL_HISTORY, "tools": [WEATHER_TOOL], "tool_choice": "auto", "max_tokens": 24},
    ),
    # vLLM refuses n > 1 under greedy sampling, and at temperature 1 a seeded sample follows the
    # low bits that vary with how vLLM schedules the siblings (it flipped once in CI): nearly
    # greedy, seeded, is reproducible.
    "n": ("chat", {"messages": TOOL_HISTORY[:2], "n": 2, "temperature": 0.01, "seed": 7, "max_tokens": 12}),
    "chat logprobs": (
        "chat",
        {"messages": TOOL_HISTORY[:2], "logprobs": True, "top_logprobs": 3, "max_tokens": 8},
    ),
    "completion logprobs": (
        "completion",
        {"prompt": "The capital of France is", "logprobs": 3, "max_tokens": 8},
    ),
    "response_format": (
        "chat",
        {
            "messages": [{"role": "user", "content": "Name a city in France as JSON."}],
            "response_format": CITY_SCHEMA,
            "max_tokens": 40,
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_passthrough_answers_as_vllm(fleet: GatewayOverVllm, case: str) -> None:
    """Each request through the gateway and straight to vLLM, each on an empty cache (a cached
    prefix changes the arithmetic, and with it the low bits of logprobs): the same answers."""
    kind, body = CASES[case]
    results = []
    for client in clients(fleet):
        reset_prefix_caches([fleet.server], SPEC.model)
        create = client.chat.completions.create if kind == "chat" else client.completions.create
        results.append(answers(create(model=SPEC.model, **{"temperature": 0, **body})))
    through, direct = results
    assert through == direct
    if case == "n":
        assert len(direct["choices"]) == 2
    if case == "response_format":
        assert direct["choices"][0]["message"]["content"].lstrip().startswith("{")


def test_passthrough_stream_with_usage(fleet: GatewayOverVllm) -> None:
    """A stream asking for usage gets vLLM's chunks, the usage chunk last, as vLLM sends them."""
    results = []
    for client in clients(fleet):
        reset_prefix_caches([fleet.server], SPEC.model)
        stream = client.chat.completions.create(
            model=SPEC.model,
            messages=TOOL_HISTORY[:2],
            temperature=0,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage is not None and not chunks[-1].choices
        results.append((text, usage.prompt_tokens, usage.completion_tokens, len(chunks)))
    through, direct = results
    assert through == direct
    assert direct[0] and direct[2] == 16


# -- a gateway routing on the text ------------------------------------------------------------------


@pytest.fixture(scope="module")
def on_text(fleet: GatewayOverVllm) -> Iterator[str]:
    """A second gateway in front of the same server, routing its model on the prompts' text
    (`tokenizer: text`): approximate, as such a model's replicas always are."""
    with gateway([fleet.server], SPEC, fleet.workdir, "prefix_aware", precise=False, tokenizer="text") as url:
        yield url


def test_routed_on_text_reads_vllms_reports(empty: GatewayOverVllm, on_text: str) -> None:
    """A six-turn chat through the gateway routing on its text: from the second turn on it predicts
    the history held, and vLLM reports reusing it. vLLM counts its tokens in blocks of 32, the
    gateway four-byte ids in blocks of 32: read as the share of the prompt they are, vLLM's reports
    never look like an eviction (its cache holds the whole chat), so no capacity is learned."""
    rng = random.Random(4)
    messages: list[dict[str, Any]] = [{"role": "system", "content": text_of(documents(1, 150, seed=4)[0])}]
    turns = []
    for _ in range(6):
        messages.append({"role": "user", "content": text_of([rng.randrange(1000, 30000) for _ in range(12)])})
        body = {"model": SPEC.model, "messages": messages, "max_tokens": 8, "temperature": 0}
        response = httpx.post(f"{on_text}/v1/chat/completions", json=body, timeout=60.0)
        assert response.status_code == 200, response.text
        answer = response.json()
        usage = answer["usage"]
        turns.append(
            (int(response.headers[PREDICTED_CACHED_HEADER]), usage["prompt_tokens_details"]["cached_tokens"])
        )
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    assert turns[0] == (0, 0), turns
    assert all(predicted > 0 and cached > 0 for predicted, cached in turns[1:]), turns
    replica = replica_of(on_text)
    assert replica["index_blocks"] > 0 and replica["index_capacity_blocks"] is None, replica


def test_routed_on_text_answers_as_vllm(fleet: GatewayOverVllm, on_text: str) -> None:
    """A tool-call history with its tools (the ids: tools first, then the messages, as JSON) through
    the gateway routing on the text and straight to vLLM: the same answers."""
    body = CASES["tools"][1]
    results = []
    for url in (on_text, fleet.server.url):
        reset_prefix_caches([fleet.server], SPEC.model)
        results.append(answers(client(url).chat.completions.create(model=SPEC.model, temperature=0, **body)))
    through, direct = results
    assert through == direct
