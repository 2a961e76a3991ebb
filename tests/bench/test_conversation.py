"""`bench conversation` end to end: a real simulated worker and three real gateways (caches on and
off), each timed in a phase of its own against direct sends of the same rounds, and the table, JSON
and PNG that come out."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from bench.conversation import PATHS, conversation
from prefixgate.cli import main


def test_each_round_resends_the_whole_history_and_adds_one_user_turn() -> None:
    rounds = conversation(random.Random(0), system_words=20, turn_words=5, rounds=3)
    assert [len(m) for m in rounds] == [2, 4, 6]
    assert [m["role"] for m in rounds[-1]] == ["system", "user", "assistant", "user", "assistant", "user"]
    for earlier, later in itertools.pairwise(rounds):
        assert later[: len(earlier)] == earlier
    assert len(rounds[0][0]["content"].split()) == 20


@pytest.mark.fleet
def test_cli_times_every_path_and_reads_the_cache_of_the_gateway_that_has_one(tmp_path: Path) -> None:
    out = tmp_path / "conversation.json"
    argv = ["bench", "conversation", "--system-words", "300", "--turn-words", "10", "--rounds", "4"]
    main([*argv, "--conversations", "2", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0

    for path in PATHS:
        ttft, e2e = payload["latency"][path]["ttft_s"], payload["latency"][path]["e2e_s"]
        assert 0 < ttft["p50"] <= ttft["p99"] <= e2e["p99"]
    # Two conversations of four rounds: each one's first round misses, the three after it hit.
    cache = payload["cache"]
    assert (cache["hit"], cache["miss"]) == (6, 2)
    assert 0 < cache["token_share"] < 1 and cache["hit_rate"] == pytest.approx(0.75)
    assert 0 < cache["block_share"] < 1
    for path in PATHS[1:]:
        assert payload["added_s"][path]["ttft_s_p50"] == pytest.approx(
            payload["latency"][path]["ttft_s"]["p50"] - payload["direct_by_phase"][path]["ttft_s"]["p50"]
        )
        assert payload["gateway_memory"][path]["peak_rss_bytes"] > 0
    assert set(payload["direct_by_phase"]) == set(PATHS[1:])
    assert isinstance(payload["bar"]["met"], bool)
    assert isinstance(payload["bar"]["met_routed_on_text"], bool)
