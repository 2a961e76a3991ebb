"""`prefixgate bench throughput`: how many requests a second prefixgate carries against a replica that
costs nothing, beside the replica alone and sglang-router in front of it, one run, the same clients.

The router is the one component every request crosses, so its own cost sets the fleet's ceiling
where replicas are many and fast. Here one canned replica (bench.canned_replica: a one-token answer
at once, on llhttp and uvloop) stands for them, and `--clients` keep-alive clients, each sending its
next request when its answer ends (on uvloop where installed), drive it directly, through a
prefixgate gateway (approximate mode, the default tokenizer: it renders, tokenizes, hashes, matches
and records every prompt; and beside it one routing on the prompt's text, `tokenizer: text`, which
skips rendering and tokenizing), through sglang-router's cache_aware policy (a Rust router matching
text in a radix tree; from the peers venv, bench.peers, left out with the reason when that cannot be
made), and through the floor of the gateway's HTTP stack (bench.floor_proxy: aiohttp and the
gateway's upstream client, forwarding each body unread), which tells the gateway's own work per
request from its server's and client's. Every chat is new (a pool of distinct chats larger than any
phase sends, `--words` words each), non-streaming. Each target gets a warm-up and `--duration`
seconds, in the order direct, prefixgate, the floor, sglang-router, and then again in reverse, so
that a slow stretch of a shared machine falls on each alike; the table gives the better of a
target's two phases.

On a small machine the load generator, the router and the replica share the cores: the req/s is the
machine's with that router in the path, and the router's CPU per request (/proc) is read beside it.
`--gateway-workers 1,4` adds prefixgate as `serve --workers 4` (its processes' CPU summed).
`--collectors tuned,python` adds prefixgate with Python's garbage collector as it comes (gateway.collector:
`freeze` and `young` each part alone), and each gateway's GC pauses are read from its /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench.conversation import sentence
from bench.local_fleet import COLLECTORS, Child, Fleet, gateway_config, spawn, start_gateway, wait_healthy
from bench.peers import peer_router
from bench.procfs import group_cpu_s, group_peak_rss_bytes
from bench.report import bar_panels, format_table, write_json
from gateway.forward.upstream import UpstreamError
from gateway.forward.upstream_client import UpstreamClient
from protocol.loopback_ports import free_port
from protocol.serving import new_event_loop

MODEL = "canned"
PEER = "sglang cache_aware"
ONE = "prefixgate"
FLOOR = "aiohttp floor"
# The bar: prefixgate's req/s at least this share of sglang-router's, on 200-word chats.
BAR_SHARE = 0.6
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer none"}


# Sentences drawn once per run; a chat is one of them behind a number of its own.
SENTENCES = 1000


def chat_bodies(rng: random.Random, words: int) -> Iterator[bytes]:
    """Non-streaming chats of about `words` words, each new from its first word (a count), so that no
    two share a prefix for a router to find cached."""
    texts = [sentence(rng, words - 1) for _ in range(SENTENCES)]
    for n in itertools.count():
        content = f"{n} {texts[n % SENTENCES]}"
        yield orjson.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
        )


async def chat_loop(url: str, bodies: Iterator[bytes], clients: int, duration_s: float) -> tuple[int, int]:
    """`clients` clients, each sending its next body when its answer ends, for `duration_s`: (answered
    with 200, failed)."""
    client = UpstreamClient()
    done = failed = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + duration_s

    async def one() -> None:
        nonlocal done, failed
        while loop.time() < end:
            try:
                response = await client.request(
                    "POST", url, "/v1/chat/completions", next(bodies), HEADERS, connect_s=10, read_s=30
                )
                try:
                    await response.read()
                    ok = response.status == 200
                finally:
                    response.release()
            except (UpstreamError, TimeoutError):
                ok = False
            done += ok
            failed += not ok

    try:
        await asyncio.gather(*(one() for _ in range(clients)))
    finally:
        client.close()
    return done, failed


def gc_pauses(url: str) -> tuple[float, float]:
    """A gateway's garbage-collection pauses since it started, from its /metrics (every process's, with
    --workers N): (their total seconds, the longest)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    total = longest = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "prefixgate_gateway_gc_pause_seconds_total":
                total += sample.value
            elif sample.name == "prefixgate_gateway_gc_longest_pause_seconds":
                longest = max(longest, sample.value)
    return total, longest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--words",
        type=lambda text: [int(w) for w in text.split(",")],
        default=[50, 200],
        help="words per chat, one run each, comma-separated",
    )
    parser.add_argument(
        "--clients", type=int, default=32, help="keep-alive clients, each one request at a time"
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds each target is measured, twice")
    parser.add_argument(
        "--warm-up", type=float, default=1.0, help="seconds sent to a target before each phase"
    )
    parser.add_argument(
        "--gateway-workers",
        type=lambda text: sorted({int(w) for w in text.split(",")}),
        default=[1],
        help="prefixgate's process counts (serve --workers N), one target each, comma-separated",
    )
    parser.add_argument(
        "--tokenizers",
        type=lambda text: text.split(","),
        default=["default", "text"],
        help="prefixgate's tokenizers, one target each (text: routed on the prompt's text), comma-separated",
    )
    parser.add_argument(
        "--collectors",
        type=lambda text: text.split(","),
        default=["tuned"],
        help=f"prefixgate's garbage-collector settings, one target each ({', '.join(COLLECTORS)}), "
        "comma-separated",
    )
    parser.add_argument("--no-peer", action="store_true", help="leave sglang-router out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here, and a PNG next to it")


def gateway_name(workers: int, tokenizer: str = "default", collector: str = "tuned") -> str:
    name = ONE if tokenizer == "default" else f"{ONE} {tokenizer}"
    name = name if workers == 1 else f"{name} x{workers}"
    return name if collector == "tuned" else f"{name} gc={collector}"


@contextlib.contextmanager
def targets(
    workdir: Path, peer: bool, gateway_workers: list[int], tokenizers: list[str], collectors: list[str]
) -> Iterator[tuple[dict[str, str], dict[str, Child], dict[str, str]]]:
    """The replica and the routers in front of it, ready: (URLs by target, the processes whose CPU is
    read (the prefixgate gateways and the floor proxy) by target, why a target is missing)."""
    with Fleet(workdir) as fleet, contextlib.ExitStack() as peers:
        port = free_port()
        command = [sys.executable, "-m", "bench.canned_replica", "--port", str(port), "--model", MODEL]
        replica = fleet.add(spawn("replica", command, f"http://127.0.0.1:{port}", workdir))
        wait_healthy([replica])
        config = gateway_config(MODEL, [], policy="prefix_aware")
        config["replicas"] = [{"url": replica.url, "id": "canned", "kind": "openai", "model": MODEL}]
        processes = {
            gateway_name(n, tokenizer, collector): fleet.add(
                start_gateway(
                    workdir,
                    f"gateway-{tokenizer}-{n}-{collector}",
                    config
                    | {"models": {MODEL: {"tokenizer": tokenizer}}, "collector": COLLECTORS[collector]},
                    "--workers",
                    str(n),
                )
            )
            for tokenizer in tokenizers
            for n in gateway_workers
            for collector in collectors
        }
        port = free_port()
        command = [sys.executable, "-m", "bench.floor_proxy", "--port", str(port), "--upstream", replica.url]
        processes[FLOOR] = fleet.add(spawn("floor", command, f"http://127.0.0.1:{port}", workdir))
        wait_healthy(list(processes.values()))
        urls = {"direct": replica.url, **{name: p.url for name, p in processes.items()}}
        missing: dict[str, str] = {}
        if peer:
            try:
                urls[PEER] = peers.enter_context(peer_router(PEER, [replica.url], workdir))
            except RuntimeError as error:
                missing[PEER] = str(error).splitlines()[0]
        else:
            missing[PEER] = "left out (--no-peer)"
        yield urls, processes, missing


def run(args: argparse.Namespace) -> dict[str, Any]:
    if min(args.clients, *args.words, *args.gateway_workers) < 1 or args.duration <= 0 or args.warm_up < 0:
        raise SystemExit(
            "prefixgate bench throughput: --clients, --duration, --words and --gateway-workers must be "
            "positive"
        )
    unknown = sorted(set(args.collectors) - set(COLLECTORS))
    if unknown:
        raise SystemExit(
            f"prefixgate bench throughput: --collectors {unknown}: choose among {list(COLLECTORS)}"
        )
    rng = random.Random(args.seed)
    results: dict[int, dict[str, Any]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="prefixgate-throughput-") as tmp,
        targets(Path(tmp), not args.no_peer, args.gateway_workers, args.tokenizers, args.collectors) as (
            urls,
            processes,
            missing,
        ),
        asyncio.Runner(loop_factory=new_event_loop) as runner,
    ):
        order = list(urls)
        phases = order + order[::-1]
        gateways = [t for t in processes if t != FLOOR]
        for words in args.words:
            bodies = chat_bodies(rng, words)
            rates: dict[str, list[float]] = {t: [] for t in order}
            cpu: dict[str, list[float]] = {t: [] for t in processes}
            gc_pause: dict[str, list[float]] = {t: [] for t in gateways}
            failures = dict.fromkeys(order, 0)
            for target in tqdm(phases, desc=f"{words}-word chats"):
                runner.run(chat_loop(urls[target], bodies, args.clients, args.warm_up))
                process = processes.get(target)
                before = group_cpu_s(process.pid) if process is not None else 0.0
                paused = gc_pauses(urls[target])[0] if target in gc_pause else 0.0
                start = time.perf_counter()
                done, failed = runner.run(chat_loop(urls[target], bodies, args.clients, args.duration))
                elapsed = time.perf_counter() - start
                rates[target].append(done / elapsed)
                if process is not None:
                    cpu[target].append((group_cpu_s(process.pid) - before) / max(done, 1))
                if target in gc_pause:
                    gc_pause[target].append((gc_pauses(urls[target])[0] - paused) / max(done, 1))
                failures[target] += failed
            results[words] = {
                "req_s": {t: max(r) for t, r in rates.items()},
                "phases_req_s": rates,
                "failed": failures,
                "cpu_s_per_request": {t: min(c) for t, c in cpu.items() if c},
                "gc_s_per_request": {t: min(g) for t, g in gc_pause.items() if g},
            }
        peak_rss = {name: group_peak_rss_bytes(p.pid) / 2**20 for name, p in processes.items()}
        longest_gc = {t: gc_pauses(urls[t])[1] for t in gateways}
    payload = {
        "config": {
            "clients": args.clients,
            "duration_s": args.duration,
            "words": args.words,
            "gateway_workers": args.gateway_workers,
            "tokenizers": args.tokenizers,
            "collectors": args.collectors,
            "cpus": os.cpu_count(),
        },
        "targets": list(urls),
        "peak_rss_mib": peak_rss,
        "longest_gc_pause_s": longest_gc,
        "missing": missing,
        "results": results,
    }
    print(_tables(payload))
    if args.json:
        write_json(args.json, payload)
        bar_panels(
            Path(args.json).with_suffix(".png"),
            f"requests/s, {args.clients} keep-alive clients, new non-streaming chats",
            [(f"{w}-word chats", r["req_s"]) for w, r in results.items()],
        )
    return payload


def _tables(p: dict[str, Any]) -> str:
    rows = []
    shown = [t for t in p["targets"] if t != PEER] + [PEER]
    gateways = [t for t in p["targets"] if t.startswith(ONE)]
    measured = [*gateways, FLOOR]
    for words, r in p["results"].items():
        rates = r["req_s"]
        peer = rates.get(PEER)
        rows.append(
            [
                f"{words} words",
                *(rates.get(t, "-") for t in shown),
                *((rates[t] / peer if peer else "-") for t in gateways),
                *(r["cpu_s_per_request"].get(t, 0) * 1e3 for t in measured),
                *(r["gc_s_per_request"].get(t, 0) * 1e6 for t in gateways),
                sum(r["failed"].values()),
            ]
        )
    header = [
        "chats",
        *(f"{t} req/s" for t in shown),
        *(f"{t} / peer" for t in gateways),
        *(f"{t} CPU ms/req" for t in measured),
        *(f"{t} GC µs/req" for t in gateways),
        "failed",
    ]
    title = (
        f"throughput, {p['config']['clients']} clients, better of two "
        f"{p['config']['duration_s']:g} s phases, {p['config']['cpus']} CPUs"
    )
    lines = [format_table(title, header, rows)]
    lines += [f"{target}: {why}" for target, why in p["missing"].items()]
    lines += [f"{t}: peak RSS {mib:.0f} MiB, all its processes" for t, mib in p["peak_rss_mib"].items()]
    lines += [f"{t}: longest GC pause {s * 1e3:.1f} ms" for t, s in p["longest_gc_pause_s"].items()]
    lines.append(f"bar: prefixgate >= {BAR_SHARE:g}x sglang-router's req/s on 200-word chats")
    return "\n".join(lines)
