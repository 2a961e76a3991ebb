"""The KV link: one transfer's time on an idle link, and the profiles' figures it is built from."""

from __future__ import annotations

import pytest

from workers.sim.link import KvLink
from workers.sim.profiles import H100_8B, LLAMA3_HEAD_DIM, LLAMA3_KV_HEADS, LLAMA3_LAYERS


def test_time_is_latency_plus_bytes_over_bandwidth() -> None:
    link = KvLink(bytes_per_s=2e9, latency_s=0.001)
    assert link.time(4_000_000_000) == pytest.approx(2.001)
    assert link.time(2 * 4_000_000_000) - link.time(4_000_000_000) == pytest.approx(2.0)
    assert link.time(0) == 0.0


def test_nonsense_is_refused() -> None:
    with pytest.raises(ValueError, match="bytes_per_s"):
        KvLink(bytes_per_s=0.0, latency_s=0.0)
    with pytest.raises(ValueError, match="latency_s"):
        KvLink(bytes_per_s=1e9, latency_s=float("nan"))
    with pytest.raises(ValueError, match="num_bytes"):
        KvLink(bytes_per_s=1e9, latency_s=0.0).time(-1)


def test_h100_8b_moves_128_kib_per_token_at_most_the_nic_line_rate() -> None:
    assert (
        H100_8B.kv_bytes_per_token == 2 * LLAMA3_LAYERS * LLAMA3_KV_HEADS * LLAMA3_HEAD_DIM * 2 == 128 * 1024
    )
    assert H100_8B.link.bytes_per_s <= 400e9 / 8
    # A 10k-token prompt's KV (1.3 GB) crosses in tens of milliseconds: a small share of its prefill.
    assert 0.01 < H100_8B.link.time(10_000 * H100_8B.kv_bytes_per_token) < 0.1
