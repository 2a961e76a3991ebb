"""`prefixgate bench vllm`: the routers compared on real vLLM servers on this CPU.

Two vLLM servers of SmolLM2-135M (bench.vllm_fleet: one core each, small prefix caches) are started
once and warmed by one replay through round robin that is dropped (the first row after a start runs
slow); each row then puts one router in front of them and replays the same workload through it
(bench.replay, prompts as words that vLLM and the routers tokenize themselves), the servers' prefix
caches emptied before every row; with `--rounds N` every row is replayed N times, the order of the
rows reversed each round, and each row reads its rounds' requests pooled (one run on these shared
cores does not settle a cell: the same router's TTFT mean differs by tens of percent between runs).
The rows: prefixgate's prefix_aware in precise mode (following vLLM's KV events) and in approximate
mode (predicting the caches from its own routing and vLLM's reported cached tokens), the latter
also routing on the prompts' text untokenized (`tokenizer: text`: vLLM counts tokens, the gateway
four-byte words of JSON), its
cache_threshold (precise) and round_robin, and the peers from PyPI (bench.peers): sglang-router's
and vllm-router's cache_aware, and vllm-router's kv_aware.

What each row is measured by: the client's TTFT and end-to-end latency, the hit rate vLLM reported
in each answer's usage, and from the servers' own /metrics (read before and after each row) the
requests each served and each one's prefix-cache hit rate, so that every router, whether or not it
names the replica it chose, is judged by the same counters.

vllm-router's kv_aware needs two things the others do not. It does not tokenize text for HTTP
workers (it counts each text prompt as `preparation_rejected` and routes it by load alone), so its
row is sent the same prompts as SmolLM2 token ids, the ids vLLM computes from the words; and it
reads KV events over tcp:// only, so it follows each server through a loopback relay.

The workloads are sized for two CPU servers of 1,000 prompt tokens/s each (eager mode), and played at
the speed that keeps that share on the servers at hand: each server's prefill rate is timed once they
are up (bench.vllm_fleet.prefill_timing) and the workloads run at their mean over 1,000 (`--speed auto`,
the default), so that a host whose servers prefill at a fifth of that sees the same sessions five times
slower, the same queues and the same caches, instead of a fleet overloaded five times over. Each id of
a workload is one made-up word, ~2.8 SmolLM2 tokens. `agent`: 6 tenants with a 340-token system prompt
each, 40 sessions of 3 to 5 turns starting within 45 s, a 450-token tool result in half the turns,
histories of up to ~2,000 tokens (810 on average); `grouped`: 12 groups of 10 prompts sharing 700 of
their ~810 tokens, at 2 requests/s; `agent-think`, held out (no default is tuned on it): agent's
sessions thinking five times as long between turns, while the caches turn over. Sent with no
reuse at all, agent or grouped asks ~80-100 % of the fleet's prefill capacity. A cache of 160 blocks
of 32 tokens per server holds less than half of either's working set, so where a request goes decides
its hit; a router that keeps an agent's session where its history is computes a turn's new tokens alone
(under 40 % of the capacity), one that scatters the turns recomputes half the histories (about 70 %).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.fleet_sim import lru_hit_rate
from bench.loadgen import replay_sessions
from bench.peers import peer_router
from bench.replay_result import ReplayResult, latency_stats, pooled
from bench.replay_tables import COMPARISON_COLUMNS, comparison_cells
from bench.report import bar_panels, format_table, write_json
from bench.token_text import text_of
from bench.vllm_fleet import (
    BLOCK_SIZE,
    PrefillTiming,
    ServerCounters,
    VllmServer,
    VllmSpec,
    gateway,
    prefill_timing,
    read_counters,
    reset_prefix_caches,
    tcp_event_relays,
    vllm_fleet,
)
from bench.workloads import (
    HELD_OUT,
    AgentParams,
    GroupedParams,
    Session,
    agent_sessions,
    grouped_sessions,
    nominal_order,
    scaled,
)
from gateway.gateway_config import TEXT_SPEC
from protocol.models import default_tokenizer

NUM_BLOCKS = 160
# The prompt tokens a second a server prefills that the workloads are sized for (`--speed auto`).
REFERENCE_PREFILL_TOKENS_S = 1000.0
AGENT = AgentParams(
    tenants=6, system_tokens=120, sessions=40, min_turns=3, max_turns=5, tool_tokens=160,
    min_user_tokens=8, max_user_tokens=24, min_output_tokens=8, max_output_tokens=16,
    think_base_s=1.0, think_mean_s=2.0, start_window_s=45.0,
)  # fmt: skip
WORKLOADS: dict[str, AgentParams | GroupedParams] = {
    "agent": AGENT,
    "grouped": GroupedParams(groups=12, prompts_per_group=10, shared_tokens=250, own_tokens=40,
                             output_tokens=8, rate=2.0),
    # Held out (bench.workloads.HELD_OUT names it): agent's sessions, arriving at its rate, thinking 6 s +
    # Exp(8 s) between turns where agent's think 3 s on average. Meanwhile each server prefills
    # several caches' worth for the other sessions, so a history is often gone by its next turn.
    "agent-think": replace(AGENT, think_base_s=6.0, think_mean_s=8.0),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Router:
    """One row: prefixgate with a policy (precise: following the KV events), or a peer row of
    bench.peers; `token_ids`: its prompts sent as SmolLM2 token ids instead of words."""

    name: str
    policy: str | None = None  # prefixgate's; None for a peer
    precise: bool = False
    token_ids: bool = False
    # prefixgate's `tokenizer:` ("text": routed on the prompt's text, approximate).
    tokenizer: str = "default"
    # prefixgate's limits.prefill_depth (None: every request sent at once).
    prefill_depth: int | None = None


ROUTERS = (
    Router("prefixgate prefix_aware precise", "prefix_aware", precise=True),
    Router("prefixgate prefix_aware approx", "prefix_aware"),
    Router("prefixgate prefix_aware precise queued", "prefix_aware", precise=True, prefill_depth=1),
    Router("prefixgate prefix_aware approx queued", "prefix_aware", prefill_depth=1),
    Router("prefixgate prefix_aware text", "prefix_aware", tokenizer=TEXT_SPEC),
    Router("prefixgate cache_threshold precise", "cache_threshold", precise=True),
    Router("prefixgate round_robin", "round_robin"),
    Router("sglang cache_aware"),
    Router("sglang cache_aware balanced"),
    Router("vllm-router cache_aware"),
    Router("vllm-router kv_aware", token_ids=True),
)
NOTES = {
    "vllm-router kv_aware": "prompts sent as SmolLM2 token ids (it routes text prompts to HTTP workers "
    "by load alone: no tokens to match); KV events through a loopback tcp:// relay (it refuses ipc://)",
}


@contextlib.contextmanager
def router_url(router: Router, servers: Sequence[VllmServer], spec: VllmSpec, workdir: Path) -> Iterator[str]:
    """The row's router started over `servers`, its base URL yielded once it answers."""
    if router.policy is not None:
        with gateway(
            servers,
            spec,
            workdir,
            router.policy,
            precise=router.precise,
            tokenizer=router.tokenizer,
            prefill_depth=router.prefill_depth,
        ) as url:
            yield url
        return
    urls = [s.url for s in servers]
    if router.name.endswith("kv_aware"):
        with tcp_event_relays(servers) as endpoints, peer_router(
            router.name, urls, workdir, kv_events=endpoints, block_size=BLOCK_SIZE, model=spec.model
        ) as url:  # fmt: skip
            yield url
        return
    with peer_router(router.name, urls, workdir) as url:
        yield url


def as_token_ids(sessions: Sequence[Session]) -> list[Session]:
    """The same sessions with every prompt the SmolLM2 token ids of its words: what vLLM computes."""
    encode = default_tokenizer().encode
    return [
        replace(s, turns=tuple(replace(t, prompt=tuple(encode(text_of(t.prompt)))) for t in s.turns))
        for s in sessions
    ]


def run_row(
    router: Router,
    sessions: Sequence[Session],
    servers: Sequence[VllmServer],
    spec: VllmSpec,
    workdir: Path,
    timeout_s: float,
    label: str,
) -> tuple[ReplayResult, list[ServerCounters]]:
    """One router through one workload, from empty caches: the replay and the servers' counters over it."""
    reset_prefix_caches(servers, spec.model)
    before = [read_counters(s) for s in servers]
    with router_url(router, servers, spec, workdir) as url:
        replay = replay_sessions(
            url, sessions, model=spec.model, timeout_s=timeout_s, label=label, text=not router.token_ids
        )
        result: ReplayResult = asyncio.run(replay)
    return result, [read_counters(s) - b for s, b in zip(servers, before, strict=True)]


def alone_bound(token_ids: Sequence[Session], spec: VllmSpec, timing: PrefillTiming) -> dict[str, float]:
    """What no router can much beat: the hit rate of one LRU cache as large as the fleet's, fed every
    prompt of `token_ids` (sessions as as_token_ids makes them) in its nominal order, and the TTFT
    mean its requests would have at that hit rate with nothing ever ahead of them. Routing can only
    split that cache, and a wait only adds."""
    prompts = [list(turn.prompt) for turn in nominal_order(token_ids)]
    capacity = None if spec.num_blocks is None else spec.num_blocks * spec.count
    hit = lru_hit_rate(prompts, BLOCK_SIZE, capacity)
    uncached = (1.0 - hit) * statistics.fmean(len(p) for p in prompts)
    return {"pooled_hit_rate": hit, "ttft_mean_s": timing.seconds(uncached)}


def row_summary(
    router: Router,
    servers: Sequence[VllmServer],
    rounds: Sequence[tuple[ReplayResult, list[ServerCounters]]],
    timing: PrefillTiming,
) -> dict[str, Any]:
    """A row's rounds as one: the replay summary of their requests pooled, the servers' counters
    summed, each round's TTFT mean and p99 (how far one round is from the next), and the TTFT its
    requests would have had with nothing ahead of them (`timing`: the fleet's), the rest being waits."""
    per_server = zip(*(counters for _, counters in rounds), strict=True)
    served = [sum(counters, ServerCounters(0, 0, 0, 0)) for counters in per_server]
    by_round = [latency_stats([x.ttft_s for x in r.records]) for r, _ in rounds]
    result = pooled([r for r, _ in rounds])
    alone = [timing.seconds(x.prompt_tokens - x.cached_tokens) for x in result.records]
    return {
        **result.summary(),
        "ttft_alone_mean_s": statistics.fmean(alone) if alone else None,
        **server_summary(servers, served),
        "rounds": [{"ttft_mean_s": t["mean"], "ttft_p99_s": t["p99"]} for t in by_round],
        "note": NOTES.get(router.name),
    }


def server_summary(servers: Sequence[VllmServer], served: Sequence[ServerCounters]) -> dict[str, Any]:
    """Per server, from its own counters: requests and prefix-cache hit rate; and for the fleet, the
    hit rate over all prompt tokens and the imbalance (max/mean requests)."""
    requests = [c.requests for c in served]
    queries = sum(c.prefix_queries for c in served)
    total = sum(requests)
    fleet = sum(served, ServerCounters(0, 0, 0, 0))
    # Per request, from vLLM's own histograms: its TTFT, of which queued and prefilling (None where
    # the servers published no TTFT: a sum of 0 is no reading, not an instant first token).
    timed = total and fleet.ttft_s > 0
    return {
        "vllm_ttft_mean_s": fleet.ttft_s / total if timed else None,
        "vllm_queued_mean_s": fleet.queued_s / total if timed else None,
        "vllm_prefill_mean_s": fleet.prefill_s / total if timed else None,
        "servers": {
            s.id: {"requests": c.requests, "prompt_tokens": c.prompt_tokens, "hit_rate": c.hit_rate}
            for s, c in zip(servers, served, strict=True)
        },
        "vllm_hit_rate": sum(c.prefix_hits for c in served) / queries if queries else 0.0,
        "imbalance": max(requests) * len(requests) / total if total else 0.0,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", type=int, default=2, help="vLLM servers, one core each")
    parser.add_argument(
        "--num-blocks", type=int, default=NUM_BLOCKS, help=f"prefix-cache blocks of {BLOCK_SIZE} per server"
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}"
    )
    parser.add_argument(
        "--routers",
        default=None,
        help="comma-separated row names (default: all): " + "; ".join(r.name for r in ROUTERS),
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="replays of every row, the rows' order reversed each round"
    )
    parser.add_argument(
        "--speed",
        type=_speed,
        default=None,
        help="time compression of the workloads; auto (the default): the servers' measured prefill rate "
        f"over the {REFERENCE_PREFILL_TOKENS_S:,.0f} tokens/s they are sized for",
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds per request (divided by a speed below 1)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the workloads' seed: another draws other tenants' prompts, sessions and arrivals, so a peer's "
        "split of the tenants between the servers is drawn again too",
    )
    parser.add_argument("--json", default=None, help="write the results here, and a PNG next to it")
    parser.add_argument(
        "--workdir", default=None, help="where the servers' and routers' logs go (default: a new temp folder)"
    )


def _speed(value: str) -> float | None:
    """--speed: a positive number, or auto (None: set from the servers' prefill rate)."""
    if value == "auto":
        return None
    try:
        speed = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a positive number or auto, got {value!r}") from None
    if not (math.isfinite(speed) and speed > 0):
        raise argparse.ArgumentTypeError(f"a positive number or auto, got {value!r}")
    return speed


def _chosen(args: argparse.Namespace) -> tuple[list[str], list[Router]]:
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    names = {r.name: r for r in ROUTERS}
    wanted = [n.strip() for n in args.routers.split(",")] if args.routers else list(names)
    unknown = [w for w in workloads if w not in WORKLOADS] + [n for n in wanted if n not in names]
    if unknown or not workloads or not wanted:
        raise SystemExit(f"prefixgate bench vllm: unknown or no workloads/routers: {', '.join(unknown)}")
    if args.rounds < 1:
        raise SystemExit(f"prefixgate bench vllm: --rounds must be at least 1, got {args.rounds}")
    return workloads, [names[n] for n in wanted]


# Replayed once before the rows, its result dropped: the first row after the servers start ran
# 10-26 % slower than the next in five runs, whichever router it was (docs/benchmarks.md).
WARM_UP = Router("warm-up: prefixgate round_robin", "round_robin")


def warm_up(
    servers: Sequence[VllmServer],
    spec: VllmSpec,
    workdir: Path,
    workload: str,
    speed: float,
    timeout_s: float,
    seed: int,
) -> float:
    """The first workload replayed through round robin and dropped; returns the seconds it took."""
    start = time.monotonic()
    run_row(WARM_UP, _sessions(workload, speed, seed), servers, spec, workdir, timeout_s, WARM_UP.name)
    return time.monotonic() - start


def workload_params(name: str, seed: int) -> AgentParams | GroupedParams:
    """A workload's parameters drawn with `seed`."""
    return replace(WORKLOADS[name], seed=seed)


def _sessions(name: str, speed: float, seed: int) -> list[Session]:
    params = workload_params(name, seed)
    sessions = agent_sessions(params) if isinstance(params, AgentParams) else grouped_sessions(params)
    return scaled(sessions, speed)


def run(args: argparse.Namespace) -> dict[str, Any]:
    workloads, routers = _chosen(args)
    spec = VllmSpec(count=args.servers, num_blocks=args.num_blocks)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="prefixgate-bench-vllm-"))
    print(f"bench vllm: logs in {workdir}", flush=True)
    results: dict[str, dict[str, Any]] = {w: {} for w in workloads}
    bounds: dict[str, dict[str, float]] = {}
    start = time.monotonic()
    with vllm_fleet(spec, workdir) as servers:
        print(f"bench vllm: {spec.count} vLLM servers up after {time.monotonic() - start:.0f} s", flush=True)
        timings = [prefill_timing(s, spec.model) for s in servers]
        rates = [t.tokens_s for t in timings]
        fleet = PrefillTiming(statistics.fmean(rates), statistics.fmean(t.fixed_s for t in timings))
        speed = args.speed or fleet.tokens_s / REFERENCE_PREFILL_TOKENS_S
        print(
            f"bench vllm: the servers prefill {' and '.join(f'{r:,.0f}' for r in rates)} tokens/s (the "
            f"workloads are sized for {REFERENCE_PREFILL_TOKENS_S:,.0f}): workloads at speed {speed:.3g}",
            flush=True,
        )
        # A request's time stretches with the workload's where the servers are slower.
        timeout_s = args.timeout / min(speed, 1.0)
        warm_up_s = warm_up(servers, spec, workdir, workloads[0], speed, timeout_s, args.seed)
        for workload in workloads:
            words = _sessions(workload, speed, args.seed)
            ids = as_token_ids(words)
            rounds: dict[str, list[tuple[ReplayResult, list[ServerCounters]]]] = {r.name: [] for r in routers}
            for k in range(args.rounds):
                for r, router in enumerate(routers if k % 2 == 0 else routers[::-1]):
                    label = f"{workload} {k + 1}.{r + 1}/{args.rounds}.{len(routers)} {router.name}"
                    sessions = ids if router.token_ids else words
                    row = run_row(router, sessions, servers, spec, workdir, timeout_s, label)
                    rounds[router.name].append(row)
            results[workload] = {r.name: row_summary(r, servers, rounds[r.name], fleet) for r in routers}
            bounds[workload] = alone_bound(ids, spec, fleet)
            table = _tables(workload, results[workload], [s.id for s in servers], bounds[workload], args.seed)
            print(table, flush=True)
    payload = {
        "servers": spec.count,
        "block_size": BLOCK_SIZE,
        "num_blocks": spec.num_blocks,
        "model": spec.model,
        "speed": speed,
        "prefill_tokens_s": rates,
        "prefill_fixed_s": [t.fixed_s for t in timings],
        "rounds": args.rounds,
        "seed": args.seed,
        "workload_params": {w: _params(workload_params(w, args.seed)) for w in workloads},
        "held_out": [w for w in workloads if w in HELD_OUT],
        "results": results,
        "bounds": bounds,
        "notes": {name: note for name, note in NOTES.items() if any(r.name == name for r in routers)},
        "warm_up_s": warm_up_s,
        "elapsed_s": time.monotonic() - start,
    }
    for name, note in payload["notes"].items():
        print(f"note: {name}: {note}")
    if args.json:
        write_json(args.json, payload)
        title = f"{spec.count} vLLM CPU servers (SmolLM2-135M, {spec.num_blocks} blocks of {BLOCK_SIZE})"
        bar_panels(Path(args.json).with_suffix(".png"), title, _panels(results))
    return payload


def _params(params: AgentParams | GroupedParams) -> dict[str, Any]:
    return {field: getattr(params, field) for field in params.__dataclass_fields__}


def _tables(
    workload: str,
    rows: dict[str, dict[str, Any]],
    server_ids: Sequence[str],
    bound: dict[str, float],
    seed: int,
) -> str:
    main = [[name, *comparison_cells(r)] for name, r in rows.items()]
    spread = [
        [
            name,
            *(f"{r['servers'][s]['requests']:.0f} ({r['servers'][s]['hit_rate']:.0%})" for s in server_ids),
            " / ".join("-" if t["ttft_mean_s"] is None else f"{t['ttft_mean_s']:.3f}" for t in r["rounds"]),
        ]
        for name, r in rows.items()
    ]
    waits = [[name, *_wait_cells(r)] for name, r in rows.items()]
    pooled_hit = bound["pooled_hit_rate"]
    held_out = " (held out: no default was tuned on it)" if workload in HELD_OUT else ""
    drawn = f", seed {seed}" if seed else ""
    bound_row = [f"bound: pooled cache (hit {pooled_hit:.3f}), nothing ahead", "-", bound["ttft_mean_s"]]
    waits.append(bound_row + ["-"] * (len(WAIT_COLUMNS) - 2))
    return "\n\n".join(
        [
            format_table(f"bench vllm: {workload}{drawn}{held_out}", ["router", *COMPARISON_COLUMNS], main),
            format_table("requests per server (its prefix-cache hit rate), from vLLM's /metrics",
                         ["router", *server_ids, "TTFT mean s by round"], spread),
            format_table("TTFT mean and where it went: alone, each request's own prefill at the servers' "
                         "timed rate; the rest from vLLM's /metrics", ["router", *WAIT_COLUMNS], waits),
        ]
    )  # fmt: skip


WAIT_COLUMNS = (
    "TTFT s", "alone s", "waited share", "vLLM TTFT s", "in vLLM's queue s", "vLLM prefill s",
    "before vLLM s",
)  # fmt: skip


def _wait_cells(r: dict[str, Any]) -> list[Any]:
    """A row's TTFT mean beside its requests' own prefill, the share beyond it, and vLLM's account of
    it: its own TTFT, of which queued and prefilling, and what came before (the router, the network)."""
    mean, alone, engine = r["ttft_s"]["mean"], r["ttft_alone_mean_s"], r["vllm_ttft_mean_s"]
    if mean is None or alone is None or engine is None:
        return [mean if mean is not None else "-", *["-"] * (len(WAIT_COLUMNS) - 1)]
    share = f"{(mean - alone) / mean:.0%}"
    return [mean, alone, share, engine, r["vllm_queued_mean_s"], r["vllm_prefill_mean_s"], mean - engine]


def _short(name: str) -> str:
    return name.replace("prefixgate ", "pg ").replace("vllm-router ", "vr ").replace(" precise", "")


def _panels(results: dict[str, dict[str, dict[str, Any]]]) -> list[tuple[str, dict[str, float]]]:
    panels = []
    for workload, rows in results.items():
        for title, key, stat in (("TTFT mean s", "ttft_s", "mean"), ("TTFT p99 s", "ttft_s", "p99")):
            values = {_short(n): r[key][stat] for n, r in rows.items() if r[key][stat] is not None}
            panels.append((f"{workload}: {title}", values))
        panels.append((f"{workload}: hit rate", {_short(n): r["hit_rate"] for n, r in rows.items()}))
    return panels
