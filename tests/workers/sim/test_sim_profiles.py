"""Profiles: lookup, JSON round trip, and the h100-8b numbers against the published figures they cite."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from workers.sim.cost_model import StepShape, chunk_shape
from workers.sim.profiles import (
    CPU_SMOLLM2,
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_LINK,
    H100_8B,
    SMOLLM2_KV_BYTES_PER_TOKEN,
    Profile,
    get_profile,
    profile_from_json,
    profile_to_json,
)


def decodes(n: int, context: int) -> StepShape:
    total = StepShape()
    for _ in range(n):
        total += chunk_shape(context, 1)
    return total


def test_lookup_by_name_or_calibrated_json(tmp_path: Path) -> None:
    assert get_profile("h100-8b") is H100_8B
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(profile_to_json(CPU_SMOLLM2)))
    assert get_profile(str(path)) == CPU_SMOLLM2
    with pytest.raises(ValueError, match="h100-8b"):
        get_profile("a100-70b")


def test_json_round_trip() -> None:
    assert profile_from_json(json.loads(json.dumps(profile_to_json(H100_8B)))) == H100_8B


def old_style(profile: Profile, **changes: Any) -> dict[str, Any]:
    """The profile's JSON as calibrate wrote it before profiles had a KV size per token and a link."""
    data = profile_to_json(replace(profile, **changes))
    del data["kv_bytes_per_token"], data["link"]
    return data


def test_a_profile_written_before_kv_sizes_and_links_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old_style(CPU_SMOLLM2, source="calibrated before PD")))
    loaded = get_profile(str(path))
    # The model's KV size per token from the built-in profile of the same model; the loopback link.
    assert loaded == replace(CPU_SMOLLM2, source="calibrated before PD", link=DEFAULT_LINK)
    assert loaded.kv_bytes_per_token == SMOLLM2_KV_BYTES_PER_TOKEN
    assert DEFAULT_LINK.bytes_per_s == 1e9


def test_an_old_profile_of_an_unknown_model_gets_the_documented_defaults() -> None:
    loaded = profile_from_json(old_style(H100_8B, model_name="Qwen2.5-7B-Instruct"))
    assert loaded.kv_bytes_per_token == DEFAULT_KV_BYTES_PER_TOKEN == 128 * 1024
    assert loaded.link == DEFAULT_LINK
    # A known model keeps its own size, whichever profile it came from.
    assert profile_from_json(old_style(H100_8B)).kv_bytes_per_token == H100_8B.kv_bytes_per_token


def test_kv_capacity() -> None:
    # ~60 GB free for KV at 128 KiB per token: about 450k tokens.
    assert 440_000 < H100_8B.kv_capacity_tokens < 470_000
    assert H100_8B.num_blocks == H100_8B.kv_capacity_tokens // 256
    # The real engine's default: 256 MiB of fp32 SmolLM2 KV is 364 blocks of 16.
    assert CPU_SMOLLM2.num_blocks == 364


def test_h100_8b_lands_on_the_published_ballparks() -> None:
    cost = H100_8B.cost
    # Single-stream decode: ~7-8 ms per token (weights read once per step, plus overhead).
    assert 0.006 < cost.time(decodes(1, 1000)) < 0.010
    # High-batch decode: 30-40 ms TPOT at 256 sequences.
    assert 0.025 < cost.time(decodes(256, 1500)) < 0.045
    # Pure prefill at 40-60% MFU: 20-40k tokens/s; an 8k prompt's attention costs extra per token.
    rate_2k = 2048 / cost.time(chunk_shape(0, 2048))
    rate_8k = 8192 / cost.time(chunk_shape(0, 8192))
    assert 20_000 < rate_8k < rate_2k < 40_000
