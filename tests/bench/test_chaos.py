"""`bench chaos` end to end on one scenario (the others run in tests/faults with finer checks): its
processes started and stopped, the table printed, the JSON and PNG written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.chaos import SCENARIOS
from prefixgate.cli import main

pytestmark = pytest.mark.fleet


@pytest.mark.timeout(120)
def test_cli_runs_a_scenario_and_reports_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "chaos.json"
    main(
        [
            "bench",
            "chaos",
            "--only",
            "stuck_upstream",
            "--json",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
        ]
    )
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert payload["passed"] is True
    [result] = payload["scenarios"]
    assert result["scenario"] == "stuck_upstream" and result["passed"]
    assert result["requests"] == result["succeeded"] > 0 and result["failed"] == 0
    assert 0 <= result["recovered_s"] < 10 and all(result["checks"].values())
    table = capsys.readouterr().out
    assert "recovered in s" in table and "stuck_upstream" in table and "pass" in table
    # Each process it started logged to the work folder, for a failure to be looked into.
    assert sorted(p.name for p in (tmp_path / "work" / "stuck_upstream").glob("*.log")) == [
        "gateway.log", "worker-s0.log", "worker-s1.log",
    ]  # fmt: skip


def test_every_scenario_is_offered() -> None:
    assert list(SCENARIOS) == [
        "replica_killed",
        "redis_down",
        "overload",
        "disconnect_storm",
        "stuck_upstream",
        "streams_replica_killed",
    ]
