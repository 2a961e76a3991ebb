"""`prefixgate bench ep` end to end on a tiny model: a table, JSON and a plot, and a skewed gate that
shows up as rank imbalance where a uniform one does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixgate.cli import main

pytestmark = pytest.mark.fleet


def test_the_benchmark_reports_imbalance_for_a_skewed_gate(tmp_path: Path) -> None:
    out = tmp_path / "ep.json"
    main(
        [
            "bench", "ep", "--ep-sizes", "1,2", "--prompts", "2", "--prompt-len", "8", "--decode", "2",
            "--layers", "1", "--hidden", "64", "--workdir", str(tmp_path / "models"),
            "--json", str(out), "--plot", str(tmp_path / "ep.png"),
        ]
    )  # fmt: skip
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"uniform/ep1", "uniform/ep2", "skewed/ep1", "skewed/ep2"}
    assert results["skewed/ep1"]["imbalance"] == results["uniform/ep1"]["imbalance"] == 1.0
    assert results["skewed/ep2"]["imbalance"] > results["uniform/ep2"]["imbalance"]
    assert all(r["step_ms"] > 0.0 for r in results.values())
    assert (tmp_path / "ep.png").stat().st_size > 0
