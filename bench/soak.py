"""`prefixgate bench soak`: steady load for minutes through two gateways sharing Redis, watching for
what only time shows — memory that creeps, an index that grows without bound, errors that start late.

The fleet is real processes from the command line (bench.local_fleet): a private redis-server,
simulated workers publishing their registry entry, KV events and load to it, and two gateways that
find the workers in the registry and follow their KV events over Redis streams. A shared-prefix
workload (bench.replay's) is sent open loop, alternating between the gateways, with small KV pools
so that the workers evict and the gateways' indexes must follow removals as well as stores.

Every few seconds each gateway is sampled: its resident memory (VmRSS from /proc/PID/status), its
index size (`prefixgate_gateway_index_entries`) and its requests by status (from /metrics). The
verdict: no failed request, RSS after the warm-up grows by at most `MAX_RSS_GROWTH_PCT`, and the index
never holds more entries than the workers' pools have blocks (each block once per replica).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.arrivals import shared_prefix_arrivals, shared_prefix_workload
from bench.loadgen import replay
from bench.local_fleet import (
    Child,
    Fleet,
    SimWorkers,
    gateway_config,
    start_gateway,
    start_redis,
    start_worker,
    wait_healthy,
)
from bench.procfs import rss_bytes
from bench.replay_result import ReplayResult
from bench.report import format_table, write_json

GATEWAYS = 2
WORKERS = 3
PROFILE = "h100-8b"
BLOCK_SIZE = 16
# 512 blocks of 16 tokens per worker hold about seven of the workload's 1k-token prefixes: well under
# the workload's distinct blocks, so the workers evict all along and the index sees removals.
NUM_BLOCKS = 512
# 16 system prompts of 1,024 tokens, 32 questions of 64 tokens each, 16 tokens out.
WORKLOAD = (16, 32, 1024, 64, 16)
RATE = 8.0
MINUTES = 10.0
WARMUP_S = 60.0
MAX_RSS_GROWTH_PCT = 5.0
INDEX_METRIC = "prefixgate_gateway_index_entries"
REQUESTS_METRIC = "prefixgate_gateway_requests"
OK, CLIENT_LEFT = "200", "499"
# How long the last sample waits for the gateways to count the requests their clients saw end.
SETTLE_S = 2.0
# Registry heartbeats and load reports fast enough that a short run starts at once.
WORKER_FLAGS = ("--heartbeat", "0.5", "--load-period", "0.1")
MIB = 2**20


@dataclass(slots=True)
class Sample:
    """One gateway at one moment of the run."""

    t_s: float
    gateway: str
    rss_mib: float
    index_entries: int
    # The gateway's requests so far by HTTP status (499: the client left before the end).
    statuses: dict[str, int]

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def errors(self) -> int:
        """Requests the gateway answered with an error. 499s are not among them: the client's own
        count decides those (a client that closes right after `[DONE]`, before the stream's last empty
        chunk, is a 499 to the gateway and a complete answer to itself)."""
        return sum(n for status, n in self.statuses.items() if status not in (OK, CLIENT_LEFT))

    @property
    def client_left(self) -> int:
        return self.statuses.get(CLIENT_LEFT, 0)


@dataclass(slots=True)
class SoakFleet:
    redis: Child
    workers: list[Child]
    gateways: list[Child]

    @property
    def children(self) -> list[Child]:
        return [self.redis, *self.workers, *self.gateways]


# -- measurements ------------------------------------------------------------------------------------


def read_metrics(text: str) -> tuple[int, dict[str, int]]:
    """(index entries, requests by HTTP status) from a gateway's /metrics."""
    index = 0
    statuses: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == INDEX_METRIC:
            index = int(sum(s.value for s in family.samples))
        elif family.name == REQUESTS_METRIC:
            for s in family.samples:
                if s.name.endswith("_total"):
                    status = s.labels.get("status", "")
                    statuses[status] = statuses.get(status, 0) + int(s.value)
    return index, dict(sorted(statuses.items()))


async def sample(session: aiohttp.ClientSession, gateway: Child, t_s: float) -> Sample:
    async with session.get(f"{gateway.url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
        text = await response.text()
    index, statuses = read_metrics(text)
    return Sample(round(t_s, 2), gateway.name, round(rss_bytes(gateway.pid) / MIB, 2), index, statuses)


async def sampler(
    gateways: Sequence[Child], every_s: float, done: asyncio.Event, out: list[Sample], sent: dict[str, int]
) -> None:
    """Samples every `every_s` until `done`, and once more after it (the state at the end). A gateway
    counts a request when the replica's stream ends, a moment after its client has read `[DONE]`: the
    last sample waits (SETTLE_S at most) until each has counted all it was `sent`."""
    start = time.monotonic()
    async with aiohttp.ClientSession() as session:
        while True:
            now = time.monotonic() - start
            last = await asyncio.gather(*(sample(session, g, now) for g in gateways))
            settle = time.monotonic() + SETTLE_S
            while (
                done.is_set()
                and any(s.requests < sent.get(s.gateway, 0) for s in last)
                and time.monotonic() < settle
            ):
                await asyncio.sleep(0.05)
                last = await asyncio.gather(*(sample(session, g, now) for g in gateways))
            out.extend(last)
            print(
                f"  {now:6.0f} s  "
                + "  ".join(f"{s.gateway}: {s.rss_mib:.1f} MiB, {s.index_entries} entries" for s in last),
                flush=True,
            )
            if done.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=every_s)


# -- the fleet ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def soak_fleet(workdir: Path, workers: SimWorkers, gateways: int) -> Iterator[SoakFleet]:
    """A private Redis, `workers` publishing to it and `gateways` that find them in its registry (all
    of them routable when this yields); on the way out gateways and workers are stopped, then Redis."""
    with Fleet(workdir) as running:
        redis = running.add_service(start_redis(workdir / "redis"))
        flags = ("--redis", redis.url, *WORKER_FLAGS)
        started = [running.add(start_worker(workdir, workers, f"w{i}", *flags)) for i in range(workers.count)]
        redis_section = {"url": redis.url, "poll_interval_s": 0.2}
        configs = {
            f"gateway-g{i}": gateway_config(
                workers.model, [], "prefix_aware", redis=redis_section, gateway_id=f"soak-g{i}"
            )
            for i in range(gateways)
        }
        fronts = [running.add(start_gateway(workdir, name, config)) for name, config in configs.items()]
        wait_healthy([redis, *started, *fronts], routable={g.name: len(started) for g in fronts})
        yield SoakFleet(redis, started, fronts)


# -- the verdict -------------------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def gateway_summary(samples: Sequence[Sample], warmup_s: float) -> dict[str, Any]:
    """RSS at the end of the warm-up against RSS at the end (each the median of a few samples, so one
    allocator hiccup does not decide), with the least-squares trend after the warm-up; index range."""
    after = [s for s in samples if s.t_s >= warmup_s] or list(samples[-1:])
    span = 3
    warm = _median([s.rss_mib for s in after[:span]])
    end = _median([s.rss_mib for s in after[-span:]])
    minutes = [s.t_s / 60 for s in after]
    rss = [s.rss_mib for s in after]
    slope = (
        statistics.linear_regression(minutes, rss).slope
        if len(after) >= 2 and minutes[-1] > minutes[0]
        else 0.0
    )
    last = samples[-1]
    return {
        "rss_start_mib": samples[0].rss_mib,
        "rss_warm_mib": round(warm, 2),
        "rss_end_mib": round(end, 2),
        "rss_max_mib": max(s.rss_mib for s in samples),
        "rss_growth_pct": round(100 * (end - warm) / warm, 2) if warm else 0.0,
        "rss_trend_mib_per_min": round(slope, 3),
        "index_min": min(s.index_entries for s in after),
        "index_max": max(s.index_entries for s in samples),
        "index_end": last.index_entries,
        "requests": last.requests,
        "errors": last.errors,
        "client_left": last.client_left,
        "statuses": last.statuses,
    }


def verdict(summary: dict[str, Any]) -> dict[str, bool]:
    gateways = summary["gateways"].values()
    return {
        "no errors": summary["errors"] == 0 and all(g["errors"] == 0 for g in gateways),
        f"RSS growth <= {MAX_RSS_GROWTH_PCT:g} %": all(
            g["rss_growth_pct"] <= MAX_RSS_GROWTH_PCT for g in gateways
        ),
        "index bounded": all(g["index_max"] <= summary["index_bound"] for g in gateways),
    }


def tables(p: dict[str, Any]) -> str:
    title = (
        f"soak: {p['minutes']:g} min, {p['rate']:g} req/s through {len(p['gateways'])} gateways over "
        f"{p['workers']} simulated workers (Redis), shared prefix {p['workload']}, "
        f"warm-up {p['warmup_s']:g} s"
    )
    header = [
        "gateway", "requests", "errors", "499", "RSS start MiB", "RSS warm MiB", "RSS end MiB", "growth %",
        "trend MiB/min", "index min", "index max", "index bound",
    ]  # fmt: skip
    rows = [
        [
            name,
            g["requests"],
            g["errors"],
            g["client_left"],
            g["rss_start_mib"],
            g["rss_warm_mib"],
            g["rss_end_mib"],
            g["rss_growth_pct"],
            g["rss_trend_mib_per_min"],
            g["index_min"],
            g["index_max"],
            p["index_bound"],
        ]
        for name, g in p["gateways"].items()
    ]
    client = p["client"]
    errors = ", ".join(f"{k}={v}" for k, v in client["errors"].items()) or "0"
    totals = [[client["sent"], client["completed"], errors, client["hit_rate"], client["ttft_p99_s"]]]
    checks = [[name, "yes" if ok else "NO"] for name, ok in p["verdict"].items()]
    return "\n\n".join(
        [
            format_table(title, header, rows),
            format_table("client side", ["sent", "completed", "errors", "hit rate", "TTFT p99 s"], totals),
            format_table("verdict", ["check", "held"], checks),
        ]
    )


def plot(path: Path, title: str, samples: Sequence[Sample], warmup_s: float, bound: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rss_ax, index_ax) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for name in sorted({s.gateway for s in samples}):
        mine = [s for s in samples if s.gateway == name]
        minutes = [s.t_s / 60 for s in mine]
        rss_ax.plot(minutes, [s.rss_mib for s in mine], label=name)
        index_ax.plot(minutes, [s.index_entries for s in mine], label=name)
    for ax in (rss_ax, index_ax):
        ax.axvline(warmup_s / 60, color="gray", linestyle=":", label="end of warm-up")
        ax.grid(alpha=0.3)
    index_ax.axhline(bound, color="tab:red", linestyle="--", label="bound: blocks in the workers' pools")
    rss_ax.set_ylabel("RSS MiB")
    index_ax.set_ylabel("index entries")
    index_ax.set_xlabel("minutes")
    rss_ax.legend(fontsize=8)
    index_ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the run -----------------------------------------------------------------------------------------


async def drive(
    gateways: Sequence[Child], arrivals: list[Any], every_s: float, timeout_s: float
) -> tuple[list[ReplayResult], list[Sample]]:
    """The arrivals alternately through each gateway (open loop, one schedule), sampled meanwhile."""
    samples: list[Sample] = []
    done = asyncio.Event()
    sent: dict[str, int] = {}
    watch = asyncio.create_task(sampler(gateways, every_s, done, samples, sent))
    try:
        results = await asyncio.gather(
            *(
                replay(g.url, arrivals[i :: len(gateways)], progress=False, timeout_s=timeout_s)
                for i, g in enumerate(gateways)
            )
        )
        sent.update({g.name: r.sent for g, r in zip(gateways, results, strict=True)})
    finally:
        done.set()
        await watch
    return list(results), samples


def soak(args: argparse.Namespace) -> dict[str, Any]:
    duration_s = args.minutes * 60
    warmup_s = args.warmup_s if args.warmup_s is not None else min(WARMUP_S, duration_s / 5)
    every_s = args.sample_s if args.sample_s is not None else min(5.0, max(duration_s / 60, 0.5))
    prompts = shared_prefix_workload(*args.workload, seed=args.seed)
    arrivals = shared_prefix_arrivals(prompts, args.rate, duration_s, args.seed)
    workers = SimWorkers(args.workers, PROFILE, BLOCK_SIZE, args.num_blocks)
    with (
        tempfile.TemporaryDirectory(prefix="prefixgate-soak-") as tmp,
        soak_fleet(Path(tmp), workers, args.gateways) as fleet,
    ):
        print(
            f"soak: {len(arrivals)} requests over {duration_s:g} s, sampling every {every_s:g} s", flush=True
        )
        results, samples = asyncio.run(drive(fleet.gateways, arrivals, every_s, args.timeout))
        failed = [c for c in fleet.children if c.proc.poll() is not None]
        if failed:
            raise RuntimeError(f"{failed[0].name} died during the soak:\n{failed[0].log_tail()}")
    per_gateway = {
        g: gateway_summary([s for s in samples if s.gateway == g], warmup_s)
        for g in sorted({s.gateway for s in samples})
    }
    records = [r for result in results for r in result.records]
    errors: dict[str, int] = {}
    for result in results:
        for kind, n in result.errors.items():
            errors[kind] = errors.get(kind, 0) + n
    prompt_tokens = sum(r.prompt_tokens for r in records)
    ttfts = sorted(r.ttft_s for r in records)
    client = {
        "sent": sum(r.sent for r in results),
        "completed": len(records),
        "errors": dict(sorted(errors.items())),
        "hit_rate": round(sum(r.cached_tokens for r in records) / prompt_tokens, 4) if prompt_tokens else 0.0,
        "ttft_p99_s": round(ttfts[int(0.99 * (len(ttfts) - 1))], 4) if ttfts else None,
        "per_gateway": {g.name: r.sent for g, r in zip(fleet.gateways, results, strict=True)},
    }
    payload: dict[str, Any] = {
        "minutes": args.minutes,
        "rate": args.rate,
        "workload": ",".join(map(str, args.workload)),
        "workers": args.workers,
        "num_blocks": args.num_blocks,
        "warmup_s": warmup_s,
        "sample_s": every_s,
        "index_bound": args.workers * args.num_blocks,
        "requests": client["sent"],
        "errors": sum(errors.values()),
        "client": client,
        "gateways": per_gateway,
        "samples": [asdict(s) for s in samples],
    }
    payload["verdict"] = verdict(payload)
    payload["passed"] = all(payload["verdict"].values())
    return payload


def _shape(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if len(values) != 5 or min(values) < 1:
        raise argparse.ArgumentTypeError("expected five positive integers G,P,S,Q,O")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=MINUTES, help="how long to send (default 10)")
    parser.add_argument("--json", default=None, help="write the summary here, and a PNG next to it")
    parser.add_argument("--rate", type=float, default=RATE, help="requests/s in all, Poisson")
    parser.add_argument(
        "--workload",
        type=_shape,
        default=WORKLOAD,
        metavar="G,P,S,Q,O",
        help="G groups of P questions: S system tokens, Q question tokens, O output tokens",
    )
    parser.add_argument("--gateways", type=int, default=GATEWAYS)
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--num-blocks", type=int, default=NUM_BLOCKS, help="KV blocks per worker")
    parser.add_argument("--warmup-s", type=float, default=None, help="default: min(60 s, a fifth of the run)")
    parser.add_argument("--sample-s", type=float, default=None, help="default: the run / 60, 0.5 to 5 s")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.minutes <= 0 or args.gateways < 1 or args.workers < 1:
        raise SystemExit("prefixgate bench soak: --minutes, --gateways and --workers must be positive")
    payload = soak(args)
    print(tables(payload))
    if args.json:
        write_json(args.json, payload)
        title = (
            f"soak: {payload['minutes']:g} min at {payload['rate']:g} req/s, "
            f"{len(payload['gateways'])} gateways sharing Redis"
        )
        plot(Path(args.json).with_suffix(".png"), title, [Sample(**s) for s in payload["samples"]],
             payload["warmup_s"], payload["index_bound"])  # fmt: skip
    return payload
