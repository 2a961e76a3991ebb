"""Several processes' expositions as one: every sample labelled by its process, every family whole."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics_merge import merge_expositions


def _exposition(requests: int, healthy: float) -> bytes:
    registry = CollectorRegistry()
    Counter("requests", "requests served", ["route"], registry=registry).labels("chat").inc(requests)
    Gauge("up", "whether it is up", registry=registry).set(healthy)
    Histogram("wait_seconds", "waits", buckets=(0.1, 1.0), registry=registry).observe(0.5)
    return generate_latest(registry)


def test_each_process_keeps_its_samples_under_one_family() -> None:
    merged = merge_expositions([("0", _exposition(3, 1)), ("1", _exposition(5, 0))]).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    one = text_string_to_metric_families(_exposition(1, 1).decode())
    assert set(families) == {f.name for f in one} >= {"requests", "up", "wait_seconds"}
    assert merged.count("# TYPE requests_total counter") == 1 and merged.count("# HELP up ") == 1
    totals = {
        s.labels["process"]: s.value for s in families["requests"].samples if s.name == "requests_total"
    }
    assert totals == {"0": 3.0, "1": 5.0}
    assert all(
        s.labels["route"] == "chat" for s in families["requests"].samples if s.name == "requests_total"
    )
    assert {s.labels["process"]: s.value for s in families["up"].samples} == {"0": 1.0, "1": 0.0}
    buckets = [s for s in families["wait_seconds"].samples if s.name == "wait_seconds_bucket"]
    assert {(s.labels["process"], s.labels["le"]) for s in buckets} == {
        (p, le) for p in "01" for le in ("0.1", "1.0", "+Inf")
    }


def test_a_label_value_with_spaces_and_braces_stays_whole() -> None:
    text = b'# HELP m a metric\n# TYPE m gauge\nm{why="a {b} c"} 2.0\n'
    merged = merge_expositions([("3", text)]).decode()
    (family,) = text_string_to_metric_families(merged)
    assert [(s.labels, s.value) for s in family.samples] == [({"process": "3", "why": "a {b} c"}, 2.0)]
