"""`prefixgate serve --workers 2` as a user runs it: two real gateway processes on one port, each
connection to whichever one the kernel picks, routing as one gateway.

Each check opens fresh connections (the kernel spreads connections, not requests) until it has seen
both processes, by the `gateway_id` or `siblings.process` they answer with.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from bench.local_fleet import Child, Fleet, cli, spawn, start_gateway, wait_healthy
from bench.probes import wait_for
from bench.procfs import child_pids
from tests.support.gateways import PREFIX, SIM_MODEL, SimWorker, foreign_backend, foreign_entries

pytestmark = pytest.mark.fleet

HELD_MODEL = "held-m"


def _fresh(method: str, url: str, **kwargs: Any) -> httpx.Response:
    """One request on a connection of its own (so that the kernel picks a process for it)."""
    with httpx.Client(timeout=10, headers={"Connection": "close"}) as client:
        return client.request(method, url, **kwargs)


def _from_each(
    gateway: Child, ask: Callable[[], httpx.Response], process_of: Callable[[httpx.Response], object]
) -> dict[object, httpx.Response]:
    """An answer from each of the two processes (fresh connections until both have answered)."""
    seen: dict[object, httpx.Response] = {}

    def both() -> bool:
        response = ask()
        seen.setdefault(process_of(response), response)
        return len(seen) == 2

    wait_for(both, "answers from both gateway processes", timeout=30, interval=0.0)
    return seen


def _process(response: httpx.Response) -> int:
    return int(response.json()["siblings"]["process"])


def _health(gateway: Child) -> dict[object, httpx.Response]:
    return _from_each(gateway, lambda: _fresh("GET", f"{gateway.url}/health"), _process)


@pytest.fixture
def two_processes(
    fleet: Fleet, start_sim_worker: Callable[..., SimWorker]
) -> Iterator[tuple[Child, list[SimWorker]]]:
    """`serve --workers 2` over two simulated workers taken as foreign (approximate mode), ids as prompts."""
    workers = [start_sim_worker(f"w{i}") for i in range(2)]
    config = {
        "model": SIM_MODEL,
        "models": {SIM_MODEL: {"tokenizer": "none"}},
        "replicas": foreign_entries(workers),
        "health": {"interval_s": 0.2},
    }
    gateway = fleet.add(start_gateway(fleet.workdir, "gw", config, "--workers", "2"))
    wait_healthy([gateway])
    _health(gateway)
    yield gateway, workers


def test_a_prediction_made_by_one_process_routes_the_others(
    two_processes: tuple[Child, list[SimWorker]],
) -> None:
    gateway, _ = two_processes
    first = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": SIM_MODEL, "prompt": [*PREFIX, 1], "max_tokens": 2},
        timeout=10,
    )
    assert first.status_code == 200, first.text
    holder = first.headers["x-prefixgate-replica"]

    def explain() -> httpx.Response:
        body = {"model": SIM_MODEL, "prompt": [*PREFIX, 2]}
        return _fresh("POST", f"{gateway.url}/debug/route", json=body)

    ids: dict[str, dict[str, Any]] = {}

    def both_predict() -> bool:
        answer = explain().json()
        matched = {row["replica"]: row["matched_blocks"] for row in answer["replicas"]}
        if answer["order"][0] == holder and matched[holder] == len(PREFIX) // 16:
            ids.setdefault(answer["gateway_id"], answer)
        return len(ids) == 2

    wait_for(both_predict, "both processes to predict the prefix on its replica", timeout=30, interval=0.0)


def test_metrics_answer_for_every_process(two_processes: tuple[Child, list[SimWorker]]) -> None:
    gateway, _ = two_processes
    for _ in range(4):  # whichever process takes the scrape
        text = _fresh("GET", f"{gateway.url}/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        healthy = families["prefixgate_gateway_replica_healthy"].samples
        assert {(s.labels["process"], s.labels["replica"]) for s in healthy} == {
            (p, w) for p in "01" for w in ("w0", "w1")
        }


def test_an_admin_change_reaches_every_process(two_processes: tuple[Child, list[SimWorker]]) -> None:
    gateway, _ = two_processes
    drained = _fresh("POST", f"{gateway.url}/admin/replicas/w0/drain", json={})
    assert drained.status_code == 200, drained.text

    def everywhere() -> bool:
        return all(r.json()["replicas"]["routable"] == 1 for r in _health(gateway).values())

    wait_for(everywhere, "both processes to see w0 drained", timeout=10, interval=0.05)


def test_a_process_that_dies_is_replaced_and_the_other_serves_meanwhile(
    two_processes: tuple[Child, list[SimWorker]],
) -> None:
    gateway, _ = two_processes
    before = {k: r.json()["gateway_id"] for k, r in _health(gateway).items()}
    children = child_pids(gateway.pid)
    assert len(children) == 2
    victim = min(children)
    os.kill(victim, signal.SIGKILL)
    # Until it is back, every new connection goes to the one still listening.
    for _ in range(20):
        assert _fresh("GET", f"{gateway.url}/health").status_code == 200
    wait_for(lambda: len(child_pids(gateway.pid) - {victim}) == 2, "a new process", timeout=30, interval=0.1)
    after = {k: r.json()["gateway_id"] for k, r in _health(gateway).items()}
    assert len(set(after.values()) - set(before.values())) == 1
    gateway.proc.send_signal(signal.SIGTERM)
    assert gateway.proc.wait(timeout=40) == 0
    assert not child_pids(gateway.pid)


@pytest.fixture
def held_backend() -> Iterator[tuple[str, threading.Event]]:
    """A foreign backend whose completions wait until the event is set."""
    release = threading.Event()

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        while not release.is_set():
            await asyncio.sleep(0.01)
        return web.json_response(
            {
                "id": "c",
                "object": "text_completion",
                "model": HELD_MODEL,
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        )

    with foreign_backend(HELD_MODEL, complete) as url:
        yield url, release
        release.set()


def test_a_request_in_flight_counts_in_every_process(
    fleet: Fleet, held_backend: tuple[str, threading.Event]
) -> None:
    url, release = held_backend
    config = {"models": {HELD_MODEL: {"tokenizer": "none"}}, "replicas": [{"url": url, "id": "held"}]}
    gateway = fleet.add(start_gateway(fleet.workdir, "gw", config, "--workers", "2"))
    wait_healthy([gateway])
    _health(gateway)  # both up: a process that joins later learns only of requests placed after
    body = {"model": HELD_MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
    sent = threading.Thread(
        target=httpx.post, args=(f"{gateway.url}/v1/completions",), kwargs={"json": body, "timeout": 60}
    )
    sent.start()

    def rows() -> list[dict[str, Any]]:
        answers = _from_each(
            gateway, lambda: _fresh("GET", f"{gateway.url}/admin/replicas"), lambda r: r.json()["gateway_id"]
        )
        return [a.json()["replicas"][0] for a in answers.values()]

    def counted() -> bool:
        # One process holds it, the other counts it as its sibling's; both see a request waiting there.
        now = rows()
        pairs = sorted((row["inflight"], row["sibling_inflight"]) for row in now)
        return pairs == [(0, 1), (1, 0)] and all(row["load"]["waiting"] == 1 for row in now)

    wait_for(counted, "the request counted by both processes", timeout=30, interval=0.05)
    release.set()
    sent.join(timeout=10)

    def ended() -> bool:
        return all(
            row["inflight"] == row["sibling_inflight"] == row["load"]["waiting"] == 0 for row in rows()
        )

    wait_for(ended, "the request to end in both", timeout=30, interval=0.05)


def test_a_bad_config_or_an_epp_with_workers_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("routing: {policy: nonsense}\n")
    for command in ("serve", "epp"):
        child = spawn(command, cli(command, "--config", str(bad), "--workers", "2"), "", tmp_path)
        assert child.proc.wait(timeout=60) == 2
        assert "prefixgate" in child.log_tail()
    good = tmp_path / "good.yaml"
    good.write_text("replicas: []\n")
    child = spawn("epp", cli("epp", "--config", str(good), "--workers", "2"), "", tmp_path)
    assert child.proc.wait(timeout=60) == 2
    assert "--workers is for `serve`" in child.log_tail()
