"""The hot-path benchmark runs small, checks its own answers against the naive paths, and reports."""

from __future__ import annotations

import json
from pathlib import Path

from prefixgate.cli import main


def test_radix_bench_reports_ratios_and_memory(tmp_path: Path) -> None:
    out = tmp_path / "radix.json"
    main(
        [
            "bench",
            "radix",
            "--prompt-tokens",
            "1024",
            "--index-entries",
            "20000",
            "--replicas",
            "8",
            "--repeats",
            "20",
            "--memory-entries",
            "5000",
            "--bound-entries",
            "20000",
            "--bound-prompts",
            "3000",
            "--json",
            str(out),
        ]
    )
    results = json.loads(out.read_text())
    timed = [r for r in results.values() if "p50_ms" in r]
    assert len(timed) == 4
    assert all(r["p50_ms"] > 0 and r["speedup"] > 0 for r in timed)
    # A flat dict entry plus an LRU slot: tens to a few hundred bytes, not kilobytes.
    assert 20 < results["memory"]["bytes_per_entry"] < 1000
    # New prompts at the entry bound, the expiry rows trimmed and (as before) rebuilt whole.
    for rows in ("trimmed rows", "rows rebuilt whole"):
        at_bound = results[f"at the bound, {rows}"]
        assert at_bound["mean_us"] > 0 and at_bound["p99_us"] <= at_bound["worst_ms"] * 1e3
    assert out.with_suffix(".png").exists()
