"""`bench epp` end to end: a real simulated worker, the real Envoy alone and with prefixgate as its
picker, prefixgate as the proxy, and the table, JSON and PNG that come out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.epp_latency import GATEWAYS, PATHS
from prefixgate.cli import main


@pytest.mark.fleet
def test_cli_times_every_path_and_what_each_gateway_costs(tmp_path: Path) -> None:
    out = tmp_path / "epp.json"
    main(["bench", "epp", "--requests", "8", "--words", "50", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    for path in PATHS:
        ttft, e2e = payload["latency"][path]["ttft_s"], payload["latency"][path]["e2e_s"]
        assert 0 < ttft["p50"] <= ttft["p99"] <= e2e["p99"]
    for path in PATHS[1:]:
        assert payload["added_s"][path]["ttft_s_p50"] == pytest.approx(
            payload["latency"][path]["ttft_s"]["p50"] - payload["latency"]["direct"]["ttft_s"]["p50"]
        )
    for path in GATEWAYS:
        assert payload["gateway_cpu_s_per_request"][path] > 0, "each gateway worked on every request"
        assert payload["gateway_memory"][path]["peak_rss_bytes"] > 0
    assert payload["picker_over_envoy_s"]["ttft_s_p50"] == pytest.approx(
        payload["latency"]["envoy + prefixgate picker"]["ttft_s"]["p50"]
        - payload["latency"]["envoy alone"]["ttft_s"]["p50"]
    )
