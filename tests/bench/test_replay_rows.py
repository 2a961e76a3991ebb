"""The rows of the fleet comparison: their order and names, the gateway configs that declare the
workers as each mode says, the workers of each unit, and the `--modes` and `--peers` flags."""

from __future__ import annotations

import argparse

import pytest

from bench.local_fleet import SimWorkers
from bench.replay import FLEET_POLICIES
from bench.replay_rows import (
    APPROX,
    BLOCKS64,
    FLEET_MODES,
    PRECISE,
    TEXT,
    FleetWorkers,
    Mode,
    PeerRow,
    Row,
    fleet_rows,
    fleet_workers,
    parse_modes,
    parse_peers,
    row_gateway_config,
)
from gateway.gateway_config import parse_config
from prefixgate.cli import build_parser
from workers.sim.profiles import get_profile


def test_rows_put_the_index_policies_side_by_side_per_mode() -> None:
    rows = fleet_rows(FLEET_POLICIES, FLEET_MODES)
    assert [r.name for r in rows] == [
        "prefix_aware approx cap x0.25",
        "cache_threshold approx cap x0.25",
        "prefix_aware approx cap x1",
        "cache_threshold approx cap x1",
        "prefix_aware approx cap x16",
        "cache_threshold approx cap x16",
        "prefix_aware approx cap absent",
        "cache_threshold approx cap absent",
        "prefix_aware precise",
        "cache_threshold precise",
        "least_load",
        "round_robin",
    ]


def test_gateway_configs_declare_the_workers_as_each_mode_says() -> None:
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]

    def replicas(mode: Mode) -> list:
        config = row_gateway_config("m", urls, "cache_threshold", mode, (16, 768), 8000)
        return parse_config(config).replicas

    approx = replicas(Mode(False, 16.0))
    assert [(r.id, r.kind, r.block_size, r.capacity_blocks) for r in approx] == [
        ("w0", "openai", 16, 768 * 16),
        ("w1", "openai", 16, 768 * 16),
    ]
    assert replicas(Mode(False, 0.25))[0].capacity_blocks == 192
    # Left out: whatever the gateway assumes (or learns) when it is told nothing.
    absent = row_gateway_config("m", urls, "prefix_aware", Mode(False), (16, 768), 8000)
    assert all("capacity_blocks" not in r and r["kind"] == "openai" for r in absent["replicas"])
    assert [r.kind for r in replicas(PRECISE)] == ["bundled", "bundled"]
    queued = row_gateway_config("m", urls, "prefix_aware", Mode(False, prefill_depth=2), (16, 768), 8000)
    assert parse_config(queued).limits.prefill_depth == 2
    unqueued = row_gateway_config("m", urls, "prefix_aware", APPROX, (16, 768), 8000)
    assert parse_config(unqueued).limits.prefill_depth is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "replay", "--sim-fleet", "2", "--modes", "approx:-1"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "replay", "--sim-fleet", "2", "--modes", "fuzzy"])


def test_foreign_workers_are_declared_openai_in_every_row_and_the_text_gateway_tokenizes() -> None:
    rows = fleet_rows(["prefix_aware", "round_robin"], [APPROX], plain=APPROX)
    assert [(r.name, r.mode) for r in rows] == [
        ("prefix_aware approx cap absent", APPROX),
        ("round_robin", APPROX),
    ]
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    config = parse_config(row_gateway_config("m", urls, "round_robin", APPROX, (16, 768), 8000, text=True))
    assert config.tokenizer_for("m") == "default" and {r.kind for r in config.replicas} == {"openai"}
    on_text = parse_config(row_gateway_config("m", urls, "prefix_aware", TEXT, (16, 768), 8000, text=True))
    assert on_text.tokenizer_for("m") == "text" and {r.kind for r in on_text.replicas} == {"openai"}
    assert (
        parse_config(row_gateway_config("m", urls, "round_robin", APPROX, (16, 768), 8000)).tokenizer_for("m")
        == "none"
    )
    words = fleet_workers(2, "h100-8b", (16, 768), "words")
    assert (words.spec.block_size, words.spec.num_blocks, words.flags) == (
        16,
        768,
        ("--sim-tokenizer", "words"),
    )
    blocks = fleet_workers(2, "h100-8b", (16, 768), "blocks64")
    assert (blocks.spec.block_size, blocks.spec.num_blocks, blocks.flags) == (BLOCKS64, 192, ())


def test_modes_are_named_and_tell_a_capacity_only_when_approximate_with_a_factor() -> None:
    assert (PRECISE.name, PRECISE.capacity_blocks(768)) == ("precise", None)
    assert (APPROX.name, APPROX.capacity_blocks(768)) == ("approx cap absent", None)
    assert (Mode(False, 0.25).name, Mode(False, 0.25).capacity_blocks(768)) == ("approx cap x0.25", 192)
    assert Mode(False, 1e-6).capacity_blocks(768) == 1  # never told less than a block
    assert Row("round_robin", APPROX).name == "round_robin"  # reads no index: one row, no mode
    assert Row("prefix_aware", PRECISE).name == "prefix_aware precise"
    assert PeerRow("sglang cache_aware").name == "sglang cache_aware"


def test_mode_and_peer_flags_name_rows_or_are_refused() -> None:
    assert parse_modes("precise, approx,approx:0.5,") == (PRECISE, APPROX, Mode(False, 0.5))
    assert parse_modes("text") == (TEXT,) and TEXT.name == "approx text"
    queued = parse_modes("precise@1,text@4,approx:0.5@2")
    assert queued == (
        Mode(True, prefill_depth=1),
        Mode(False, on_text=True, prefill_depth=4),
        Mode(False, 0.5, prefill_depth=2),
    )
    names = ["precise queued 1", "approx text queued 4", "approx cap x0.5 queued 2"]
    assert [m.name for m in queued] == names
    bad = ("", "approx:0", "approx:-1", "precise:2", "fuzzy", "approx:x", "text:2", "approx@0", "text@")
    bad += ("precise@x",)
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match="expected precise"):
            parse_modes(text)
    assert parse_peers("sglang") == ("sglang cache_aware",)
    assert parse_peers("sglang cache_aware, sglang") == ("sglang cache_aware",)  # each row once
    assert parse_peers("") == ()
    with pytest.raises(argparse.ArgumentTypeError, match="nginx"):
        parse_peers("vllm-router,nginx")


def test_workers_in_the_gateways_unit_keep_their_pool_and_an_unknown_unit_is_refused() -> None:
    plain = fleet_workers(3, "h100-8b", (16, 768), None)
    assert (plain.spec, plain.flags, plain.block_size) == (SimWorkers(3, "h100-8b", 16, 768), (), 16)
    assert FleetWorkers(SimWorkers(1, "h100-8b")).block_size == get_profile("h100-8b").block_size
    with pytest.raises(ValueError, match="unit must be one of"):
        fleet_workers(2, "h100-8b", (16, 768), "bytes")
