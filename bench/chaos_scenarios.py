"""The fault scenarios of `bench chaos` on a fleet of their own, each reporting a ScenarioResult:
one worker killed, Redis killed, an overload burst, a disconnect storm, one worker stopped (see
bench.chaos for what each checks; bench.chaos_streams has the streaming one)."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.chaos_fleet import (
    FAST_HEALTH,
    POLL_S,
    START_TIMEOUT_S,
    WORKER,
    fast_gateway_config,
    replicas,
    routable,
    sim_profile,
    unhealthy,
)
from bench.chaos_traffic import (
    Outcome,
    Storm,
    Traffic,
    burst,
    completion,
    disconnect_storm_clients,
    family_prompt,
)
from bench.local_fleet import Fleet, start_gateway, start_redis, start_worker, wait_healthy
from bench.probes import get_json, metric, wait_for
from bench.procfs import rss_bytes
from protocol.loopback_ports import free_port
from protocol.redis_keys import WORKERS, worker_key

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


def _served_by(outcomes: Sequence[Outcome]) -> set[str]:
    return {o.replica for o in outcomes if o.replica is not None}


def replica_killed(workdir: Path) -> ScenarioResult:
    """SIGKILL one of two workers under steady load, restart it on its port."""
    result = ScenarioResult("replica_killed")
    with Fleet(workdir) as fleet:
        ports = {"k0": free_port(), "k1": free_port()}
        workers = {rid: fleet.add(start_worker(workdir, WORKER, rid, port=p)) for rid, p in ports.items()}
        config = fast_gateway_config([w.url for w in workers.values()], routing={"policy": "round_robin"})
        gateway = fleet.add(start_gateway(workdir, "gateway", config))
        wait_healthy(fleet.children, START_TIMEOUT_S, poll_s=POLL_S)
        with Traffic(
            [gateway.url], lambda i: completion(family_prompt(i), max_tokens=60), concurrency=4
        ) as t:
            t.wait_for_requests(12)
            workers["k0"].proc.kill()
            killed = time.monotonic()
            wait_for(lambda: unhealthy(gateway.url, "k0"), "k0 to leave the rotation", timeout=10)
            left_s = time.monotonic() - killed
            time.sleep(1.0)
            restarted = time.monotonic()
            workers["k0"] = fleet.add(start_worker(workdir, WORKER, "k0", port=ports["k0"]))
            wait_for(lambda: routable(gateway.url, "k0"), "k0 to rejoin", timeout=60)
            result.recovered_s = time.monotonic() - restarted
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
        workers = [fleet.add(start_worker(workdir, WORKER, f"r{i}", *flags)) for i in range(2)]
        config = fast_gateway_config([], redis={"url": url, "poll_interval_s": 0.1})
        gateways = [fleet.add(start_gateway(workdir, f"gateway-{i}", config)) for i in range(2)]
        wait_healthy(fleet.children, START_TIMEOUT_S, poll_s=POLL_S)
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
            wait_for(lambda: degraded(True), "the gateways to report degraded", timeout=10)
            seen_s = time.monotonic() - killed
            redis_up = [metric(g.url, "prefixgate_gateway_redis_up") for g in gateways]
            time.sleep(1.5)
            restarted = time.monotonic()
            fleet.add_service(start_redis(workdir / "redis", port))
            back = time.monotonic()
            wait_for(lambda: degraded(False) and registered(), "Redis to be back", timeout=15)
            result.recovered_s = time.monotonic() - back
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

        settling = time.monotonic()
        try:
            wait_for(exact, "every index to match the workers' caches", timeout=10)
            exact_s: float | None = time.monotonic() - settling
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
            fleet.add(start_worker(workdir, WORKER, f"o{i}", "--sim-profile", profile, "--max-waiting", "2"))
            for i in range(2)
        ]
        config = fast_gateway_config([w.url for w in workers], limits={"max_inflight": 64})
        gateway = fleet.add(start_gateway(workdir, "gateway", config))
        wait_healthy(fleet.children, START_TIMEOUT_S, poll_s=POLL_S)
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
        wait_for(whole, "the fleet to serve again", timeout=30)
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
        workers = [fleet.add(start_worker(workdir, WORKER, f"d{i}", *flags)) for i in range(2)]
        config = fast_gateway_config([w.url for w in workers], routing={"policy": "round_robin"})
        gateway = fleet.add(start_gateway(workdir, "gateway", config))
        wait_healthy(fleet.children, START_TIMEOUT_S, poll_s=POLL_S)
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
            wait_for(idle, "every sequence to be aborted", timeout=10)
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
    with Fleet(workdir) as fleet:
        workers = {rid: fleet.add(start_worker(workdir, WORKER, rid)) for rid in ("s0", "s1")}
        config = fast_gateway_config(
            [w.url for w in workers.values()],
            routing={"policy": "round_robin"},
            limits={"request_timeout_s": REQUEST_TIMEOUT_S},
        )
        gateway = fleet.add(start_gateway(workdir, "gateway", config))
        wait_healthy(fleet.children, START_TIMEOUT_S, poll_s=POLL_S)
        with Traffic([gateway.url], concurrency=3) as t:
            t.wait_for_requests(12)
            workers["s0"].proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            wait_for(lambda: unhealthy(gateway.url, "s0"), "s0 to be marked unhealthy", timeout=10)
            down_s = time.monotonic() - stopped
            time.sleep(2.0)
            workers["s0"].proc.send_signal(signal.SIGCONT)
            resumed = time.monotonic()
            wait_for(lambda: routable(gateway.url, "s0"), "s0 to be routable", timeout=10)
            result.recovered_s = time.monotonic() - resumed
            t.wait_for_requests(len(t.outcomes) + 12)
        result.count(t.outcomes)
        bound = FAST_HEALTH["failures"] * (FAST_HEALTH["interval_s"] + FAST_HEALTH["timeout_s"])
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
