"""`prefixgate bench conversation`: what the gateway adds to a growing conversation, with its caches
and event loop and without, measured side by side in one run.

A multi-turn client re-sends its whole history every turn, so a gateway that tokenizes and hashes
each prompt pays for the whole conversation again at every turn; its caches (the tokenizer's prefix
cache, gateway.forward.prefix_cache, and the hash-chain cache, radix.chain_cache) are what should
make that cost the turn's new text alone, and uvloop (the fast extra) what trims the fixed cost of
every hop. One conversation at a time, as one user would drive it: a long system prompt, then
`--rounds` rounds of a user turn and an assistant answer. Each gateway of GATEWAYS is timed in a phase
of its own, the same conversations each time: every round is sent direct to the replica and through
the gateway, in an order that alternates every round so that a noisy second falls on both alike, and
the gateway's added time is read against the direct sends of its own phase. The last gateway routes
on the prompt's text (`tokenizer: text`, gateway.forward.text_ids): what is left without any
tokenizing. The first and the last are run again with Python's garbage collector as it comes, to
show what the gateway's settings of it buy (gateway.collector). Phases, not all paths
in one rotation: a gateway without caches spends milliseconds of tokenizing a round, which would
leave the next path to run on a CPU whose caches it has just cooled.

The replica is a simulated worker with a zero cost model that reads chats as words (a backend with
a tokenizer of its own, to which the gateway forwards the body as sent), so that its own time is its
software alone; the gateways tokenize with the default model's tokenizer, as they would in front of
a real replica of it.

Reported: TTFT and end-to-end latency per path, what each gateway adds at p50 and p99 over direct,
the prefix cache's hits and the share of prompt tokens it supplied (from the gateway's /metrics), and
each gateway's CPU seconds per request and memory.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench.local_fleet import (
    COLLECTORS,
    Fleet,
    SimWorkers,
    gateway_config,
    start_gateway,
    start_worker,
    wait_healthy,
)
from bench.overhead_phases import instant_profile
from bench.procfs import cpu_s, proc_stat
from bench.replay_result import latency_stats
from bench.report import bar_panels, format_table, write_json
from gateway.gateway_config import TEXT_SPEC

# The gateways, each in front of the same worker: (prefix and hash caches MiB, event loop, tokenizer:
# None for --tokenizer's, its `collector` section: bench.local_fleet.COLLECTORS).
PYTHONS_COLLECTOR = COLLECTORS["python"]
TEXT_PATH = "gateway, routed on text"
GATEWAYS: dict[str, tuple[int, str, str | None, dict[str, Any]]] = {
    "gateway": (64, "auto", None, {}),
    "gateway, Python's collector": (64, "auto", None, PYTHONS_COLLECTOR),
    "gateway, asyncio loop": (64, "asyncio", None, {}),
    "gateway, no caches, asyncio loop": (0, "asyncio", None, {}),
    TEXT_PATH: (64, "auto", TEXT_SPEC, {}),
    "gateway, routed on text, Python's collector": (64, "auto", TEXT_SPEC, PYTHONS_COLLECTOR),
}
PATHS = ("direct", *GATEWAYS)
# The bar for a growing conversation: added TTFT p50 over direct, with the cache.
BAR_P50_S = 1.5e-3
MS = 1e3
# Ordinary English words, so that the default tokenizer sees text of its own kind (about 1.3 tokens
# a word), not made-up syllables it would split into two or three.
_ENGLISH = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has "
    "look two more write go see number no way could people my than first water been call who oil its "
    "now find long down day did get come made may part over new sound take only little work know place "
    "year live me back give most very after thing our just name good sentence man think say great where "
    "help through much before line right too mean old any same tell boy follow came want show also "
    "around form three small set put end does another well large must big even such because turn here "
    "why ask went men read need land different home us move try kind hand picture again change off play "
    "spell air away animal house point page letter mother answer found study still learn should world"
)
WORDS = tuple(_ENGLISH.split())


@dataclass(slots=True)
class PathTimes:
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)


def sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def conversation(rng: random.Random, system_words: int, turn_words: int, rounds: int) -> list[list[dict]]:
    """Each round's messages: the system prompt, the rounds so far (user, assistant), a new user turn."""
    messages: list[dict[str, str]] = [{"role": "system", "content": sentence(rng, system_words)}]
    sent = []
    for _ in range(rounds):
        messages.append({"role": "user", "content": sentence(rng, turn_words)})
        sent.append(list(messages))
        messages.append({"role": "assistant", "content": sentence(rng, turn_words)})
    return sent


def timed_chat(client: httpx.Client, url: str, body: bytes) -> tuple[float, float]:
    """TTFT and end-to-end seconds of one streamed chat: to the first content delta, to [DONE]."""
    start = time.perf_counter()
    first: float | None = None
    with client.stream("POST", f"{url}/v1/chat/completions", content=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            if first is None:
                choices = orjson.loads(data).get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    first = time.perf_counter()
    end = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url} streamed no content")
    return first - start, end - start


# The gateway's cache counters this bench reads, and the prefix each one's labels get in its counts.
CACHE_FAMILIES = {
    "prefixgate_gateway_tokenizer_cache_lookups": "",
    "prefixgate_gateway_tokenizer_cache_tokens": "",
    "prefixgate_gateway_hash_cache_blocks": "blocks_",
}


def cache_counts(url: str) -> dict[str, float]:
    """The gateway's cache counters, summed over models: prefix-cache lookups by outcome (hit, miss)
    and ids by source (cache, tokenized); hash-chain blocks by source (blocks_cache, blocks_hashed)."""
    counts: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", timeout=5.0).text
    for family in text_string_to_metric_families(text):
        prefix = CACHE_FAMILIES.get(family.name)
        if prefix is None:
            continue
        for s in family.samples:
            key = prefix + (s.labels.get("outcome") or s.labels["source"])
            counts[key] = counts.get(key, 0.0) + s.value
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system-words", type=int, default=1500, help="words of the system prompt")
    parser.add_argument("--turn-words", type=int, default=40, help="words of each user and assistant turn")
    parser.add_argument("--rounds", type=int, default=60, help="rounds of each conversation")
    parser.add_argument("--conversations", type=int, default=2, help="conversations, one after the other")
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    parser.add_argument(
        "--tokenizer",
        default="default",
        help="the gateways' tokenizer: default, a .gguf file or an HF folder",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here, and a PNG next to it")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if min(args.system_words, args.turn_words, args.rounds, args.conversations, args.max_tokens) < 1:
        raise SystemExit("prefixgate bench conversation: every count must be at least 1")
    times = {path: PathTimes() for path in PATHS}
    # The direct sends of each gateway's phase, which its added time is read against.
    direct = {path: PathTimes() for path in GATEWAYS}
    with tempfile.TemporaryDirectory(prefix="prefixgate-conversation-") as tmp, Fleet(Path(tmp)) as fleet:
        workdir = Path(tmp)
        spec = SimWorkers(1, str(instant_profile(workdir)))
        worker = fleet.add(start_worker(workdir, spec, "w0", "--sim-tokenizer", "words"))
        wait_healthy([worker])
        gateways = {
            path: fleet.add(
                start_gateway(
                    workdir,
                    f"gateway-{i}",
                    _gateway(spec.model, worker.url, mib, tokenizer or args.tokenizer)
                    | {"collector": collector},
                    "--event-loop",
                    loop,
                )
            )
            for i, (path, (mib, loop, tokenizer, collector)) in enumerate(GATEWAYS.items())
        }
        wait_healthy(list(gateways.values()))
        urls = {"direct": worker.url, **{path: g.url for path, g in gateways.items()}}
        total = args.conversations * args.rounds
        # Each gateway's CPU over its own phase: the others' phases would add its idle work (probes).
        cpu: dict[str, float] = {}
        with httpx.Client(timeout=60.0) as client, tqdm(total=total * len(GATEWAYS), desc="rounds") as bar:
            for gateway in GATEWAYS:
                before = cpu_s(gateways[gateway].pid)
                rng = random.Random(args.seed)
                for n in range(args.conversations):
                    for r, messages in enumerate(
                        conversation(rng, args.system_words, args.turn_words, args.rounds)
                    ):
                        body = orjson.dumps(
                            {
                                "model": spec.model,
                                "messages": messages,
                                "max_tokens": args.max_tokens,
                                "stream": True,
                                "temperature": 0,
                            }
                        )
                        pair = (gateway, "direct") if (n * args.rounds + r) % 2 else ("direct", gateway)
                        for path in pair:
                            ttft, e2e = timed_chat(client, urls[path], body)
                            for into in (times[path], *([direct[gateway]] if path == "direct" else [])):
                                into.ttft_s.append(ttft)
                                into.e2e_s.append(e2e)
                        bar.update()
                cpu[gateway] = (cpu_s(gateways[gateway].pid) - before) / total
        cache = cache_counts(gateways["gateway"].url)
        memory = {path: proc_stat(g.pid) for path, g in gateways.items()}
    payload = _payload(args, times, direct, cpu, cache, memory)
    title = (
        f"a growing conversation: {args.system_words}-word system prompt, {args.turn_words}-word turns, "
        f"{args.rounds} rounds x {args.conversations}, one request at a time"
    )
    print(_tables(title, payload))
    if args.json:
        write_json(args.json, payload)
        bar_panels(Path(args.json).with_suffix(".png"), title, _panels(payload))
    return payload


def _gateway(model: str, worker_url: str, cache_mib: int, tokenizer: str) -> dict[str, Any]:
    """A gateway over the worker as a foreign replica (the body forwarded as sent), tokenizing with
    `tokenizer`, its token-id and hash caches `cache_mib` MiB each (0: off)."""
    config = gateway_config(model, [], limits={"tokenizer_cache_mib": cache_mib, "hash_cache_mib": cache_mib})
    config["models"] = {model: {"tokenizer": tokenizer}}
    config["replicas"] = [{"url": worker_url, "id": "w0", "kind": "openai", "model": model}]
    return config


def _payload(
    args: argparse.Namespace,
    times: dict[str, PathTimes],
    direct: dict[str, PathTimes],
    cpu: dict[str, float],
    cache: dict[str, float],
    memory: dict[str, Any],
) -> dict[str, Any]:
    latency = {
        path: {"ttft_s": latency_stats(t.ttft_s), "e2e_s": latency_stats(t.e2e_s)}
        for path, t in times.items()
    }
    baseline = {
        path: {"ttft_s": latency_stats(t.ttft_s), "e2e_s": latency_stats(t.e2e_s)}
        for path, t in direct.items()
    }
    added = {
        path: {
            f"{key}_{p}": latency[path][key][p] - baseline[path][key][p]
            for key in ("ttft_s", "e2e_s")
            for p in ("p50", "p99")
        }
        for path in PATHS[1:]
    }
    lookups = cache.get("hit", 0.0) + cache.get("miss", 0.0)
    ids = cache.get("cache", 0.0) + cache.get("tokenized", 0.0)
    blocks = cache.get("blocks_cache", 0.0) + cache.get("blocks_hashed", 0.0)
    return {
        "config": {
            k: getattr(args, k)
            for k in (
                "system_words",
                "turn_words",
                "rounds",
                "conversations",
                "max_tokens",
                "tokenizer",
                "seed",
            )
        },
        "latency": latency,
        "direct_by_phase": baseline,
        "added_s": added,
        "cache": {
            **cache,
            "hit_rate": cache.get("hit", 0.0) / lookups if lookups else None,
            "token_share": cache.get("cache", 0.0) / ids if ids else None,
            "block_share": cache.get("blocks_cache", 0.0) / blocks if blocks else None,
        },
        "gateway_cpu_s_per_request": cpu,
        "gateway_memory": {
            path: {"rss_bytes": m.rss_bytes, "peak_rss_bytes": m.peak_rss_bytes} for path, m in memory.items()
        },
        "bar": {
            "ttft_p50_s": BAR_P50_S,
            "met": added["gateway"]["ttft_s_p50"] <= BAR_P50_S,
            "met_routed_on_text": added[TEXT_PATH]["ttft_s_p50"] <= BAR_P50_S,
        },
    }


def _tables(title: str, p: dict[str, Any]) -> str:
    stats = ("p50", "p90", "p99")
    rows = [
        [path, *(p["latency"][path][key][s] * MS for key in ("ttft_s", "e2e_s") for s in stats)]
        for path in PATHS
    ]
    latency = format_table(title, ["ms", *(f"{k} {s}" for k in ("TTFT", "E2E") for s in stats)], rows)
    cost = [
        [
            path,
            p["added_s"][path]["ttft_s_p50"] * MS,
            p["added_s"][path]["ttft_s_p99"] * MS,
            p["gateway_cpu_s_per_request"][path] * MS,
            p["gateway_memory"][path]["peak_rss_bytes"] / 2**20,
        ]
        for path in PATHS[1:]
    ]
    added = format_table(
        "what each gateway adds",
        ["gateway", "added TTFT p50 ms", "added TTFT p99 ms", "CPU ms/request", "peak RSS MiB"],
        cost,
    )
    c = p["cache"]
    summary = (
        f"prefix cache: {int(c.get('hit', 0))} hits, {int(c.get('miss', 0))} misses "
        f"(hit rate {_share(c['hit_rate'])}), {_share(c['token_share'])} of prompt tokens from the cache, "
        f"{_share(c['block_share'])} of block hashes from the hash cache; "
        f"bar: added TTFT p50 <= {BAR_P50_S * MS:g} ms, tokenized with the cache: "
        + ("met" if p["bar"]["met"] else "NOT met")
        + ", routed on text: "
        + ("met" if p["bar"]["met_routed_on_text"] else "NOT met")
    )
    return f"{latency}\n\n{added}\n\n{summary}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _panels(p: dict[str, Any]) -> Sequence[tuple[str, dict[str, float]]]:
    return [
        ("TTFT p50 ms", {path: p["latency"][path]["ttft_s"]["p50"] * MS for path in PATHS}),
        ("added TTFT p50 ms", {path: p["added_s"][path]["ttft_s_p50"] * MS for path in PATHS[1:]}),
        ("gateway CPU ms/request", {path: p["gateway_cpu_s_per_request"][path] * MS for path in PATHS[1:]}),
    ]
