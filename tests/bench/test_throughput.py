"""`bench throughput` end to end (the replica and the gateways, one process and two, as processes, the
peer left out), and the chats it sends: each new from its first word."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import orjson
import pytest

from bench.throughput import FLOOR, PEER, chat_bodies
from prefixgate.cli import main


def test_no_two_chats_share_a_first_word() -> None:
    chats = [orjson.loads(b) for b in itertools.islice(chat_bodies(random.Random(0), 10), 3000)]
    firsts = [c["messages"][0]["content"].split()[0] for c in chats]
    assert len(set(firsts)) == len(chats)
    assert all(len(c["messages"][0]["content"].split()) == 10 for c in chats)
    assert all(c["max_tokens"] == 1 and "stream" not in c for c in chats)


@pytest.mark.fleet
def test_cli_measures_the_replica_and_the_gateway(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    argv = [
        "bench",
        "throughput",
        "--words",
        "20,60",
        "--clients",
        "4",
        "--duration",
        "0.5",
        "--warm-up",
        "0.2",
        "--gateway-workers",
        "1,2",
        "--tokenizers",
        "default,text",
    ]
    main([*argv, "--no-peer", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert payload["missing"] == {PEER: "left out (--no-peer)"}
    # Two processes (and their parent) hold more than one.
    assert payload["peak_rss_mib"]["prefixgate x2"] > payload["peak_rss_mib"]["prefixgate"] > 20
    for words in ("20", "60"):
        result = payload["results"][words]
        gateways = {"prefixgate", "prefixgate x2", "prefixgate text", "prefixgate text x2"}
        assert set(result["req_s"]) == {"direct", FLOOR, *gateways}
        assert all(rate > 0 for rate in result["req_s"].values())
        # Each target measured twice (ABBA), its better phase reported.
        assert all(len(p) == 2 for p in result["phases_req_s"].values())
        assert result["req_s"]["prefixgate"] == max(result["phases_req_s"]["prefixgate"])
        assert result["failed"] == dict.fromkeys(["direct", FLOOR, *gateways], 0)
        # The two-process gateway's CPU is its processes' (the parent alone relays and would read ~0).
        assert set(result["cpu_s_per_request"]) == {FLOOR, *gateways}
        assert all(result["cpu_s_per_request"][g] > 0.1e-3 for g in gateways)
        # The floor forwards the same requests with none of the gateway's work: it costs less.
        floor = result["cpu_s_per_request"][FLOOR]
        assert 0 < floor < min(result["cpu_s_per_request"][g] for g in gateways)
        # Each gateway's GC pauses, read from its /metrics around each phase.
        assert set(result["gc_s_per_request"]) == gateways
        assert all(0 <= s < result["cpu_s_per_request"][g] for g, s in result["gc_s_per_request"].items())
    assert set(payload["longest_gc_pause_s"]) == gateways


def test_an_unknown_collector_setting_is_refused() -> None:
    with pytest.raises(SystemExit, match="--collectors"):
        main(["bench", "throughput", "--collectors", "tuned,off", "--no-peer"])
