"""The replay's report: its tables for the terminal and the bar panels of its plot, of one endpoint's
summary (bench.replay_result) or of the fleet comparison's rows. Pure functions of the payload
written to JSON, so that a table can be rebuilt from a saved run."""

from __future__ import annotations

from typing import Any

from bench.replay_result import PERCENTILES
from bench.report import format_table

_FLEET_COLUMNS = (
    ("TTFT mean s", "ttft_s", "mean"),
    ("TTFT p50 s", "ttft_s", "p50"),
    ("TTFT p99 s", "ttft_s", "p99"),
    ("E2E p50 s", "e2e_s", "p50"),
    ("E2E p99 s", "e2e_s", "p99"),
)


def fleet_tables(title: str, p: dict[str, Any]) -> str:
    """The fleet comparison's rows side by side, then how each spread its requests over the workers
    (all of them, those that got none included)."""
    replicas = [f"w{i}" for i in range(p["sim_fleet"]["count"])]
    rows = [[policy, *comparison_cells(r)] for policy, r in p["policies"].items()]
    spread = [
        [policy, *(r["requests_per_replica"].get(w, 0) for w in replicas)]
        for policy, r in p["policies"].items()
    ]
    return "\n\n".join(
        [
            format_table(title, ["policy", *COMPARISON_COLUMNS], rows),
            format_table("requests per replica", ["policy", *replicas], spread),
        ]
    )


# What the gateway's model is checked against, beside each row's latency (model_cells).
MODEL_COLUMNS = ("moved turns", "predicted/seen TTFT", "predicted/seen cached (under / over)")
# A comparison row's columns after its name: in `bench replay --sim-fleet` and in `bench vllm`.
COMPARISON_COLUMNS = (
    *(c[0] for c in _FLEET_COLUMNS),
    "hit rate",
    "imbalance",
    *MODEL_COLUMNS,
    "completed",
    "errors",
)


def comparison_cells(r: dict[str, Any]) -> list[Any]:
    """A router's summary as the cells of COMPARISON_COLUMNS ("-": not measured, never an instant 0)."""
    latency = ["-" if r[key][s] is None else r[key][s] for _, key, s in _FLEET_COLUMNS]
    errors = ", ".join(f"{k}={v}" for k, v in r["errors"].items()) or "0"
    return [*latency, r["hit_rate"], r["imbalance"], *model_cells(r), r["completed"], errors]


def model_cells(r: dict[str, Any]) -> list[Any]:
    """A summary's moved turns and the gateway's predictions against what was seen ("-": a peer router,
    which predicts nothing, or nothing to read)."""
    moved = "-" if r["moved_turns"] is None else r["moved_turns"]
    ttft = "-" if r["ttft_predicted"] is None else r["ttft_predicted"]
    cached = r["cached_predicted"]
    if cached is None:
        cache = "-"
    else:
        ratio = "-" if cached["ratio"] is None else f"{cached['ratio']:.2f}"
        cache = f"{ratio} ({cached['under']:.0%} / {cached['over']:.0%})"
    return [moved, ttft, cache]


def plot_label(row: str) -> str:
    """A row's name short enough for a bar's label: "prefix_aware approx cap x16" is "prefix_aware ~x16"."""
    return row.replace(" approx cap absent", " ~none").replace(" approx cap ", " ~")


def fleet_panels(p: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """The plot's panels, a bar per row; latencies not measured are left out rather than drawn as 0."""
    rows = {plot_label(name): r for name, r in p["policies"].items()}
    panels = [
        (name, {policy: r[key][s] for policy, r in rows.items() if r[key][s] is not None})
        for name, key, s in _FLEET_COLUMNS
    ]
    moved = {policy: r["moved_turns"] for policy, r in rows.items() if r["moved_turns"] is not None}
    return [
        *panels,
        ("hit rate", {policy: r["hit_rate"] for policy, r in rows.items()}),
        ("imbalance (max/mean)", {policy: r["imbalance"] for policy, r in rows.items()}),
        *([("moved turns", moved)] if moved else []),
    ]


_LATENCIES = (("TTFT s", "ttft_s"), ("ITL s", "itl_s"), ("E2E s", "e2e_s"))


def endpoint_tables(title: str, p: dict[str, Any]) -> str:
    """One endpoint's latency percentiles, totals and, when the answers named any, its replicas."""
    stats = ["mean", *(f"p{q}" for q in PERCENTILES)]
    latency = [[name, *("-" if p[key][s] is None else p[key][s] for s in stats)] for name, key in _LATENCIES]
    errors = ", ".join(f"{k}={v}" for k, v in p["errors"].items()) or "0"
    moved = "-" if p["moved_turns"] is None else p["moved_turns"]
    totals = [
        [p["sent"], p["completed"], errors, p["hit_rate"], moved, p["throughput_req_s"], p["output_tok_s"]]
    ]
    replicas = [[r, n] for r, n in p["requests_per_replica"].items()]
    tables = [
        format_table(title, ["latency", *stats], latency),
        format_table(
            "totals", ["sent", "completed", "errors", "hit rate", "moved turns", "req/s", "out tok/s"], totals
        ),
    ]
    if replicas:
        tables.append(format_table("requests per replica", ["replica", "requests"], replicas))
    return "\n\n".join(tables)


def endpoint_panels(p: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """The plot's panels for one endpoint: each latency's statistics, and the requests per replica."""
    panels = [(name, {s: v for s, v in p[key].items() if v is not None}) for name, key in _LATENCIES]
    return [*panels, ("requests per replica", {r: float(n) for r, n in p["requests_per_replica"].items()})]
