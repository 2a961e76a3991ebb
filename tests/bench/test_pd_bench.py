"""`bench fleet --pd`: the table, JSON and plot of a set of splits, and the closing comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.latency import RequestLatency, Slo, summarize
from bench.pd_bench import best, verdict
from bench.pd_fleet import PdResult, Split
from prefixgate.cli import main


def result(split: Split, ttft_s: float, gaps: list[float]) -> PdResult:
    latencies = [RequestLatency(ttft_s, sum(gaps) / len(gaps), max(gaps))]
    return PdResult(split, summarize(latencies, gaps, 1, 1.0, Slo()), {}, tuple(latencies))


def test_the_best_split_serves_most_within_the_slo_and_the_verdict_compares_it_to_mixed() -> None:
    mixed = result(Split(4, 0), 3.0, [0.02] * 98 + [0.4] * 2)
    fast_start = result(Split(2, 2), 0.5, [0.02] * 100)
    late = result(Split(1, 3), 5.0, [0.01] * 100)
    assert best([mixed, fast_start, late]) is fast_start
    note = verdict([mixed, fast_start, late])
    assert note.startswith("best split: 2P:2D: ITL p99 20.00x lower, ")
    assert note.endswith("goodput from none and stall-free goodput from none against 4 mixed")
    assert verdict([mixed]) == "best split: 4 mixed"


def test_the_verdict_tells_a_stall_free_gain_from_an_equal_goodput() -> None:
    # Mixed streams that average within the ITL target but freeze for 0.4 s twice: goodput all the
    # same, stall-free goodput none. The tie on goodput goes to the lower ITL p99.
    mixed = result(Split(4, 0), 0.5, [0.02] * 98 + [0.4] * 2)
    split = result(Split(2, 2), 0.8, [0.025] * 100)
    assert mixed.summary.goodput_share == split.summary.goodput_share == 1.0
    assert best([mixed, split]) is split
    assert verdict([mixed, split]).endswith("goodput 1.00x and stall-free goodput from none against 4 mixed")


def test_cli_runs_the_splits_on_longmix_with_table_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pd.json"
    argv = ["bench", "fleet", "--workload", "longmix", "--sessions", "8", "--block-size", "16"]
    argv += ["--max-batched-tokens", "4096"]
    slo = ["--slo-itl", "0.04", "--slo-stall", "0.3", "--reserve-wait", "5"]
    main([*argv, "--pd", "2:0,1:1", "--pd", "1:0", *slo, "--json", str(out), "--workers", "2"])
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").exists()
    assert set(payload["splits"]) == {"2 mixed", "1P:1D", "1 mixed"}
    assert payload["requests"] == 8 and payload["slo"] == {"ttft_s": 2.0, "itl_s": 0.04, "stall_s": 0.3}
    assert payload["reserve_wait_s"] == 5.0 and payload["max_num_batched_tokens"] == 4096
    assert payload["kv_bytes_per_token"] == 128 * 1024
    pd = payload["splits"]["1P:1D"]
    assert pd["routes"] == {"transfer": 8} and pd["transferred_gb"] > 0 and 0 < pd["transfer_share"] < 1
    assert payload["splits"]["2 mixed"]["transferred_gb"] == 0
    for row in payload["splits"].values():
        assert row["completed"] == 8 and 0 <= row["goodput_share"] <= 1 and 0 <= row["stall_free_share"] <= 1
        assert row["itl_p99_s"] > 0 and row["ttft_p99_s"] > 0
    printed = capsys.readouterr().out
    assert "1P:1D" in printed and payload["verdict"] in printed
    assert "stall-free: TTFT <= 2 s and every gap <= 300 ms" in printed and "room wait <= 5 s" in printed
