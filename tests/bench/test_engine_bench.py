"""The engine benchmark runs end to end at a tiny size and reports every figure the issue names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixgate.cli import main

pytestmark = pytest.mark.real


def test_engine_bench_reports_all_systems(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    args = "--requests 4 --rate 50 --min-prompt 8 --max-prompt 120 --min-output 2 --max-output 4"
    args += " --static-batch 2 --prefix-prompt 320 --prefix-cached 304 --prefix-repeats 1"
    main(["bench", "engine", *args.split(), "--json", str(out)])
    payload = json.loads(out.read_text())
    for system in ("engine", "hf_static", "hf_continuous"):
        assert payload[system]["tokens_per_s"] > 0
        assert payload[system]["ttft_mean_s"] > 0
    # 16 uncached tokens against 320 cold: the cached prefix must show.
    assert payload["cached_prefix_ttft_ratio"] < 0.9
    # Short and long sequences together: pages fit each one, a contiguous cache reserves the longest.
    kv = payload["kv_bytes_per_token"]
    assert 0 < kv["paged"] <= kv["contiguous"]
    assert out.with_suffix(".png").exists()
