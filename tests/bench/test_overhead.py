"""`bench overhead` end to end: a real simulated worker and a real gateway, each its own process, the
same schedule sent to both, a short capacity phase, and the table, JSON and PNG that come out."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.overhead_phases import CONCURRENCY, TARGETS
from prefixgate.cli import main

pytestmark = pytest.mark.fleet


def test_cli_measures_both_paths_and_the_capacity(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    argv = ["bench", "overhead", "--rate", "20", "--duration", "2", "--prompt-tokens", "500"]
    main([*argv, "--max-duration", "0.5", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0

    direct, gateway = (payload["latency"][t] for t in TARGETS)
    # One schedule, both paths: the same number of requests, every one answered.
    assert direct["sent"] == gateway["sent"] == direct["completed"] == gateway["completed"] > 10
    assert direct["errors"] == gateway["errors"] == {}
    assert direct["requests_per_replica"] == {"direct": direct["completed"]}
    assert gateway["requests_per_replica"] == {"w0": gateway["completed"]}
    for summary in (direct, gateway):
        assert 0 < summary["ttft_s"]["p50"] <= summary["ttft_s"]["p99"] <= summary["e2e_s"]["p99"]
        assert summary["cpu_s_per_request"]["worker"] > 0
    assert set(payload["added_s"]) == {"ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99"}
    assert payload["added_s"]["ttft_p50"] == pytest.approx(gateway["ttft_s"]["p50"] - direct["ttft_s"]["p50"])
    assert isinstance(payload["bar"]["met"], bool)
    # The gateway's histogram counted one decision per measured request, warm-up excluded.
    decision = payload["routing_decision_s"]
    assert decision["count"] == gateway["sent"] and 0 < decision["p50"] <= decision["p99"]
    assert payload["process"]["gateway"]["rss_bytes"] > 0 and gateway["cpu_s_per_request"]["gateway"] > 0

    steps = payload["capacity"]["steps"]
    assert [(s["target"], s["concurrency"]) for s in steps] == [(t, c) for c in CONCURRENCY for t in TARGETS]
    assert all(s["error_rate"] == 0 and s["req_s"] > 0 for s in steps)
    best = payload["capacity"]["sustained_req_s"]
    assert best == {t: max(s["req_s"] for s in steps if s["target"] == t) for t in TARGETS}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to give the gateway one")
def test_the_gateway_can_have_a_core_of_its_own(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    out = tmp_path / "pinned.json"
    argv = ["bench", "overhead", "--rate", "20", "--duration", "1", "--prompt-tokens", "200"]
    main([*argv, "--skip-max", "--pin-gateway", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert payload["config"]["cores"] == {"gateway": cpus[-1:], "worker and load": cpus[:-1]}
    assert payload["latency"]["gateway"]["completed"] == payload["latency"]["gateway"]["sent"] > 5
    # This process has every core back, its threads included.
    assert all(os.sched_getaffinity(int(t)) == set(cpus) for t in os.listdir(f"/proc/{os.getpid()}/task"))
