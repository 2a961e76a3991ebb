"""`prefixgate bench chaos` (`make chaos`): the fault scenarios of tests/faults as one quick exercise on
real processes, with a results table.

Each scenario starts a fleet of its own — simulated workers, gateways and, where it needs one, a
private redis-server — as child processes from the `prefixgate` command line (as bench.local_fleet
does), drives it with client traffic, injects one fault, removes it, and reports the requests sent,
how many succeeded and failed, the slowest answer, how long the fleet took to be whole again once the
fault was gone, and whether every check held:

- replica_killed: one of two workers is SIGKILLed under steady load, then restarted on its port.
  Requests that had sent nothing are retried on the survivor; the restarted worker rejoins.
- redis_down: two gateways and two workers share one Redis, which is SIGKILLed under load and
  restarted empty on its port. The gateways route on their local index meanwhile (degraded, no
  request lost), then reconnect; the workers re-register.
- overload: a burst of concurrent requests on narrow workers (2 running + 2 waiting each) behind a
  gateway with a small `limits.max_inflight`: every answer is a 200 or a 429 with Retry-After (never a
  5xx), and the gateway's resident memory grows by less than a stated bound.
- disconnect_storm: 500 clients start streams through the gateway and all drop mid-stream: every
  upstream sequence is aborted (the workers' running, waiting and referenced KV blocks back to 0)
  and the gateway holds no request any more.
- stuck_upstream: one worker is SIGSTOPped under load: no request waits past the gateway's
  `limits.request_timeout_s`, the worker is marked unhealthy and traffic moves to the other; after
  SIGCONT it is routable again.
- streams_replica_killed: a streaming grouped replay over four workers, one SIGKILLed and restarted
  mid-replay, with bundled workers and with the same workers declared foreign: no stream is truncated
  (one whose worker died mid-answer is continued on another, gateway.forward.migration) and none fails.

The helpers (processes, traffic, bursts, storms) are shared with tests/faults, which make the same
faults with finer checks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import redis
import yaml

from bench.local_fleet import Child, cli, free_port, spawn, start_redis, stop
from bench.report import bar_panels, format_table, write_json
from protocol.redis_keys import WORKERS, worker_key
from workers.sim.profiles import get_profile, profile_to_json

MODEL = "Llama-3.1-8B-Instruct"  # the h100-8b profile's model, which every worker here serves
BLOCK_SIZE = 16
START_TIMEOUT_S = 120.0
# How often a condition is polled: finer than any recovery time worth reporting.
POLL_S = 0.05


# -- processes ---------------------------------------------------------------------------------------


def sim_profile(
    workdir: Path, name: str, *, step_s: float | None = None, max_num_seqs: int | None = None
) -> str:
    """h100-8b with 16-token blocks, optionally a larger fixed cost per step (`step_s`: slow steps keep
    streams going long enough to cut) and a narrower batch (`max_num_seqs`: a queue that fills); the
    path of its JSON, for `--sim-profile`."""
    profile = get_profile("h100-8b")
    changes: dict[str, Any] = {"name": name, "block_size": BLOCK_SIZE}
    if max_num_seqs is not None:
        changes["max_num_seqs"] = max_num_seqs
    if step_s is not None:
        changes["cost"] = dataclasses.replace(profile.cost, step_s=step_s)
    path = workdir / f"{name}.json"
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile_to_json(dataclasses.replace(profile, **changes))))
    return str(path)


def start_worker(
    workdir: Path, worker_id: str, *flags: str, port: int | None = None, profile: str = "h100-8b"
) -> Child:
    """A simulated worker (`prefixgate worker --sim`), 16-token blocks; `flags` go last and win."""
    port = port or free_port()
    command = cli(
        "worker", "--sim", "--sim-profile", profile, "--block-size", str(BLOCK_SIZE), "--num-blocks", "2048",
        "--id", worker_id, "--port", str(port), "--log-level", "WARNING", *flags,
    )  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    return spawn(f"worker-{worker_id}", command, f"http://127.0.0.1:{port}", workdir)


def gateway_config(urls: Sequence[str], **sections: Any) -> dict[str, Any]:
    """A gateway over `urls` that routes the token-id prompts sent here (no tokenizer to load), with
    fast health checks; `sections` replace whole top-level sections."""
    return {
        "model": MODEL,
        "models": {MODEL: {"tokenizer": "none"}},
        "replicas": [{"url": u} for u in urls],
        "health": {"interval_s": 0.2, "timeout_s": 0.5, "failures": 2, "load_interval_s": 0.05},
        **sections,
    }


def start_gateway(workdir: Path, name: str, config: dict[str, Any]) -> Child:
    """`prefixgate serve` on a free port with `config` (its `listen` is set here)."""
    port = free_port()
    path = workdir / f"{name}.yaml"
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({**config, "listen": {"host": "127.0.0.1", "port": port}}))
    command = cli("serve", "--config", str(path), "--log-level", "WARNING")
    return spawn(name, command, f"http://127.0.0.1:{port}", workdir)


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str) -> float:
    """Poll `condition` until it is true; the seconds that took, or TimeoutError naming `what`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(POLL_S)
    return time.monotonic() - start


def get_json(url: str, timeout_s: float = 1.0) -> Any:
    """The JSON body of GET `url` whatever its status, or None when nothing answered."""
    try:
        return httpx.get(url, timeout=timeout_s).json()
    except (httpx.HTTPError, ValueError):
        return None


def wait_ready(children: Sequence[Child], timeout_s: float = START_TIMEOUT_S) -> None:
    """Until every child answers /health (a gateway: with every replica it lists routable)."""

    def ready(child: Child) -> bool:
        if child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited with {child.proc.returncode}:\n{child.log_tail()}")
        health = get_json(f"{child.url}/health")
        if not isinstance(health, dict) or health.get("status") not in ("ok", "degraded"):
            return False
        replicas = health.get("replicas")
        return not isinstance(replicas, dict) or replicas["routable"] == replicas["total"] > 0

    try:
        wait_until(lambda: all(ready(c) for c in children), timeout_s, "the fleet to start")
    except TimeoutError as error:
        late = next((c for c in children if not ready(c)), children[0])
        raise RuntimeError(f"{late.name} at {late.url} did not come up:\n{late.log_tail()}") from error


def rss_bytes(pid: int) -> int:
    """Resident memory of a process now (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def metric(url: str, name: str) -> float | None:
    """One unlabelled sample of a Prometheus text page, or None."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


# -- traffic -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request: when it left (monotonic), how long its answer took, and what it was."""

    start: float
    latency_s: float
    # HTTP status; 0 when no answer came (connection failure, client timeout).
    status: int
    replica: str | None = None
    retry_after: str | None = None
    # OpenAI error code of a refusal, or the client-side exception.
    error: str | None = None


def completion(prompt: Sequence[int], max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": list(prompt), "max_tokens": max_tokens, "ignore_eos": True, **extra}


def family_prompt(i: int, families: int = 6, prefix_tokens: int = 64, tail_tokens: int = 40) -> list[int]:
    """A prompt sharing one of `families` prefixes, with a tail of its own: routing has prefixes to
    follow and the workers keep storing (and evicting) blocks, so KV events keep flowing."""
    family = i % families
    prefix = [1000 + 97 * family + t for t in range(prefix_tokens)]
    # Ids below 49,152 (SmolLM2's vocabulary, which gateways that tokenize check them against).
    return prefix + [20_000 + (i * tail_tokens + t) % 29_000 for t in range(tail_tokens)]


def _outcome(start: float, status: int, headers: Mapping[str, str], payload: bytes) -> Outcome:
    """What an answer was, from either client (httpx in the traffic threads, aiohttp in bursts); a
    refusal named by its OpenAI error code, or by the start of its body when it has none."""
    error = None
    if status != 200:
        try:
            error = json.loads(payload)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            error = payload[:80].decode(errors="replace")
    return Outcome(
        start,
        time.monotonic() - start,
        status,
        headers.get("x-prefixgate-replica"),
        headers.get("Retry-After"),
        error,
    )


class Traffic:
    """Steady closed-loop load: `concurrency` threads sending completions in turn to `targets` (base
    URLs) until stopped, each waiting for its answer; every request's Outcome is kept."""

    def __init__(
        self,
        targets: Sequence[str],
        body: Callable[[int], dict[str, Any]] = lambda i: completion(family_prompt(i)),
        *,
        concurrency: int = 2,
        timeout_s: float = 30.0,
        pause_s: float = 0.01,
    ) -> None:
        self.targets = list(targets)
        self.body = body
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.pause_s = pause_s
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._count = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Traffic:
        for n in range(self.concurrency):
            thread = threading.Thread(target=self._loop, name=f"traffic-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout_s + 5)

    def _next(self) -> int:
        with self._lock:
            self._count += 1
            return self._count

    def _loop(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                i = self._next()
                target = self.targets[i % len(self.targets)]
                start = time.monotonic()
                try:
                    answer = client.post(f"{target}/v1/completions", json=self.body(i))
                    outcome = _outcome(start, answer.status_code, answer.headers, answer.content)
                except httpx.HTTPError as error:
                    outcome = Outcome(start, time.monotonic() - start, 0, error=repr(error))
                self.outcomes.append(outcome)
                self._stop.wait(self.pause_s)

    def between(self, start: float, end: float = float("inf")) -> list[Outcome]:
        return [o for o in list(self.outcomes) if start <= o.start < end]

    def wait_for_requests(self, count: int, timeout_s: float = 30.0) -> None:
        wait_until(lambda: len(self.outcomes) >= count, timeout_s, f"{count} requests")


async def burst(
    url: str, bodies: Sequence[dict[str, Any]], timeout_s: float = 60.0, spacing_s: float = 0.0
) -> list[Outcome]:
    """Every body sent at once (or `spacing_s` apart, all in flight together), each on a connection of
    its own; one Outcome each, in order."""

    async def one(session: aiohttp.ClientSession, body: dict[str, Any], delay_s: float) -> Outcome:
        await asyncio.sleep(delay_s)
        start = time.monotonic()
        try:
            async with session.post(f"{url}/v1/completions", json=body) as response:
                return _outcome(start, response.status, response.headers, await response.read())
        except (aiohttp.ClientError, TimeoutError) as error:
            return Outcome(start, time.monotonic() - start, 0, error=repr(error))

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return list(await asyncio.gather(*(one(session, b, i * spacing_s) for i, b in enumerate(bodies))))


@dataclass(slots=True)
class Storm:
    """What a disconnect storm did: clients whose stream started (and which then dropped it), and the
    statuses of those that got no stream."""

    clients: int
    streaming: int = 0
    refused: Counter[int] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    # Monotonic time at which the clients dropped their streams.
    dropped_at: float = 0.0
    # Slowest first chunk among the streams that started.
    max_first_chunk_s: float = 0.0
    # What `before_drop` returned, called with every stream started.
    at_peak: Any = None


async def disconnect_storm_clients(
    url: str,
    bodies: Sequence[dict[str, Any]],
    hold_timeout_s: float = 30.0,
    before_drop: Callable[[], Any] | None = None,
) -> Storm:
    """Each body is sent as a streaming request by a client of its own; every client that gets its
    first chunk holds its stream until all have answered (or `hold_timeout_s`), then (after
    `before_drop()`, run in a thread) all of them drop their connections at once, mid-stream."""
    storm = Storm(len(bodies))
    answered = 0
    everyone = asyncio.Event()
    drop = asyncio.Event()

    def settled() -> None:
        nonlocal answered
        answered += 1
        if answered == len(bodies):
            everyone.set()

    async def one(session: aiohttp.ClientSession, body: dict[str, Any]) -> None:
        start = time.monotonic()
        try:
            response = await session.post(f"{url}/v1/completions", json={**body, "stream": True})
        except (aiohttp.ClientError, TimeoutError) as error:
            storm.errors.append(repr(error))
            settled()
            return
        try:
            if response.status != 200:
                storm.refused[response.status] += 1
                await response.read()
                settled()
                return
            await response.content.readany()
            storm.max_first_chunk_s = max(storm.max_first_chunk_s, time.monotonic() - start)
            storm.streaming += 1
            settled()
            await drop.wait()
        except (aiohttp.ClientError, TimeoutError) as error:
            storm.errors.append(repr(error))
            settled()
        finally:
            response.close()  # mid-stream: the connection is cut, not returned to a pool

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        clients = [asyncio.create_task(one(session, b)) for b in bodies]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(everyone.wait(), hold_timeout_s)
        if before_drop is not None:
            storm.at_peak = await asyncio.to_thread(before_drop)
        storm.dropped_at = time.monotonic()
        drop.set()
        await asyncio.gather(*clients)
    return storm


# -- scenarios ---------------------------------------------------------------------------------------

# The gateway's per-request timeout in the stuck-upstream scenario, and the slack a loaded 2-core
# machine gets on top of any bound measured here.
REQUEST_TIMEOUT_S = 2.0
SLACK_S = 1.5
# Growth of the gateway's resident memory allowed for one overload burst.
BURST_RSS_BOUND = 64 * 2**20
MIB = 2**20


@dataclass(slots=True)
class ScenarioResult:
    scenario: str
    requests: int = 0
    # Answered 200 (a stream: started, then dropped by its client as planned).
    succeeded: int = 0
    # Refused for overload the specified way: 429 with Retry-After and OpenAI's error JSON.
    refused: int = 0
    # Anything else: 5xx, no answer, a 429 without Retry-After.
    failed: int = 0
    max_latency_s: float = 0.0
    # Seconds from the fault's removal until the fleet was whole again; None if it never was.
    recovered_s: float | None = None
    checks: dict[str, bool] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.checks) and all(self.checks.values())

    def count(self, outcomes: Sequence[Outcome]) -> None:
        self.requests += len(outcomes)
        for o in outcomes:
            if o.status == 200:
                self.succeeded += 1
            elif o.status == 429 and o.retry_after:
                self.refused += 1
            else:
                self.failed += 1
        self.max_latency_s = max([self.max_latency_s, *(o.latency_s for o in outcomes)])

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "passed": self.passed}


class Fleet(contextlib.ExitStack):
    """What a scenario started, all stopped on exit (SIGCONT first, for one left stopped): workers and
    gateways first, then the services they use (a redis-server), so that workers leave the registry
    cleanly."""

    def __init__(self, workdir: Path) -> None:
        super().__init__()
        self.workdir = workdir
        self.children: list[Child] = []
        self.services: list[Child] = []
        self.callback(self._stop_all)

    def add(self, child: Child) -> Child:
        self.children.append(child)
        return child

    def add_service(self, child: Child) -> Child:
        self.services.append(child)
        return child

    def _stop_all(self) -> None:
        for child in self.children:
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGCONT)
        stop(self.children)
        stop(self.services)


def replicas(gateway_url: str) -> dict[str, dict[str, Any]]:
    """The gateway's replicas by id, as /admin/replicas lists them (empty if it does not answer)."""
    listing = get_json(f"{gateway_url}/admin/replicas")
    rows = listing.get("replicas", []) if isinstance(listing, dict) else []
    return {row["id"]: row for row in rows}


def routable(gateway_url: str, replica: str) -> bool:
    row = replicas(gateway_url).get(replica)
    return row is not None and row["healthy"] and not row["draining"]


def unhealthy(gateway_url: str, replica: str) -> bool:
    row = replicas(gateway_url).get(replica)
    return row is not None and not row["healthy"]


def _served_by(outcomes: Sequence[Outcome]) -> set[str]:
    return {o.replica for o in outcomes if o.replica is not None}


def replica_killed(workdir: Path) -> ScenarioResult:
    """SIGKILL one of two workers under steady load, restart it on its port."""
    result = ScenarioResult("replica_killed")
    with Fleet(workdir) as fleet:
        ports = {"k0": free_port(), "k1": free_port()}
        workers = {rid: fleet.add(start_worker(workdir, rid, port=p)) for rid, p in ports.items()}
        config = gateway_config([w.url for w in workers.values()], routing={"policy": "round_robin"})
        gateway = fleet.add(start_gateway(workdir, "gateway", config))
        wait_ready(fleet.children)
        with Traffic(
            [gateway.url], lambda i: completion(family_prompt(i), max_tokens=60), concurrency=4
        ) as t:
            t.wait_for_requests(12)
            workers["k0"].proc.kill()
            killed = time.monotonic()
            left_s = wait_until(lambda: unhealthy(gateway.url, "k0"), 10, "k0 to leave the rotation")
            time.sleep(1.0)
            restarted = time.monotonic()
            workers["k0"] = fleet.add(start_worker(workdir, "k0", port=ports["k0"]))
            result.recovered_s = wait_until(lambda: routable(gateway.url, "k0"), 60, "k0 to rejoin")
            t.wait_for_requests(len(t.outcomes) + 12)
        result.count(t.outcomes)
        result.checks = {
            "no request failed": result.failed == result.refused == 0,
            "left the rotation within 2 s": left_s < 2.0,
            "only the survivor served while it was down": _served_by(t.between(killed + left_s, restarted))
            == {"k1"},
            "the restarted worker serves again": "k0"
            in _served_by(t.between(restarted + result.recovered_s)),
        }
        result.details = {"left_rotation_after_s": round(left_s, 3), "recovered_includes": "worker start-up"}
    return result


def redis_down(workdir: Path) -> ScenarioResult:
    """Two gateways and two workers on one Redis; SIGKILL Redis under load, restart it empty."""
    result = ScenarioResult("redis_down")
    with Fleet(workdir) as fleet:
        port = free_port()
        url = f"redis://127.0.0.1:{port}/0"
        server = fleet.add_service(start_redis(workdir / "redis", port))
        flags = ("--redis", url, "--heartbeat", "0.2", "--load-period", "0.05")
        workers = [fleet.add(start_worker(workdir, f"r{i}", *flags)) for i in range(2)]
        config = gateway_config([], redis={"url": url, "poll_interval_s": 0.1})
        gateways = [fleet.add(start_gateway(workdir, f"gateway-{i}", config)) for i in range(2)]
        wait_ready(fleet.children)
        ids = {"r0", "r1"}

        def registered() -> bool:
            with redis.Redis(port=port, decode_responses=True, socket_timeout=1) as client:
                return {w for w in client.smembers(WORKERS) if client.exists(worker_key(w))} == ids

        def degraded(want: bool) -> bool:
            return all((get_json(f"{g.url}/health") or {}).get("degraded") is want for g in gateways)

        with Traffic([g.url for g in gateways], concurrency=3) as t:
            t.wait_for_requests(20)
            server.proc.kill()
            server.proc.wait()
            killed = time.monotonic()
            seen_s = wait_until(lambda: degraded(True), 10, "the gateways to report degraded")
            redis_up = [metric(g.url, "prefixgate_gateway_redis_up") for g in gateways]
            time.sleep(1.5)
            restarted = time.monotonic()
            fleet.add_service(start_redis(workdir / "redis", port))
            result.recovered_s = wait_until(lambda: degraded(False) and registered(), 15, "Redis to be back")
            t.wait_for_requests(len(t.outcomes) + 20)
        during = t.between(killed, restarted)
        result.count(t.outcomes)

        def exact() -> bool:
            snapshots = {w.name.removeprefix("worker-"): get_json(f"{w.url}/kv/snapshot") for w in workers}
            held = {rid: len(s["hashes"]) for rid, s in snapshots.items() if isinstance(s, dict)}
            listed = [replicas(g.url) for g in gateways]
            return all(
                rows.get(rid, {}).get("index_blocks") == n for rows in listed for rid, n in held.items()
            )

        try:
            exact_s: float | None = wait_until(exact, 10, "every index to match the workers' caches")
        except TimeoutError:
            exact_s = None
        result.checks = {
            "no request failed": result.failed == result.refused == 0,
            "requests served while Redis was down": len(during) > 0,
            "degraded seen, redis_up 0": seen_s < 5 and redis_up == [0.0, 0.0],
            "reconnected, workers re-registered": result.recovered_s is not None,
            "indexes exact again (block counts)": exact_s is not None,
        }
        result.details = {
            "served_while_down": len(during),
            "degraded_after_s": round(seen_s, 3),
            "indexes_exact_after_s": None if exact_s is None else round(exact_s, 3),
        }
    return result


def overload(workdir: Path, requests: int = 1000) -> ScenarioResult:
    """A burst on narrow workers (2 running + 2 waiting each) behind a gateway holding 64 at most."""
    result = ScenarioResult("overload")
    with Fleet(workdir) as fleet:
        profile = sim_profile(workdir, "narrow", max_num_seqs=2)
        workers = [
            fleet.add(start_worker(workdir, f"o{i}", "--sim-profile", profile, "--max-waiting", "2"))
            for i in range(2)
        ]
        config = gateway_config([w.url for w in workers], limits={"max_inflight": 64})
        gateway = fleet.add(start_gateway(workdir, "gateway", config))
        wait_ready(fleet.children)
        asyncio.run(burst(gateway.url, [completion(family_prompt(i), max_tokens=2) for i in range(50)]))
        before = rss_bytes(gateway.pid)
        bodies = [completion(family_prompt(i, families=50), max_tokens=100) for i in range(requests)]
        outcomes = asyncio.run(burst(gateway.url, bodies))
        ended = time.monotonic()
        growth = rss_bytes(gateway.pid) - before

        def whole() -> bool:
            if metric(gateway.url, "prefixgate_gateway_inflight_requests") != 0:
                return False
            probe = httpx.post(f"{gateway.url}/v1/completions", json=completion(family_prompt(0)), timeout=10)
            return probe.status_code == 200

        result.count(outcomes)
        wait_until(whole, 30, "the fleet to serve again")
        result.recovered_s = time.monotonic() - ended
        codes = Counter(o.error for o in outcomes if o.status == 429)
        result.checks = {
            "never a 5xx or a hang: 200 or 429 + Retry-After": result.failed == 0,
            "every place in the fleet served": result.succeeded >= 8,
            f"gateway RSS growth < {BURST_RSS_BOUND // MIB} MiB": growth < BURST_RSS_BOUND,
        }
        result.details = {
            "refusals": dict(codes),
            "gateway_rss_before_mib": round(before / MIB, 1),
            "gateway_rss_growth_mib": round(growth / MIB, 1),
        }
    return result


def disconnect_storm(workdir: Path, clients: int = 500) -> ScenarioResult:
    """`clients` streams through the gateway, all dropped mid-stream at once."""
    result = ScenarioResult("disconnect_storm")
    with Fleet(workdir) as fleet:
        profile = sim_profile(workdir, "slow", step_s=0.2)
        flags = ("--sim-profile", profile, "--num-blocks", "8192", "--max-waiting", "1024")
        workers = [fleet.add(start_worker(workdir, f"d{i}", *flags)) for i in range(2)]
        config = gateway_config([w.url for w in workers], routing={"policy": "round_robin"})
        gateway = fleet.add(start_gateway(workdir, "gateway", config))
        wait_ready(fleet.children)
        bodies = [completion(family_prompt(i, families=25), max_tokens=1000) for i in range(clients)]

        def loads() -> list[dict[str, Any]]:
            return [get_json(f"{w.url}/load") or {} for w in workers]

        storm = _run_storm(gateway.url, bodies, loads)

        def idle() -> bool:
            quiet = all(
                ld.get("running") == ld.get("waiting") == ld.get("kv_blocks_used") == 0 for ld in loads()
            )
            return quiet and metric(gateway.url, "prefixgate_gateway_inflight_requests") == 0

        try:
            wait_until(idle, 10, "every sequence to be aborted")
            result.recovered_s = time.monotonic() - storm.dropped_at
        except TimeoutError:
            result.recovered_s = None
        result.requests = clients
        result.succeeded = storm.streaming
        result.refused = storm.refused[429]
        result.failed = clients - storm.streaming - result.refused
        result.max_latency_s = storm.max_first_chunk_s
        peak = storm.at_peak or []
        result.checks = {
            "every stream started": storm.streaming == clients,
            "all held at the drop": sum(ld.get("running", 0) + ld.get("waiting", 0) for ld in peak)
            == clients,
            "all aborted, no block referenced, gateway empty within 5 s": result.recovered_s is not None
            and result.recovered_s < 5.0,
        }
        result.details = {
            "running_at_drop": [ld.get("running") for ld in peak],
            "kv_blocks_used_at_drop": [ld.get("kv_blocks_used") for ld in peak],
            "max_latency_is": "slowest first chunk",
        }
    return result


def _run_storm(url: str, bodies: Sequence[dict[str, Any]], before_drop: Callable[[], Any]) -> Storm:
    return asyncio.run(disconnect_storm_clients(url, bodies, hold_timeout_s=60, before_drop=before_drop))


def stuck_upstream(workdir: Path) -> ScenarioResult:
    """SIGSTOP one of two workers under steady load for a few seconds, then SIGCONT."""
    result = ScenarioResult("stuck_upstream")
    health = {"interval_s": 0.2, "timeout_s": 0.5, "failures": 2, "load_interval_s": 0.05}
    with Fleet(workdir) as fleet:
        workers = {rid: fleet.add(start_worker(workdir, rid)) for rid in ("s0", "s1")}
        config = gateway_config(
            [w.url for w in workers.values()],
            routing={"policy": "round_robin"},
            health=health,
            limits={"request_timeout_s": REQUEST_TIMEOUT_S},
        )
        gateway = fleet.add(start_gateway(workdir, "gateway", config))
        wait_ready(fleet.children)
        with Traffic([gateway.url], concurrency=3) as t:
            t.wait_for_requests(12)
            workers["s0"].proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            down_s = wait_until(lambda: unhealthy(gateway.url, "s0"), 10, "s0 to be marked unhealthy")
            time.sleep(2.0)
            workers["s0"].proc.send_signal(signal.SIGCONT)
            resumed = time.monotonic()
            result.recovered_s = wait_until(lambda: routable(gateway.url, "s0"), 10, "s0 to be routable")
            t.wait_for_requests(len(t.outcomes) + 12)
        result.count(t.outcomes)
        bound = health["failures"] * (health["interval_s"] + health["timeout_s"])
        result.checks = {
            "no request failed": result.failed == result.refused == 0,
            f"none waited past the {REQUEST_TIMEOUT_S:g} s timeout (+ slack)": result.max_latency_s
            < REQUEST_TIMEOUT_S + SLACK_S,
            f"unhealthy within {bound:g} s (+ slack)": down_s < bound + SLACK_S,
            "only s1 served while s0 was down": _served_by(t.between(stopped + down_s + 0.5, resumed))
            == {"s1"},
            "s0 serves again after SIGCONT": "s0" in _served_by(t.between(resumed + result.recovered_s)),
        }
        result.details = {"unhealthy_after_s": round(down_s, 3), "request_timeout_s": REQUEST_TIMEOUT_S}
    return result


@dataclass(frozen=True, slots=True)
class Streamed:
    """One streaming request of a replay: its status, and whether the client got a whole answer."""

    start: float
    status: int
    # Ended with [DONE], one finish_reason, no error event, as many words as asked for, one id.
    whole: bool
    error: str | None = None
    # From sending the request to the stream's end.
    seconds: float = 0.0


async def stream_replay(url: str, bodies: Sequence[dict[str, Any]], spacing_s: float) -> list[Streamed]:
    """Each body sent as a streaming completion `spacing_s` after the one before (all of them in flight
    together as they overlap), its stream read to the end and judged: a simulated worker writes a word
    per token, so a whole answer has `max_tokens` words."""

    async def one(session: aiohttp.ClientSession, body: dict[str, Any], delay_s: float) -> Streamed:
        await asyncio.sleep(delay_s)
        start = time.monotonic()
        try:
            async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as response:
                payload = await response.read()
        except (aiohttp.ClientError, TimeoutError) as error:
            return Streamed(start, 0, False, repr(error), time.monotonic() - start)
        seconds = time.monotonic() - start
        if response.status != 200:
            return Streamed(start, response.status, False, payload[:80].decode(errors="replace"), seconds)
        events = [line[6:] for line in payload.decode().splitlines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        words = sum(len(c["text"].split()) for chunk in chunks for c in chunk.get("choices", []))
        finishes = [
            c["finish_reason"] for chunk in chunks for c in chunk.get("choices", []) if c["finish_reason"]
        ]
        whole = (
            events[-1:] == ["[DONE]"]
            and not any("error" in chunk for chunk in chunks)
            and len(finishes) == 1
            and words == body["max_tokens"]
            and len({chunk.get("id") for chunk in chunks}) == 1
        )
        error = None if whole else f"truncated: {words} words, {events[-2:]}"
        return Streamed(start, 200, whole, error, seconds)

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        return list(await asyncio.gather(*(one(session, b, i * spacing_s) for i, b in enumerate(bodies))))


def streams_replica_killed(
    workdir: Path, requests: int = 300, kill_at_s: float = 15.0, restart_at_s: float = 30.0
) -> ScenarioResult:
    """A streaming grouped replay over four slow workers, one SIGKILLed at `kill_at_s` and restarted
    at `restart_at_s`: every stream is whole, its answer continued on another worker where its own
    died mid-answer (gateway.forward.migration). Once with bundled workers (continued from token
    ids), once with
    the same workers declared foreign (`kind: openai`, text prompts, `foreign_continuation: completions`:
    continued from the text so far)."""
    result = ScenarioResult("streams_replica_killed")
    for variant in ("bundled", "foreign"):
        outcomes, migrated = _streams_with_a_kill(
            workdir / variant, variant, requests, kill_at_s, restart_at_s
        )
        truncated = [o for o in outcomes if o.status == 200 and not o.whole]
        failed = [o for o in outcomes if o.status != 200]
        result.requests += len(outcomes)
        result.succeeded += len(outcomes) - len(truncated) - len(failed)
        result.failed += len(truncated) + len(failed)
        result.max_latency_s = max([result.max_latency_s, *(o.seconds for o in outcomes)])
        result.checks[f"{variant}: no stream truncated"] = not truncated
        result.checks[f"{variant}: no request failed"] = not failed
        result.details[variant] = {
            "truncated": len(truncated),
            "failed": len(failed),
            "migrations": migrated,
            "first_errors": [o.error for o in [*truncated, *failed][:3]],
        }
    return result


def _streams_with_a_kill(
    workdir: Path, variant: str, requests: int, kill_at_s: float, restart_at_s: float
) -> tuple[list[Streamed], float]:
    """One variant of streams_replica_killed: the replay's outcomes, and the streams continued."""
    foreign = variant == "foreign"
    with Fleet(workdir) as fleet:
        profile = sim_profile(workdir, "slow", step_s=0.05)
        flags = ("--sim-tokenizer", "words") if foreign else ()
        ports = {f"w{n}": free_port() for n in range(4)}
        workers = {
            rid: fleet.add(start_worker(workdir, rid, *flags, port=p, profile=profile))
            for rid, p in ports.items()
        }
        config = gateway_config([w.url for w in workers.values()])
        if foreign:
            config["replicas"] = [{"url": w.url, "kind": "openai"} for w in workers.values()]
            config["models"] = {MODEL: {"tokenizer": "none", "foreign_continuation": "completions"}}
        gateway = fleet.add(start_gateway(workdir, "gateway", config))
        wait_ready(fleet.children)
        before = _migrations(gateway.url)
        bodies = []
        for i in range(requests):
            body = completion(family_prompt(i), max_tokens=40)
            if foreign:  # text, which the workers' word tokenizer reads
                body["prompt"] = " ".join(f"w{t}" for t in body["prompt"])
            bodies.append(body)

        def fault() -> None:
            time.sleep(kill_at_s)
            workers["w0"].proc.kill()
            time.sleep(restart_at_s - kill_at_s)
            fleet.add(start_worker(workdir, "w0", *flags, port=ports["w0"], profile=profile))

        faulting = threading.Thread(target=fault, daemon=True)
        faulting.start()
        spacing_s = (restart_at_s + kill_at_s / 2) / requests
        outcomes = asyncio.run(stream_replay(gateway.url, bodies, spacing_s))
        faulting.join()
        return outcomes, _migrations(gateway.url) - before


def _migrations(url: str) -> float:
    """Streams continued on another replica, as the gateway counted them."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return 0.0
    name = "prefixgate_gateway_stream_migrations_total{"
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name) and 'outcome="continued"' in line
    )


SCENARIOS: dict[str, Callable[[Path], ScenarioResult]] = {
    "replica_killed": replica_killed,
    "redis_down": redis_down,
    "overload": overload,
    "disconnect_storm": disconnect_storm,
    "stuck_upstream": stuck_upstream,
    "streams_replica_killed": streams_replica_killed,
}


# -- the command ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--only", nargs="+", choices=list(SCENARIOS), default=None, help="run these scenarios (default: all)"
    )
    parser.add_argument("--json", default=None, help="write the results here (and a PNG next to it)")
    parser.add_argument("--plot", default=None, help="the PNG's path (default: the JSON's, .png)")
    parser.add_argument("--workdir", default=None, help="keep the processes' logs here (default: a temp dir)")


def _row(r: ScenarioResult) -> list[Any]:
    recovered = "-" if r.recovered_s is None else round(r.recovered_s, 2)
    return [
        r.scenario, r.requests, r.succeeded, r.refused, r.failed, round(r.max_latency_s, 2), recovered,
        "pass" if r.passed else "FAIL",
    ]  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = args.only or list(SCENARIOS)
    results: list[ScenarioResult] = []
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        root = (
            Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        for name in names:
            t0 = time.monotonic()
            try:
                result = SCENARIOS[name](root / name)
            except Exception as error:  # one scenario's breakage must not hide the others' results
                result = ScenarioResult(name, error=f"{type(error).__name__}: {error}")
            result.details["seconds"] = round(time.monotonic() - t0, 1)
            results.append(result)
            status = "pass" if result.passed else "FAIL"
            print(f"{name}: {status} in {result.details['seconds']} s", flush=True)
    header = [
        "scenario",
        "requests",
        "succeeded",
        "refused 429",
        "failed",
        "max latency s",
        "recovered in s",
        "result",
    ]
    print()
    print(
        format_table(
            "chaos: faults on a live fleet (loopback, real processes)", header, [_row(r) for r in results]
        )
    )
    for r in results:
        broken = [name for name, ok in r.checks.items() if not ok]
        if r.error or broken:
            print(f"  {r.scenario}: {r.error or 'failed checks: ' + '; '.join(broken)}")
    payload = {
        "scenarios": [r.to_json() for r in results],
        "passed": all(r.passed for r in results),
        "seconds": round(time.monotonic() - started, 1),
    }
    if args.json:
        write_json(args.json, payload)
        plot = args.plot or str(Path(args.json).with_suffix(".png"))
        bar_panels(
            plot,
            "chaos: each fault's cost and recovery",
            [
                ("max latency (s)", {r.scenario: r.max_latency_s for r in results}),
                ("recovered in (s)", {r.scenario: r.recovered_s or 0.0 for r in results}),
                ("answered as specified (%)", {r.scenario: _share(r) for r in results}),
            ],
        )
        print(f"wrote {args.json} and {plot}")
    if not payload["passed"]:
        raise SystemExit(1)
    return payload


def _share(r: ScenarioResult) -> float:
    """Requests that got a 200 or a proper 429, in percent."""
    return 100.0 * (r.succeeded + r.refused) / r.requests if r.requests else 0.0
