"""The replay's tables and plot panels: a row per policy with dashes where nothing was measured, every
worker in the spread, labels short enough for a bar, and one endpoint's latencies and totals."""

from __future__ import annotations

from collections import Counter
from typing import Any

from bench.replay_result import ReplayResult, RequestRecord
from bench.replay_tables import endpoint_panels, endpoint_tables, fleet_panels, fleet_tables, plot_label


def _row(ttft_s: float | None, moved: float | None, replicas: dict[str, int]) -> dict[str, Any]:
    stats = {"mean": ttft_s, "p50": ttft_s, "p90": ttft_s, "p99": ttft_s}
    return {
        "ttft_s": stats,
        "e2e_s": stats,
        "errors": {} if replicas else {"connect": 2},
        "moved_turns": moved,
        "ttft_predicted": 0.5 if replicas else None,
        "cached_predicted": {"ratio": 1.25, "under": 0.1, "over": 0.4} if replicas else None,
        "hit_rate": 0.5,
        "imbalance": 1.0,
        "completed": sum(replicas.values()),
        "requests_per_replica": replicas,
    }


FLEET = {
    "sim_fleet": {"count": 3},
    "policies": {
        "prefix_aware approx cap x16": _row(0.25, 0.1, {"w0": 4, "w2": 2}),
        "round_robin": _row(None, None, {}),
    },
}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.split("|")]


def test_fleet_tables_put_a_row_per_policy_and_every_worker_in_the_spread() -> None:
    rows, spread = (t.splitlines() for t in fleet_tables("title", FLEET).split("\n\n"))
    assert rows[0] == "title"
    assert _cells(rows[1])[-5:] == [
        "moved turns",
        "predicted/seen TTFT",
        "predicted/seen cached (under / over)",
        "completed",
        "errors",
    ]
    measured = ["0.5", "1", "0.1", "0.5", "1.25 (10% / 40%)", "6", "0"]
    assert _cells(rows[3]) == ["prefix_aware approx cap x16", *["0.25"] * 5, *measured]
    # Nothing measured reads as a dash, not as an instant zero.
    assert _cells(rows[4]) == ["round_robin", *["-"] * 5, "0.5", "1", "-", "-", "-", "0", "connect=2"]
    assert _cells(spread[1]) == ["policy", "w0", "w1", "w2"]
    assert _cells(spread[3]) == ["prefix_aware approx cap x16", "4", "0", "2"]


def test_fleet_panels_shorten_the_labels_and_leave_out_what_was_not_measured() -> None:
    panels = dict(fleet_panels(FLEET))
    assert list(panels)[-3:] == ["hit rate", "imbalance (max/mean)", "moved turns"] and len(panels) == 8
    assert panels["TTFT p99 s"] == {"prefix_aware ~x16": 0.25}
    assert panels["hit rate"] == {"prefix_aware ~x16": 0.5, "round_robin": 0.5}
    assert panels["moved turns"] == {"prefix_aware ~x16": 0.1}
    alone = {**FLEET, "policies": {"round_robin": FLEET["policies"]["round_robin"]}}
    assert "moved turns" not in dict(fleet_panels(alone))


def test_plot_labels_shorten_only_the_approximate_modes() -> None:
    assert plot_label("prefix_aware approx cap x16") == "prefix_aware ~x16"
    assert plot_label("cache_threshold approx cap absent") == "cache_threshold ~none"
    assert plot_label("prefix_aware precise") == "prefix_aware precise"
    assert plot_label("sglang cache_aware") == "sglang cache_aware"


def test_endpoint_tables_show_latencies_totals_and_the_replicas_only_when_named() -> None:
    record = RequestRecord(0.5, (0.25,), 1.0, 10, 5, 2, "w1")
    summary = ReplayResult("http://x", 2, 1.0, [record], Counter({"timeout": 1})).summary()
    latency, totals, replicas = (t.splitlines() for t in endpoint_tables("t", summary).split("\n\n"))
    assert _cells(latency[1]) == ["latency", "mean", "p50", "p90", "p99"]
    assert _cells(latency[4]) == ["ITL s", "0.25", "0.25", "0.25", "0.25"]
    assert _cells(totals[3]) == ["2", "1", "timeout=1", "0.5", "-", "1", "2"]
    assert _cells(replicas[3]) == ["w1", "1"]
    nothing = ReplayResult("http://x", 1, 1.0, [], Counter({"connect": 1})).summary()
    tables = endpoint_tables("t", nothing).split("\n\n")
    assert len(tables) == 2 and _cells(tables[0].splitlines()[3]) == ["TTFT s", "-", "-", "-", "-"]
    panels = dict(endpoint_panels(summary))
    assert panels["TTFT s"] == {"mean": 0.5, "p50": 0.5, "p90": 0.5, "p99": 0.5}
    assert panels["requests per replica"] == {"w1": 1.0}
    assert dict(endpoint_panels(nothing))["E2E s"] == {}
