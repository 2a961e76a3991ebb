"""`bench soak` end to end, shortened to about 20 s: Redis, three simulated workers and two gateways as
processes, load through both, and the table, JSON and PNG that come out; plus the pure helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.soak import Sample, gateway_summary, read_metrics, verdict
from prefixgate.cli import main

pytestmark = pytest.mark.fleet


def test_cli_soaks_two_gateways_without_errors(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    assert main(["bench", "soak", "--minutes", "0.3", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0

    assert payload["minutes"] == 0.3 and payload["workers"] == 3
    client = payload["client"]
    # Both gateways carried the load, alternately, and every request came back whole.
    assert set(client["per_gateway"]) == {"gateway-g0", "gateway-g1"}
    assert abs(client["per_gateway"]["gateway-g0"] - client["per_gateway"]["gateway-g1"]) <= 1
    assert client["sent"] == client["completed"] == payload["requests"] > 50
    assert client["errors"] == {} and payload["errors"] == 0
    assert client["hit_rate"] > 0.3  # the shared prefixes were found where they were cached

    assert set(payload["gateways"]) == {"gateway-g0", "gateway-g1"}
    for name, g in payload["gateways"].items():
        # The gateway counted every request it was sent (a 200, or a 499 for a client that closed
        # right after [DONE]), and answered none with an error.
        assert g["requests"] == client["per_gateway"][name] and g["errors"] == 0
        assert 20 < g["rss_warm_mib"] < 1024 and 20 < g["rss_end_mib"] < 1024
        assert isinstance(g["rss_growth_pct"], float)
        # The index follows the workers' KV events through Redis, removals included: never more entries
        # than the pools hold blocks.
        assert 0 < g["index_min"] <= g["index_max"] <= payload["index_bound"] == 3 * payload["num_blocks"]
    samples = payload["samples"]
    assert {s["gateway"] for s in samples} == {"gateway-g0", "gateway-g1"}
    times = [s["t_s"] for s in samples if s["gateway"] == "gateway-g0"]
    assert len(times) >= 10 and times == sorted(times) and times[-1] >= 0.3 * 60 - 2
    checks = payload["verdict"]
    assert checks["no errors"] and checks["index bounded"]
    assert payload["passed"] == all(checks.values())


METRICS = """\
# HELP prefixgate_gateway_index_entries (block, replica) entries in the index
# TYPE prefixgate_gateway_index_entries gauge
prefixgate_gateway_index_entries 1234.0
# HELP prefixgate_gateway_requests_total Requests
# TYPE prefixgate_gateway_requests_total counter
prefixgate_gateway_requests_total{model="m",policy="p",replica="w0",status="200"} 7.0
prefixgate_gateway_requests_total{model="m",policy="p",replica="w1",status="200"} 3.0
prefixgate_gateway_requests_total{model="",policy="p",replica="",status="400"} 2.0
prefixgate_gateway_requests_total{model="m",policy="p",replica="w1",status="499"} 1.0
# HELP prefixgate_gateway_requests_created Requests
# TYPE prefixgate_gateway_requests_created gauge
prefixgate_gateway_requests_created{model="m",policy="p",replica="w0",status="200"} 1.7e+09
"""


def test_metrics_are_read_by_status() -> None:
    index, statuses = read_metrics(METRICS)
    assert index == 1234 and statuses == {"200": 10, "400": 2, "499": 1}
    sample = Sample(1.0, "g", 80.0, index, statuses)
    assert sample.requests == 13 and sample.errors == 2 and sample.client_left == 1


def _samples(rss: list[float], every_s: float = 5.0) -> list[Sample]:
    return [Sample(i * every_s, "g", v, 100 + i, {"200": 10 * i}) for i, v in enumerate(rss)]


def test_growth_is_measured_after_the_warm_up_on_medians() -> None:
    # Warm-up from 100 to 200 MiB, flat after it but for one spike at the end: no growth.
    flat = gateway_summary(_samples([100, 150, 200, 200, 201, 200, 199, 200, 200, 260, 200]), warmup_s=10)
    assert flat["rss_warm_mib"] == 200 and flat["rss_end_mib"] == 200 and flat["rss_growth_pct"] == 0
    assert flat["rss_start_mib"] == 100 and flat["rss_max_mib"] == 260
    assert flat["index_min"] == 102 and flat["index_max"] == 110 and flat["requests"] == 100
    # A steady climb of 10 MiB per sample (120 MiB a minute) after the warm-up.
    leak = gateway_summary(_samples([100 + 10 * i for i in range(13)]), warmup_s=10)
    assert leak["rss_growth_pct"] == pytest.approx(100 * (210 - 130) / 130, abs=0.01)
    assert leak["rss_trend_mib_per_min"] == pytest.approx(120.0)
    summary = {"errors": 0, "index_bound": 105, "gateways": {"g": leak}}
    assert verdict(summary) == {"no errors": True, "RSS growth <= 5 %": False, "index bounded": False}
