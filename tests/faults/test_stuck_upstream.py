"""A replica that stops answering (SIGSTOP: its socket still accepts, nothing replies) costs no request
more than `limits.request_timeout_s`: a request that had sent nothing moves to the next choice, one
with no other choice fails with OpenAI's error JSON (504, upstream_timeout), a stream cut mid-way
ends with an error event and [DONE]. The replica is marked unhealthy within the health checks'
timeout, traffic moves to the other one, and after SIGCONT it is routable again."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import httpx
import pytest

from bench import local_fleet
from bench.chaos_fleet import WORKER
from bench.chaos_traffic import Traffic, completion, family_prompt
from bench.local_fleet import Fleet, wait_healthy
from bench.probes import wait_for
from tests.support.gateways import RunningGateway

REQUEST_TIMEOUT_S = 2.0
HEALTH = {"interval_s": 0.2, "timeout_s": 0.5, "failures": 2, "load_interval_s": 0.05}
# Slack for a loaded 2-core machine on top of each bound.
SLACK_S = 1.5


@pytest.mark.timeout(120)
def test_a_stuck_replica_costs_no_request_more_than_the_timeout(
    fleet: Fleet, start_gateway: Callable[..., RunningGateway]
) -> None:
    workers = {rid: fleet.add(local_fleet.start_worker(fleet.workdir, WORKER, rid)) for rid in ("s0", "s1")}
    wait_healthy(list(workers.values()))
    stuck = workers["s0"]
    limits = {"request_timeout_s": REQUEST_TIMEOUT_S}
    gateway = start_gateway(
        [w.url for w in workers.values()], routing={"policy": "round_robin"}, health=HEALTH, limits=limits
    )
    # A gateway that knows only the stuck replica and never gives up on it: its clients have no other
    # choice, so they see what a timeout looks like.
    alone = start_gateway([stuck.url], health={**HEALTH, "interval_s": 60, "failures": 10_000}, limits=limits)
    body = lambda i: completion(family_prompt(i), max_tokens=4)  # noqa: E731
    with Traffic([gateway.url], body, concurrency=3) as traffic:
        traffic.wait_for_requests(10)
        long = {**completion(family_prompt(7), max_tokens=3000), "stream": True}
        with httpx.stream("POST", f"{alone.url}/v1/completions", json=long, timeout=30) as stream:
            lines = stream.iter_lines()  # held: a dropped iterator closes the stream
            next(lines)
            stuck.proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            # Mid-stream: the relay waits REQUEST_TIMEOUT_S for a chunk, then ends the stream properly.
            tail = [line for line in lines if line]
            cut_after = time.monotonic() - stopped
        assert tail[-1] == "data: [DONE]" and '"upstream_timeout"' in tail[-2], tail[-2:]
        assert cut_after < REQUEST_TIMEOUT_S + SLACK_S
        # No other choice: a 504 with OpenAI's error JSON after the timeout, not a hang.
        start = time.monotonic()
        timed_out = httpx.post(f"{alone.url}/v1/completions", json=body(0), timeout=30)
        waited = time.monotonic() - start
        assert timed_out.status_code == 504
        assert timed_out.json()["error"]["code"] == "upstream_timeout"
        assert timed_out.json()["error"]["type"] == "server_error"
        assert REQUEST_TIMEOUT_S - 0.1 < waited < REQUEST_TIMEOUT_S + SLACK_S
        # Marked unhealthy within the health checks' bound (failures x (interval + timeout)).
        down = wait_for(
            lambda: gateway.state.replicas.get("s0").down_since, "s0 to be marked unhealthy", timeout=5
        )
        bound = HEALTH["failures"] * (HEALTH["interval_s"] + HEALTH["timeout_s"])
        print(f"\ns0 unhealthy {down - stopped:.2f} s after SIGSTOP (bound {bound:.1f} s + slack)")
        assert down - stopped < bound + SLACK_S
        traffic.wait_for_requests(len(traffic.outcomes) + 20)
        moved = traffic.between(down + 0.5)
        stuck.proc.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        wait_for(lambda: gateway.state.replicas.get("s0").routable, "s0 to be routable again", timeout=5)
        back = time.monotonic() - resumed
        traffic.wait_for_requests(len(traffic.outcomes) + 20)
    outcomes = traffic.outcomes
    slowest = max(o.latency_s for o in outcomes)
    print(f"{len(outcomes)} requests, slowest {slowest:.2f} s; s0 routable {back:.2f} s after SIGCONT")
    # Through the gateway with a second choice, nothing failed and nothing waited past the timeout.
    assert [o for o in outcomes if o.status != 200] == []
    assert slowest < REQUEST_TIMEOUT_S + SLACK_S
    assert moved and {o.replica for o in moved} == {"s1"}
    assert "s0" in {o.replica for o in traffic.between(resumed + back)}
