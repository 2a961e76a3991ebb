"""`bench fleet --ep`: an MoE model's expert-parallel layouts at equal GPUs, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.fleet_ep import layouts, parse_groups
from bench.trace import write_conversation_trace
from prefixgate.cli import main
from workers.sim.moe_routing import Gate

MIXTRAL = "mixtral-8x7b-h100"


def test_cli_compares_the_layouts_in_a_table_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    trace = write_conversation_trace(tmp_path / "t.jsonl", conversations=6, turns=2)
    out = tmp_path / "ep.json"
    argv = ["bench", "fleet", "--trace", str(trace), "--profile", MIXTRAL, "--ep", "2,4,8", "--workers", "2"]
    main([*argv, "--json", str(out)])
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert "4 x EP2" in capsys.readouterr().out
    assert set(payload["layouts"]) == {"4 x EP2", "2 x EP4", "1 x EP8"}
    rows = sorted(payload["layouts"].values(), key=lambda r: r["group"])
    assert [(r["group"], r["replicas"]) for r in rows] == [(2, 4), (4, 2), (8, 1)]
    kv = [r["kv_tokens_per_replica"] for r in rows]
    assert kv == sorted(set(kv))
    for row in rows:
        assert row["completed"] == payload["requests"] == 12 and row["rejected"] == 0
        assert 0 < row["ttft_mean_s"] <= row["ttft_p99_s"] and row["throughput_tok_s"] > 0
        decode = row["decode_step"]
        assert decode["total_s"] == pytest.approx(
            decode["dense_s"] + decode["experts_s"] + decode["all_to_all_s"]
        )
    assert payload["model"]["experts"] == 8 and payload["model"]["top_k"] == 2
    assert payload["gate_zipf"] == 0.0 and payload["policy"] == "prefix_aware"


def test_groups_and_gpus_must_fit() -> None:
    assert parse_groups("2, 4,8") == [2, 4, 8]
    for bad in ("2,x", "0", "2,,4"):
        with pytest.raises(ValueError, match="--ep"):
            parse_groups(bad)
    with pytest.raises(ValueError, match="do not split"):
        layouts(MIXTRAL, [4], 6, Gate(), None)
    assert [layout.name for layout in layouts(MIXTRAL, [2, 4], 8, Gate(), 16)] == ["4 x EP2", "2 x EP4"]
    assert layouts(MIXTRAL, [2], 8, Gate(), 16)[0].profile.block_size == 16
