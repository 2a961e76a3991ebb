"""Hot-path speed of the routing core, each beside a naive implementation measured in the same run.

- hashing an 8,192-token prompt at block_size 16 (radix.hashing vs per-block struct packing);
- matching it against an index of 1,000,000 (block, replica) entries over 16 replicas
  (RadixIndex vs a set per replica walked one by one);
- one prefix_aware routing decision over 16 replicas (vs round_robin's);
- memory per (block, replica) entry, traced with tracemalloc;
- new prompts' predictions inserted into an index held at its entry bound (4 learning replicas, the
  least recently used evicted for every new block): the mean and the worst insert, beside the same
  index with its expiry rows rebuilt whole past twice the live entries (as they were before they were
  trimmed from the top), whose rebuilds stall every request for about a second per million entries.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import struct
import time
import tracemalloc
from collections.abc import Callable

import numpy as np
import xxhash
from tqdm import tqdm

from bench.report import bar_panels, format_table, write_json
from policies import ReplicaView, RouteRequest, RoutingConfig, build_policy
from radix import RadixIndex, block_hashes, root_hash


def naive_block_hashes(tokens: list[int], block_size: int, model: str) -> list[int]:
    h = root_hash(model)
    out = []
    for i in range(0, len(tokens) // block_size * block_size, block_size):
        hasher = xxhash.xxh3_64()
        hasher.update(struct.pack("<Q", h))
        for t in tokens[i : i + block_size]:
            hasher.update(struct.pack("<I", t))
        h = hasher.intdigest()
        out.append(h)
    return out


def naive_match(sets: dict[str, set[int]], hashes: list[int]) -> dict[str, int]:
    result = {}
    for rid, held in sets.items():
        depth = 0
        for h in hashes:
            if h not in held:
                break
            depth += 1
        if depth:
            result[rid] = depth
    return result


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def build_fleet_index(
    entries: int, replicas: int, query: list[int], rng: random.Random
) -> tuple[RadixIndex, dict[str, set[int]]]:
    """An index of about `entries` (block, replica) pairs: per replica, random 512-block chains, with
    the query's chain held whole by a quarter of the replicas and half of it by the rest, so that
    every match walks the full prompt."""
    index = RadixIndex()
    sets: dict[str, set[int]] = {}
    chain = len(query)
    per_replica = entries // replicas
    for i in tqdm(range(replicas), desc="building index", leave=False):
        rid = f"r{i}"
        index.add_replica(rid)
        held = query if i % 4 == 0 else query[: chain // 2]
        index.insert(rid, held)
        sets[rid] = set(held)
        while index.blocks_of(rid) < per_replica:
            blocks = [rng.getrandbits(64) for _ in range(min(chain, per_replica - index.blocks_of(rid)))]
            index.insert(rid, blocks)
            sets[rid].update(blocks)
    return index, sets


def bytes_per_entry(entries: int, replicas: int, query: list[int]) -> float:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index, _ = build_fleet_index(entries, replicas, query, random.Random(1))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / len(index)


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    tokens = [rng.randrange(49152) for _ in range(args.prompt_tokens)]
    rows = []
    results: dict[str, dict[str, float]] = {}

    def compare(name: str, ours: Callable[[], object], naive: Callable[[], object], repeats: int) -> None:
        # Interleave the two so that machine noise hits both alike.
        a, b = [], []
        for _ in range(repeats):
            a += timed(ours, 1)
            b += timed(naive, 1)
        p50, p99 = statistics.median(a), sorted(a)[int(0.99 * (len(a) - 1))]
        n50 = statistics.median(b)
        results[name] = {
            "p50_ms": p50 * 1e3,
            "p99_ms": p99 * 1e3,
            "baseline_p50_ms": n50 * 1e3,
            "speedup": n50 / p50,
        }
        rows.append([name, p50 * 1e3, p99 * 1e3, n50 * 1e3, n50 / p50])

    assert block_hashes(tokens, 16, "bench") == naive_block_hashes(tokens, 16, "bench")
    compare(
        f"hash {len(tokens)} tokens, list input (bs 16)",
        lambda: block_hashes(tokens, 16, "bench"),
        lambda: naive_block_hashes(tokens, 16, "bench"),
        args.repeats,
    )

    as_array = np.array(tokens, dtype=np.uint32)
    assert block_hashes(as_array, 16, "bench") == naive_block_hashes(tokens, 16, "bench")
    compare(
        f"hash {len(tokens)} tokens, numpy input (bs 16)",
        lambda: block_hashes(as_array, 16, "bench"),
        lambda: naive_block_hashes(tokens, 16, "bench"),
        args.repeats,
    )

    query = block_hashes(tokens, 16, "bench")
    per_entry = bytes_per_entry(args.memory_entries, args.replicas, query)
    index, sets = build_fleet_index(args.index_entries, args.replicas, query, rng)
    assert index.match(query) == naive_match(sets, query)
    compare(
        f"match vs {len(index):,} entries",
        lambda: index.match(query),
        lambda: naive_match(sets, query),
        args.repeats,
    )

    depth = index.match(query)
    views = [
        ReplicaView(
            id=f"r{i}",
            matched_blocks=depth.get(f"r{i}", 0),
            running=rng.randrange(8),
            waiting=rng.randrange(4),
            queued_prefill_tokens=rng.randrange(20_000),
        )
        for i in range(args.replicas)
    ]
    request = RouteRequest(prompt_tokens=len(tokens), prefix_key=query[0])
    aware = build_policy(RoutingConfig(policy="prefix_aware"))
    rr = build_policy(RoutingConfig(policy="round_robin"))
    compare(
        f"prefix_aware decision ({args.replicas} replicas)",
        lambda: aware.choose(request, views),
        lambda: rr.choose(request, views),
        args.repeats,
    )
    results["memory"] = {"bytes_per_entry": per_entry, "entries_traced": args.memory_entries}
    bound_rows = []
    for name, kind in (("trimmed rows", RadixIndex), ("rows rebuilt whole", _RebuiltWhole)):
        times = sorted(at_the_bound(kind(args.bound_entries), args.bound_prompts, 4, 20))
        row = {
            "mean_us": statistics.fmean(times) * 1e6,
            "p99_us": times[int(0.99 * (len(times) - 1))] * 1e6,
            "worst_ms": times[-1] * 1e3,
        }
        results[f"at the bound, {name}"] = row
        bound_rows.append([name, row["mean_us"], row["p99_us"], row["worst_ms"]])
    print(
        format_table(
            "routing core hot paths (baseline: hashing by struct per token, match by a set per replica,"
            " decision by round_robin)",
            ["path", "p50 ms", "p99 ms", "baseline p50 ms", "baseline/ours"],
            rows,
        )
    )
    print(
        format_table(
            f"a new 20-block prompt inserted at a {args.bound_entries:,}-entry bound "
            f"({args.bound_prompts:,} prompts, 4 learning replicas)",
            ["expiry rows", "mean µs", "p99 µs", "worst ms"],
            bound_rows,
        )
    )
    print(
        f"memory: {per_entry:.0f} bytes per (block, replica) entry "
        f"(tracemalloc over {args.memory_entries:,} entries)"
    )
    if args.json:
        write_json(args.json, results)
    plot = args.plot or (args.json and args.json.rsplit(".", 1)[0] + ".png")
    if plot:
        bar_panels(
            plot,
            "routing core hot paths: p50 ms, ours vs baseline",
            [
                (name, {"ours": r["p50_ms"], "baseline": r["baseline_p50_ms"]})
                for name, r in results.items()
                if "p50_ms" in r
            ],
        )
        print(f"plot: {plot}")
    return results


class _RebuiltWhole(RadixIndex):
    """The index as it kept its expiry rows before they were trimmed: rebuilt whole, only."""

    def _trim_deadlines(self, budget: int) -> None:
        return None


def at_the_bound(index: RadixIndex, prompts: int, replicas: int, blocks: int) -> list[float]:
    """Seconds per insert of `prompts` new prompts of `blocks` blocks, round robin over `replicas`
    learning replicas, once `index` is full. The collector is off while they are timed: its pauses are
    the gateway's own concern (gateway.collector)."""
    rng = random.Random(1)
    names = [f"r{i}" for i in range(replicas)]
    for name in names:
        index.add_replica(name, learn=True)
    assert index.max_entries is not None
    fill = index.max_entries // blocks + 1
    seconds = []
    gc.disable()
    try:
        for n in tqdm(range(fill + prompts), desc=f"inserts at a {index.max_entries:,}-entry bound"):
            hashes = [rng.getrandbits(63) for _ in range(blocks)]
            start = time.perf_counter()
            index.insert(names[n % replicas], hashes, expires_at=1e9 + n / 1e3)
            if n >= fill:
                seconds.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--index-entries", type=int, default=1_000_000)
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--memory-entries", type=int, default=200_000)
    parser.add_argument(
        "--bound-entries", type=int, default=1_000_000, help="the entry bound of the at-the-bound inserts"
    )
    parser.add_argument(
        "--bound-prompts", type=int, default=120_000, help="new 20-block prompts timed at the bound"
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
